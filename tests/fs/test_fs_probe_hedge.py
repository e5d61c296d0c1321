"""The file tier's side of the load decision: a read the caller bounds (its hedge) and the timed probe reads.

A hedged read past its bound is reported failed (the request recomputes), counted apart from hung
reads, and never lands late; the probe prices the mount from two reads of one of its chunk files,
latency apart from bandwidth, counts a read that hangs as at least its age, stops a round on a slow
mount at its time budget, and checks a changed mount again soon.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_fs_deadlines import SECRET, _metric, faults  # noqa: F401  (the fixture)

from fs_helpers import CHUNK, aligned, key, write_all
from tpu_offload.core.costs import FILE, CostModel, TransferCost
from tpu_offload.core.fs.probe import ReadProbe, find_chunk_file


def one_chunk_tier(root, make_tier):
    """A signed tier holding one published chunk file: what the probe reads."""
    t = make_tier(root, secret=SECRET)
    write_all(t, 1)
    t.flush(10)
    return t


def test_a_hedged_read_fails_at_its_own_bound_and_is_counted_apart(root, make_tier, faults):  # noqa: F811
    t = make_tier(root, secret=SECRET, io_timeout_s=5.0)
    write_all(t, 1)
    out = aligned()
    out[:] = 0xAB
    box, landed = {}, threading.Event()
    faults.hang("read", 1.0)  # a slow mount: every read takes a second
    t0 = time.monotonic()
    assert t.submit_read(key(1), out, lambda ok: (box.update(ok=ok, t=time.monotonic()), landed.set()),
                         deadline_s=0.2)
    assert landed.wait(3)
    assert box["ok"] is False and box["t"] - t0 < 0.6, box["t"] - t0  # its bound, not fs_io_timeout_s
    c = t.counters()
    assert c["read_hedged"] == 1 and c.get("read_timeouts", 0) == 0
    assert _metric(t, "tpu_offload_fs_ops_total", op="read", result="hedged") == 1
    deadline = time.monotonic() + 5
    while t.counters().get("late_reads_dropped", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (out == 0xAB).all(), "the abandoned read landed in the caller's buffer"
    faults.clear()
    ok = threading.Event()  # a bound the read meets: a hit, also without fs_io_timeout_s
    t2 = make_tier(root, secret=SECRET)
    assert t2.submit_read(key(1), out, lambda r: r and ok.set(), deadline_s=5.0) and ok.wait(5)


def test_the_probe_prices_the_mount_from_a_header_and_a_whole_file_read(root, make_tier, faults):  # noqa: F811
    t = make_tier(root, secret=SECRET)
    write_all(t, 1, 2, 3)
    t.flush(10)
    assert find_chunk_file(t.ns_dir) is not None
    cost = TransferCost(1e9, 5e-3)
    p = ReadProbe(lambda: t.ns_dir, cost)
    faults.hang("read", 0.05)  # 50 ms per read request: latency, whatever the size
    assert p.probe_once()
    assert p.probes == 2 and cost.samples == 2
    assert cost.latency_s == pytest.approx(0.05, rel=0.5)
    assert cost.seconds(CHUNK) < 0.2  # not 50 ms per 4 KiB
    assert not p.due()


def test_a_probe_that_hangs_prices_the_tier_at_its_age_and_none_runs_without_files(root, make_tier, faults):  # noqa: F811
    t = make_tier(root, secret=SECRET)
    m = CostModel("auto")
    p = ReadProbe(lambda: t.ns_dir, m.tiers[FILE], interval_s=0.05)
    assert not p.probe_once()  # nothing to read: nothing a request could load either
    write_all(t, 1)
    t.flush(10)
    faults.hang("read", 3.0)  # the mount hangs
    p.start()
    time.sleep(0.6)
    assert m.tiers[FILE].seconds(1) >= 0.5  # outstanding: priced at least at its age
    faults.clear()
    p.stop()


def test_a_probe_is_due_only_when_nothing_taught_the_tier_for_an_interval(root, make_tier):
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    t = one_chunk_tier(root, make_tier)
    cost = TransferCost(1e9, 5e-3, clock=clock)
    p = ReadProbe(lambda: t.ns_dir, cost, interval_s=30.0, clock=clock)
    assert p.due()  # never measured
    assert p.probe_once() and not p.due()
    now[0] = 29.0
    assert not p.due()
    now[0] = 31.0
    assert p.due()  # idle for an interval: measure again
    cost.observe(CHUNK, 0.01)  # a real load taught it meanwhile
    assert not p.due()
    now[0] = 62.0
    assert p.due()


def test_a_probe_round_on_a_slow_mount_stops_at_its_budget_and_learns_what_it_read(root, make_tier, monkeypatch):
    import os

    from tpu_offload.core.fs import probe

    t = one_chunk_tier(root, make_tier)
    preadv = os.preadv

    def at_100_kb_s(fd, bufs, offset):  # a mount throttled to 0.1 MB/s: a chunk file takes ~0.7 s
        n = preadv(fd, bufs, offset)
        time.sleep(n / 100e3)
        return n

    monkeypatch.setattr(os, "preadv", at_100_kb_s)
    monkeypatch.setattr(probe, "PIECE", 4096, raising=False)
    monkeypatch.setattr(probe, "BUDGET_S", 0.4, raising=False)
    cost = TransferCost(1e9, 5e-3)
    p = ReadProbe(lambda: t.ns_dir, cost)
    t0 = time.monotonic()
    assert p.probe_once()
    took = time.monotonic() - t0
    assert took < 1.0, took  # the header reads and part of one whole-file read, not three whole files (~2.2 s)
    assert p.probes == 2 and cost.samples == 2  # the header and the part read: latency apart from bandwidth
    assert cost.seconds(CHUNK) >= 0.5  # priced at the mount's speed, as slow as the reads were


def test_a_round_that_moved_a_measured_estimate_is_checked_again_after_a_quarter_interval(root, make_tier):
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    t = one_chunk_tier(root, make_tier)
    cost = TransferCost(1e9, 5e-3, clock=clock)
    cost.observe(CHUNK, 30.0)  # the decision stopped loading from a mount this slow
    p = ReadProbe(lambda: t.ns_dir, cost, interval_s=30.0, clock=clock)
    now[0] = 100.0
    assert p.probe_once()  # the mount is fast again: the estimate moved by orders of magnitude
    now[0] = 107.6
    assert p.due()  # confirmed a quarter interval later, not a whole one
    cost.observe(CHUNK, 0.01)  # a real load taught the tier meanwhile: back to the whole interval
    assert not p.due()
    now[0] = 138.0
    assert p.due()
