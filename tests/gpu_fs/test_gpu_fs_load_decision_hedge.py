"""The hedge on vLLM (no engine): with ``load_decision: auto`` a load that promotes files carries its
recompute time (``HostLoadSpec.budget_s``); the worker gives up reads not done by then, so the load's
blocks are load errors (vLLM recomputes them) at about that time, not at ``fs_io_timeout_s`` or when
a slow mount answers; the failed load teaches the manager's file tier as censored.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

from test_gpu_fs_manager import CHUNK, CTX, key as mkey, publish
from test_gpu_fs_worker import engine, finish, gpu, key, store
from gpu_fs_helpers import offloading_config
from tpu_offload.core import costs
from tpu_offload.core.costs import FILE, PrefillCost, TransferCost
from tpu_offload.core.fs import fileio
from tpu_offload.core.fs.probe import ReadProbe

from gpu_offload.vllm import manager as manager_mod
from gpu_offload.vllm.fs_specs import FileView, HostLoadSpec, fingerprint
from gpu_offload.vllm.manager import HostTierManager

READ_S = 3.0


def test_a_promotion_past_its_budget_fails_its_blocks_at_about_that_time(tmp_path):
    root = tmp_path / "fs"
    a, _ = engine(root)
    store(a, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert a.fs.flush(10)
    b, _ = engine(root, seed=1, io_timeout_s=10.0)
    release = threading.Event()
    fileio.fault = lambda op: release.wait(READ_S) if op == "read" else None
    try:
        t0 = time.monotonic()
        b.submit_load(2, HostLoadSpec([4, 5], [key(1), key(2)], [True, True], budget_s=0.2), gpu([10, 11, 12, 13]))
        finish(b, [2])
        took = time.monotonic() - t0
    finally:
        fileio.fault = None
        release.set()
    assert took < READ_S / 2, took  # its budget, not the slow mount nor fs_io_timeout_s
    assert b.take_load_error_blocks() == {10, 11, 12, 13}  # vLLM recomputes them
    assert b.fs.tier.counters()["read_hedged"] == 2
    for e in (a, b):
        e.shutdown()


def _manager(tmp_path, cfg, mode, monkeypatch):
    monkeypatch.setattr(ReadProbe, "start", lambda self: self)
    publish(tmp_path, cfg, 0, [mkey(1), mkey(2)])
    m = HostTierManager(4, CHUNK, blocks_per_chunk=1, tokens_per_block=128, load_decision=mode,
                        files=FileView(str(tmp_path), [fingerprint(cfg, 0)], CHUNK))
    m.costs.prefill = PrefillCost(1e-3)  # 128 ms per chunk to recompute
    m.costs.tiers[FILE] = TransferCost(1e12, 1e-6)  # believed fast: the decision loads
    return m


def test_the_manager_sends_the_hedge_of_the_recompute_time_as_the_budget_in_auto_only(tmp_path, monkeypatch):
    cfg = offloading_config({"num_cpu_chunks": 4})
    m = _manager(tmp_path, cfg, "auto", monkeypatch)
    try:
        assert m.probe is not None
        spec = m.prepare_load([mkey(1), mkey(2)], CTX)
        assert list(spec.promote) == [True, True]
        assert spec.budget_s == pytest.approx(costs.HEDGE_FACTOR * 2 * 128 * 1e-3)  # 2 chunks of 128 tokens
    finally:
        m.shutdown()
    m = _manager(tmp_path / "b", cfg, "always", monkeypatch)
    try:
        assert m.probe is None and m.prepare_load([mkey(1), mkey(2)], CTX).budget_s == 0.0
    finally:
        m.shutdown()


def test_an_abandoned_file_load_teaches_the_file_tier_more_than_its_age(tmp_path, monkeypatch):
    cfg = offloading_config({"num_cpu_chunks": 4})
    m = _manager(tmp_path, cfg, "auto", monkeypatch)
    now = [100.0]
    monkeypatch.setattr(manager_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    try:
        m.costs.tiers[FILE] = TransferCost(1e12, 1e-6)
        m.prepare_load([mkey(1), mkey(2)], CTX)
        now[0] += 0.256  # abandoned at its budget
        m.forget_chunks([mkey(1), mkey(2)])  # hooks: the load failed (before vLLM completes it)
        m.complete_load([mkey(1), mkey(2)], CTX)
        fs = m.costs.tiers[FILE]
        assert fs.samples == 1
        assert fs.seconds(2 * CHUNK) >= costs.CENSORED * 0.2
        d = m.costs.decide([FILE, FILE], CHUNK, 128)
        assert d.load == 0  # the next request recomputes
    finally:
        m.shutdown()
