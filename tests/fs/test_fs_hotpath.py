"""The per-chunk hot path: how many opens each operation costs, and the held namespace fd.

On NFS or Lustre every open is a network round trip, so the namespace
directory stays open and each operation opens only the two fan-out
directories (and the file). These tests pin those counts, so a change that
walks from the root again fails here, and check the held fd never outlives
the directory it names: removed, recreated, moved away or replaced by a
symlink, the tier misses or re-opens cleanly and never writes outside.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fs_helpers import CHUNK, aligned, key, payload, filled
from tpu_offload.core.fs import FileTier, FsMetrics, TierState
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs import safedir


@pytest.fixture
def opens(monkeypatch):
    """Counts every ``os.open`` (on any thread) while the test runs."""
    calls = []
    real = os.open

    def counting(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(os, "open", counting)
    return calls


@pytest.fixture
def outside():
    d = tempfile.mkdtemp(prefix="fs-hotpath-outside-", dir="/var/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _count(opens, fn):
    opens.clear()
    out = fn()
    return len(opens), out


def test_each_operation_opens_only_the_fanout_dirs_and_the_file(root, make_tier, opens):
    t = make_tier(root, touch_interval_s=3600)  # no restamp during the counts
    k, kh = key(1), fslayout.key_hex(key(1))
    assert t.submit_write(k, filled(1)).wait(10)  # creates the fan-out and opens the namespace fd
    os.unlink(t.path_of(k))
    out = aligned()
    # Two fan-out directories, then the temp file; the "already there" check shares that walk.
    assert _count(opens, lambda: t.submit_write(k, filled(1)).wait(10)) == (3, True)
    assert _count(opens, lambda: t.submit_write(k, filled(1)).wait(10)) == (2, True)  # already published
    assert t.counters()["writes_exist"] == 1
    assert _count(opens, lambda: t.read_into(k, out)) == (3, True)
    assert np.array_equal(out, payload(1))
    assert _count(opens, lambda: t.files.stat(kh))[0] == 2
    t._index.remove(k)
    assert _count(opens, lambda: t.contains(k)) == (2, True)
    assert _count(opens, lambda: t.files.restamp(kh, t._ours[k]))[0] == 3  # and the file: restamped through its fd
    assert _count(opens, lambda: t.files.unlink(kh)) == (2, True)
    assert _count(opens, lambda: t.read_into(k, out)) == (3, False)  # a miss at the file
    assert all(not (isinstance(p, str) and p.startswith(root)) for p in opens), "re-opened by path"


def test_namespace_removed_and_recreated_under_the_tier(root, make_tier):
    t = make_tier(root)
    for i in (1, 2):
        assert t.submit_write(key(i), filled(i)).wait(10)
    shutil.rmtree(t.ns_dir)
    os.mkdir(t.ns_dir)
    out = aligned()
    assert t.read_into(key(1), out) is False  # the old directory's file is gone: a miss
    assert t.files.stat(fslayout.key_hex(key(2))) is None  # (the index still lists it until a rescan)
    assert t.submit_write(key(3), filled(3)).wait(10)
    assert os.path.isfile(t.path_of(key(3))), "the write went to the recreated directory"
    assert t.read_into(key(3), out) and np.array_equal(out, payload(3))
    shutil.rmtree(t.ns_dir)  # removed, not recreated: a read misses, a write recreates it (as before)
    assert t.read_into(key(3), out) is False
    assert t.submit_write(key(4), filled(4)).wait(10) and os.path.isfile(t.path_of(key(4)))
    assert t.counters().get("read_errors", 0) == 0 and t.counters().get("writes_failed", 0) == 0


def test_namespace_moved_away_is_left_within_the_recheck(root, make_tier):
    """Moved aside and replaced: never written into again; the tier is off until its retry re-vets the path."""
    t = make_tier(root, readonly_retry_s=0.2)
    t.files.ns.recheck_s = 0  # re-check the path before every operation
    assert t.submit_write(key(1), filled(1)).wait(10)
    moved = os.path.join(root, "moved-away")
    os.rename(t.ns_dir, moved)
    os.mkdir(t.ns_dir, 0o700)
    assert t.submit_write(key(2), filled(2)).wait(10) is False
    assert t.state is TierState.OFF
    time.sleep(0.25)
    t.contains(key(2))  # the retry adopts the directory now at the path (ours)
    end = time.monotonic() + 10
    while t.state is not TierState.RW and time.monotonic() < end:
        time.sleep(0.02)
    assert t.submit_write(key(2), filled(2)).wait(10)
    assert os.path.isfile(t.path_of(key(2)))
    assert not any(fslayout.key_hex(key(2)) in f for _, _, fs in os.walk(moved) for f in fs)


def test_namespace_replaced_by_a_symlink_under_the_tier(root, make_tier, outside):
    t = make_tier(root)
    assert t.submit_write(key(1), filled(1)).wait(10)
    shutil.rmtree(t.ns_dir)
    os.symlink(outside, t.ns_dir)
    ticket = t.submit_write(key(2), filled(2))
    assert ticket is not None and ticket.wait(10) is False
    assert t.counters()["dropped_unsafe_path"] == 1
    assert t.read_into(key(1), aligned()) is False and not t.contains(key(2))
    assert os.listdir(outside) == [], "a write followed the symlinked namespace directory"


def test_concurrent_io_while_the_namespace_is_recreated_leaks_no_fd(root, make_tier):
    t = make_tier(root, threads=4, queue_depth=1024)
    fds_before = len(os.listdir("/proc/self/fd"))
    errors = []
    stop = threading.Event()

    def reader():
        out = aligned()
        while not stop.is_set():
            try:
                for i in range(16):
                    if t.read_into(key(i), out) and not np.array_equal(out, payload(i)):
                        errors.append(f"wrong bytes for {i}")
            except Exception as e:  # noqa: BLE001 - any exception is the failure
                errors.append(repr(e))

    th = threading.Thread(target=reader)
    th.start()
    bufs = [filled(i) for i in range(16)]
    try:
        for _ in range(10):
            tickets = [t.submit_write(key(i), bufs[i]) for i in range(16)]
            assert t.flush(30)
            assert all(x is None or x.done() for x in tickets)
            shutil.rmtree(t.ns_dir, ignore_errors=True)
            os.makedirs(t.ns_dir, exist_ok=True)
    finally:
        stop.set()
        th.join(30)
    assert errors == []
    t.close(10)
    assert len(os.listdir("/proc/self/fd")) <= fds_before, "a retired namespace fd was never closed"


def test_estale_reopens_the_namespace_once(root, make_tier, monkeypatch):
    """NFS answers ESTALE for a directory the server no longer knows: re-open from the path."""
    t = make_tier(root)
    assert t.submit_write(key(1), filled(1)).wait(10)
    real, fails = safedir.walk_at, [0]

    def stale_once(fd, names, **kw):
        if not fails[0]:
            fails[0] += 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(fd, names, **kw)

    monkeypatch.setattr(safedir, "walk_at", stale_once)
    held = t.files.ns._cur
    out = aligned()
    assert t.read_into(key(1), out) and np.array_equal(out, payload(1))
    assert fails[0] == 1 and held.retired and t.files.ns._cur is not held


def test_an_unclosed_tier_leaks_no_namespace_fd(root, fp):
    before = len(os.listdir("/proc/self/fd"))
    t = FileTier(root, fp, CHUNK, capacity_bytes=None, threads=1, fs_metrics=FsMetrics(CollectorRegistry()))
    assert t.submit_write(key(1), filled(1)).wait(10) and t.files.stat(fslayout.key_hex(key(1))) is not None
    t._workers.close(10)  # what an owner that forgets close() still ends: its threads
    del t
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
