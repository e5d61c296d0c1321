"""The hedge under vLLM's real scheduler (stand-in runner verifying every step's KV): with
``load_decision: auto`` a file-tier load that is not done by its recompute time is abandoned, its
blocks fail as any failed load's do, and the request recomputes them, with the right KV.

Engine A writes the prefix's files; engine B (empty host tier) believes the file tier fast, so it
bets on the load, while every file read takes seconds (the tier's fault hook: a slow mount).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest

from test_tpu_fs_forged import run
from tpu_offload.core.costs import FILE, PrefillCost, TransferCost
from tpu_offload.core.fs import fileio
from tpu_offload.core.fs.probe import ReadProbe
from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16
READ_S = 3.0  # every file read on the slow mount


@pytest.fixture
def make(fs_harness, monkeypatch):
    monkeypatch.setattr(ReadProbe, "start", lambda self: self)  # the test sets what B believes
    return functools.partial(fs_harness, staging_blocks=8, blocks_per_chunk=2, fs_write_mode="write_through")


def _believe_fast_files(h, s_per_token: float) -> None:
    h.sch.costs.tiers[FILE] = TransferCost(1e12, 1e-6)
    p = h.sch.costs.prefill = PrefillCost(s_per_token)
    p.observe = lambda *a, **k: None  # fixed: the stand-in's steps take microseconds


def test_a_slow_file_load_is_abandoned_at_its_recompute_time_and_recomputed(make, monkeypatch):
    p = prompt(4 * 2 * BS, 61)  # 4 chunks of 32 tokens
    a = make()
    want = run(a, p)
    b = make(load_decision="auto")
    _believe_fast_files(b, 1e-3)  # recompute: 128 tokens x 1 ms = 0.128 s: the hedge
    release = threading.Event()
    monkeypatch.setattr(fileio, "fault", lambda op: release.wait(READ_S) if op == "read" else None)
    rid = b.add(p, max_tokens=2)
    t0 = time.monotonic()
    try:
        b.run()  # until the request is done (its file writes may still queue behind the slow reads)
    finally:
        took = time.monotonic() - t0
        release.set()
    assert b.finished[rid] == want  # recomputed, tokens identical
    assert took < READ_S / 2, f"waited {took:.2f}s for a load whose recompute takes 0.13 s"
    assert b.wrk.fs.tier.counters()["read_hedged"] >= 1
    assert b.wrk.totals["load_errors"] >= 1  # through the failed-load contract
    assert b.sch.costs.tiers[FILE].samples >= 1 and b.sch.costs.tiers[FILE].seconds(1) >= 0.1  # it taught the tier
    assert b.sch.manager.stats().pinned_chunks == 0 and not b.sch.has_pending_work()


def test_always_is_not_hedged(make, monkeypatch):
    """``always`` loads every hit: no budget travels with its promotions (only fs_io_timeout_s bounds them)."""
    p = prompt(2 * 2 * BS, 62)
    a = make()
    run(a, p)
    b = make(load_decision="always")
    sent = []
    emit = b.sch.loads.emit

    def spy(meta, *args):
        left = emit(meta, *args)
        sent.extend(op.budget_s for op in meta.promotes)
        return left

    b.sch.loads.emit = spy
    run(b, p)
    assert sent and all(s == 0 for s in sent)
    assert b.wrk.totals.get("load_errors", 0) == 0
