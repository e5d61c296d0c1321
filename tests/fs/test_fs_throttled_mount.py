"""The throttled FUSE mount (``tpu_offload/testing/throttled_mount.py``): its throttle is real, and the
file tier works through it unchanged.

The throttle: every read request the kernel sends waits its latency and its turn at a bandwidth shared
by all threads, a second read of the same bytes included (``direct_io``: no page cache). The bars are
the throttle's own figures (requests x latency, bytes / rate): an unthrottled read of these few MiB
takes a few milliseconds, so none of them passes without it. The file tier: it writes, reads back
bit-exact, finds another instance's files by rescanning, and evicts on the mount, with its checks on
owners, modes, link counts and symlinks passing (no file quarantined, none unreadable, no foreign entry).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

from fs_helpers import CHUNK, FILE, aligned, key, payload
from tpu_offload.testing.throttled_mount import ThrottledMount, skip_reason

MIB = 1 << 20
SLACK_S = 0.5  # what a loaded 2-core machine may add to a timed read (an upper bound only)


@pytest.fixture(scope="module")
def mount():
    why = skip_reason()
    if why:
        pytest.skip(f"no throttled mount: {why}")
    base = tempfile.mkdtemp(prefix="throttled-test-", dir="/var/tmp")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.mkdir(src)
    try:
        with ThrottledMount(src, mnt) as m:
            yield m
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fresh(mount):
    """An empty directory on the mount, unthrottled again afterwards."""
    d = tempfile.mkdtemp(dir=mount.mnt)
    yield d
    mount.set(0, 0)
    shutil.rmtree(d, ignore_errors=True)


def _timed_read(path: str, block: int = MIB) -> tuple[float, bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0, parts, off = time.monotonic(), [], 0
        while b := os.pread(fd, block, off):
            parts.append(b)
            off += len(b)
        return time.monotonic() - t0, b"".join(parts)
    finally:
        os.close(fd)


def _requests(mount, fn):
    """Run ``fn``; return its result and the read requests the mount served meanwhile."""
    before = mount.stats()
    out = fn()
    time.sleep(0.05)  # the stats file is rewritten after each request
    return out, mount.stats()["reads"] - before["reads"]


def test_every_read_request_waits_its_latency_a_second_read_too(mount, fresh):
    data = os.urandom(4 * MIB)
    path = os.path.join(fresh, "f")
    with open(path, "wb") as f:
        f.write(data)
    mount.set(latency_ms=10, mbps=0)
    for _ in range(2):  # no page cache serves the second read
        (took, got), n = _requests(mount, lambda: _timed_read(path))
        assert got == data
        assert n >= 4  # at least one request per MiB read
        assert n * 0.010 * 0.9 <= took <= n * 0.010 + SLACK_S, (took, n)


def test_the_bandwidth_cap_is_shared_by_concurrent_readers_and_changes_at_runtime(mount, fresh):
    paths = []
    for i in range(2):
        paths.append(os.path.join(fresh, f"f{i}"))
        with open(paths[-1], "wb") as f:
            f.write(os.urandom(4 * MIB))
    mount.set(latency_ms=0, mbps=40)
    took, _ = _timed_read(paths[0])
    assert 4 * MIB / 40e6 * 0.9 <= took <= 4 * MIB / 40e6 + SLACK_S, took  # 0.105 s
    t0 = time.monotonic()
    threads = [threading.Thread(target=_timed_read, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = time.monotonic() - t0
    assert 8 * MIB / 40e6 * 0.9 <= both <= 8 * MIB / 40e6 + SLACK_S, both  # one link for the two: 0.21 s
    mount.set(latency_ms=0, mbps=10)  # the same mount, four times slower from the next read
    took, _ = _timed_read(paths[1])
    assert 4 * MIB / 10e6 * 0.9 <= took <= 4 * MIB / 10e6 + SLACK_S, took  # 0.42 s


def test_the_file_tier_writes_reads_rescans_and_evicts_through_the_mount(mount, fresh, make_tier):
    a = make_tier(fresh, capacity_bytes=4 * FILE, threads=2, touch_interval_s=0)
    for i in range(4):
        buf = aligned()
        buf[:] = payload(i)
        assert a.submit_write(key(i), buf).wait(30)
    assert a.flush(30)
    out = aligned()
    for i in range(4):
        assert a.read_into(key(i), out) and np.array_equal(out, payload(i))  # bit-exact
    b = make_tier(fresh, threads=2)  # another instance: indexes a's files at start
    assert sorted(b.keys_lru_order()) == sorted(key(i) for i in range(4))
    buf = aligned()
    buf[:] = payload(9)
    assert b.submit_write(key(9), buf).wait(30) and b.flush(30)
    a.rescan()  # finds b's file
    assert key(9) in a.keys_lru_order()
    mount.set(latency_ms=20, mbps=0)  # a's reads now cross the throttle
    t0 = time.monotonic()
    assert a.read_into(key(9), out) and np.array_equal(out, payload(9))
    assert time.monotonic() - t0 >= 0.020 * (CHUNK // (128 << 10) or 1) * 0.9
    mount.set(0, 0)
    for i in (10, 11):  # over a's budget of four: the least recently used go
        buf = aligned()
        buf[:] = payload(i)
        assert a.submit_write(key(i), buf).wait(30)
    assert a.flush(30)
    a.rescan()
    assert a.counters().get("evicted", 0) >= 2
    assert len(a.keys_lru_order()) <= 4 and a.contains(key(11))
    for t in (a, b):
        c, u = t.counters(), t.usage()
        assert not any(v for k, v in c.items() if "quarant" in k or "corrupt" in k or "auth" in k), c
        assert u["unreadable_paths"] == 0 and u["foreign_entries"] == 0, u
        assert u["state"] == "rw", u
