"""A tenant sharing our uid on the volume must not switch our tier off or empty its budget.

Each attack runs against a tier on a fresh tmpfs: what the tenant plants is
never counted, never deleted and shown by ``inspect``; a metadata change or
a failed syscall costs at most one recompute per chunk, and the tier comes
back within its retry delay once the cause is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time

import numpy as np
import pytest

from fs_helpers import CHUNK, FILE, aligned, filled, key, mounted, payload, write_all, wait_for
from tpu_offload.core.fs import TierState, admin, fileio
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.keyring import Keyring

SECRET = b"Xk3vQ8tR1wLp6mZs0dYe4hJb7nCf2gAu"
N = 8


@pytest.fixture
def tmpfs():
    with mounted("tmpfs", "size=64m") as d:
        yield d




def _on_disk(t):
    return sum(os.path.exists(t.path_of(key(i))) for i in range(N))


def _junk(path, nbytes=FILE):
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))


# ---- budget: only our own files count ----------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET])
def test_hardlinked_junk_under_our_temp_names_never_empties_the_budget(tmpfs, make_tier, secret):
    t = make_tier(tmpfs, capacity_bytes=N * FILE, secret=secret)
    write_all(t, *range(N))
    d = os.path.dirname(t.path_of(key(0)))
    junk = os.path.join(d, fslayout.temp_name(key(0).hex()))
    _junk(junk)
    links = [os.path.join(d, fslayout.temp_name(key(0).hex())) for _ in range(17)]
    for p in links:
        os.link(junk, p)
    t.rescan()
    assert _on_disk(t) == N, "junk temps were counted against our budget"
    write_all(t, 100)  # a new write lands and stays, at the cost of one LRU chunk at most
    t.rescan()
    assert os.path.exists(t.path_of(key(100))) and _on_disk(t) >= N - 1
    assert all(os.path.exists(p) for p in [junk, *links]), "someone else's files are never deleted"
    assert t.usage()["foreign_entries"] >= 18
    ns = admin.inspect(tmpfs, keyring=None if secret is None else Keyring(secret))["namespaces"][0]
    assert ns["temps"] == 0 and ns["foreign_entries"] >= 18 and ns["foreign"]


def test_copies_of_our_own_headers_under_temp_names_cost_at_most_a_quarter_of_the_budget(tmpfs, make_tier):
    """Our magic and a header MAC that verifies (a copy of a published chunk): counted, but capped."""
    t = make_tier(tmpfs, capacity_bytes=N * FILE, secret=SECRET, threads=2)
    write_all(t, *range(N))
    d = os.path.dirname(t.path_of(key(0)))
    for i in range(17):  # 17 "writers", each under its own pid: a per-writer cap alone would not hold
        shutil.copyfile(t.path_of(key(0)), os.path.join(d, f".tmp.{key(0).hex()[:16]}.{900000 + i}.0badc0de.01234567.{i}"))
    t.rescan()
    assert _on_disk(t) >= N - N // 4, "the temp allowance is not capped"
    write_all(t, 100)
    t.rescan()
    assert os.path.exists(t.path_of(key(100)))


@pytest.mark.parametrize("secret", [None, SECRET])
def test_junk_at_chunk_names_is_not_counted_nor_deleted(tmpfs, make_tier, secret):
    t = make_tier(tmpfs, capacity_bytes=N * FILE, secret=secret)
    write_all(t, *range(N))
    planted = []
    for i in range(N):
        name = f"{0xab00 + i:04x}" + "cd" * 18
        d = os.path.join(t.ns_dir, name[:2], name[2:4])
        os.makedirs(d, mode=0o700, exist_ok=True)
        planted.append(os.path.join(d, name))
        _junk(planted[-1])
    t.rescan()
    assert _on_disk(t) == N, "files without our magic were counted"
    assert all(os.path.exists(p) for p in planted)
    if secret is not None:  # our magic, a header not signed with our secret: still not ours
        forged = os.path.join(os.path.dirname(planted[0]), "ab01" + "ef" * 18)
        with open(t.path_of(key(0)), "rb") as f:
            body = bytearray(f.read())
        body[60] ^= 1  # the key field: the header MAC no longer verifies
        with open(forged, "wb") as f:
            f.write(body)
        t.rescan()
        assert _on_disk(t) == N and os.path.exists(forged)


def test_the_budget_never_goes_below_zero(tmpfs, make_tier):
    t = make_tier(tmpfs, capacity_bytes=N * FILE, threads=1)
    write_all(t, *range(N))
    t._scanner.temp_bytes = 10 * N * FILE  # whatever a scan saw
    t._enforce_budget()
    assert _on_disk(t) >= N - N // 4


# ---- availability -----------------------------------------------------------------------------


def test_chmod_g_plus_w_on_our_directories_is_repaired_not_refused(tmpfs, make_tier):
    w = make_tier(tmpfs)
    write_all(w, 1)
    w.close()
    fan = os.path.dirname(w.path_of(key(1)))
    os.chmod(w.ns_dir, 0o770)
    os.chmod(fan, 0o777)
    t = make_tier(tmpfs)
    assert t.state is TierState.RW
    assert stat.S_IMODE(os.stat(t.ns_dir).st_mode) == 0o700
    out = aligned()
    assert t.read_into(key(1), out) and np.array_equal(out, payload(1))
    assert stat.S_IMODE(os.stat(fan).st_mode) == 0o700
    os.chmod(t.ns_dir, 0o775)  # while it runs
    write_all(t, 2)
    t.rescan()
    assert key(1) in t.keys_lru_order() and key(2) in t.keys_lru_order()


@pytest.mark.parametrize("err", [errno.EACCES, errno.EPERM])
def test_a_refusal_in_one_directory_drops_that_write_not_the_tier(tmpfs, make_tier, monkeypatch, err):
    t = make_tier(tmpfs, readonly_retry_s=60)
    calls = []

    def fault(op):
        if op == "write" and not calls:
            calls.append(op)
            raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fileio, "fault", fault)
    assert t.submit_write(key(1), filled(1)).wait(10) is False
    assert t.state is TierState.RW, "one refused directory turned the tier read-only"
    write_all(t, 1, 2)


@pytest.mark.parametrize("err", [errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC])
def test_a_tier_wide_refusal_is_retried_like_enospc(tmpfs, make_tier, monkeypatch, err):
    t = make_tier(tmpfs, readonly_retry_s=0.3)
    broken = [True]

    def fault(op):
        if op == "write" and broken[0]:
            raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fileio, "fault", fault)
    monkeypatch.setattr(t, "_ns_writable", lambda: not broken[0])
    assert t.submit_write(key(1), filled(1)).wait(10) is False
    assert t.state is TierState.READ_ONLY
    broken[0] = False
    time.sleep(0.35)
    write_all(t, 1)
    assert t.state is TierState.RW


def test_a_full_disk_at_namespace_creation_is_retried(tmpfs, make_tier, monkeypatch):
    real = fslayout.make_dirs
    full = [True]

    def make_dirs(path, mode=fslayout.DIR_MODE):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, mode)

    monkeypatch.setattr(fslayout, "make_dirs", make_dirs)
    t = make_tier(tmpfs, readonly_retry_s=0.2)
    assert t.state is TierState.OFF and not t.contains(key(1))
    full[0] = False  # space is back
    time.sleep(0.25)
    t.contains(key(1))  # any use after the retry delay tries again
    assert wait_for(lambda: t.state is TierState.RW)
    write_all(t, 1)


def test_a_file_that_keeps_failing_its_read_costs_one_recompute(tmpfs, make_tier, monkeypatch):
    """Mode 000, a lease, EIO: the file is there, the right size, and cannot be read."""
    t = make_tier(tmpfs)
    write_all(t, 1)
    path = t.path_of(key(1))
    bad = os.stat(path).st_ino

    def fault(op):
        if op == "read" and os.stat(path).st_ino == bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fileio, "fault", fault)
    out = aligned()
    assert t.read_into(key(1), out) is False  # the request recomputes ...
    assert not t.contains(key(1)), "a file we cannot read is still offered"
    write_all(t, 1)  # ... and its store publishes over the bad file
    assert os.stat(path).st_ino != bad
    assert t.contains(key(1)) and t.read_into(key(1), out) and np.array_equal(out, payload(1))


def test_a_file_we_did_not_write_never_blocks_our_write(tmpfs, make_tier):
    t = make_tier(tmpfs)
    path = t.path_of(key(1))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    _junk(path)  # the right size, someone else's bytes
    write_all(t, 1)
    out = aligned()
    assert t.read_into(key(1), out) and np.array_equal(out, payload(1))


def test_restamp_only_the_very_file_we_wrote(tmpfs, make_tier):
    """Same inode number, another file (the filesystem reused it): its ctime tells them apart."""
    t = make_tier(tmpfs, touch_interval_s=0, secret=SECRET)
    write_all(t, 1)
    path = t.path_of(key(1))
    dev, ino, ctime = t._ours[t._fid(key(1))]
    t._ours[t._fid(key(1))] = (dev, ino, ctime - 1)  # what a reused inode number looks like to us
    os.utime(path, (1_000_000, 1_000_000))
    t.touch(key(1))
    assert t.flush(10)
    assert os.stat(path).st_mtime == 1_000_000


def test_a_tier_without_a_budget_says_so_at_start(tmpfs, fp, caplog, monkeypatch):
    import logging

    from tpu_offload.core.config import OffloadConfig
    from tpu_offload.core.fs import FileTier
    from tpu_offload.core.fs import tier as tier_mod

    monkeypatch.setattr(tier_mod, "_NO_BUDGET_WARNED", False)
    base = {"shared_storage_path": tmpfs, "fs_allow_unauthenticated": True}
    with caplog.at_level(logging.WARNING, logger="tpu_offload.fs"):
        FileTier.from_config(OffloadConfig.from_sources({**base, "fs_capacity_bytes": N * FILE}, env={}),
                             fp, CHUNK).close()
        assert not [r for r in caplog.records if "no budget" in r.getMessage()]
        for _ in range(2):
            FileTier.from_config(OffloadConfig.from_sources(base, env={}), fp, CHUNK).close()
    assert len([r for r in caplog.records if "no budget" in r.getMessage()]) == 1


@pytest.mark.parametrize("secret", [None, SECRET])
def test_junk_at_chunk_names_costs_one_header_read_per_change_not_per_rescan(root, make_tier, monkeypatch, secret):
    from tpu_offload.core.fs import actions

    t = make_tier(root, capacity_bytes=N * FILE, secret=secret)
    write_all(t, *range(N))
    planted = []
    for i in range(40):
        name = f"{0xab00 + i:04x}" + "cd" * 18
        d = os.path.join(t.ns_dir, name[:2], name[2:4])
        os.makedirs(d, mode=0o700, exist_ok=True)
        planted.append(os.path.join(d, name))
        _junk(planted[-1], 64)
    reads = []
    real = actions.ours_at
    monkeypatch.setattr(actions, "ours_at", lambda d, name, **kw: reads.append(name) or real(d, name, **kw))
    t.rescan()
    assert len(reads) >= 40  # each junk file read once
    reads.clear()
    t.rescan()
    t.rescan()
    assert reads == [], f"{len(reads)} header reads for files already judged"
    _junk(planted[0], 128)  # a change: read again, once
    t.rescan()
    t.rescan()
    assert reads == [os.path.basename(planted[0])]
    assert _on_disk(t) == N and t.usage()["foreign_entries"] >= 40
    for p in planted:  # the cache forgets what is gone: it never grows past the files there are
        os.unlink(p)
    t.rescan()
    assert t._scanner.cached_verdicts == N
