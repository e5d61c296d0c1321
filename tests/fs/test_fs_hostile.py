"""The hostile-volume suite: one test per attack by another tenant, user or operator.

The shared directory is not ours alone. Each test stages one attack for
real (a FIFO, a symlinked fan-out directory, an unreadable subdirectory as
a non-root user, a skewed clock, a bad CLI value, a foreign directory at a
snapshot path) and checks the tier and the CLI stay safe: no hang, no
write or delete outside the root, nothing deleted that is not ours, one
clear error.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import time

import numpy as np
import pytest

from fs_helpers import CHUNK, FILE, NOBODY_PRELUDE, REPO, aligned, key, layout, payload, run_child, filled, write_all
from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.fs import FileTier, TierState, admin, snapshot_host_tier
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.cli import main as cli_main
from tpu_offload.core.fs.format import MAGIC
from tpu_offload.core.fs.snapshot import SnapshotPathError
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.pool import HostChunkPool


OTHER = 0x12345678  # a key under another fan-out directory than key(0..65535)


@pytest.fixture
def outside():
    """A directory outside the root: nothing may ever land in it or vanish from it."""
    d = tempfile.mkdtemp(prefix="fs-hostile-outside-", dir="/var/tmp")
    yield d
    for dirpath, _, files in os.walk(d, topdown=False):
        for f in files:
            os.unlink(os.path.join(dirpath, f))
        os.rmdir(dirpath)


def _in_thread(fn, timeout=10.0):
    """fn() on a daemon thread; (finished, result). A hang is reported, not waited out."""
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    th.start()
    th.join(timeout)
    return not th.is_alive(), box.get("r")


# ---- 1. non-regular files at a key path -------------------------------------


def _plant(kind: str, path: str, outside: str) -> None:
    if kind == "symlink":  # to the same valid chunk file, now outside the root
        target = os.path.join(outside, os.path.basename(path))
        os.rename(path, target)
        os.symlink(target, path)
        return
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path, 0o640)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.mknod(path, 0o640 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null: reads give 0 bytes


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "symlink"])
def test_non_regular_file_at_a_key_is_a_miss_and_never_hangs(root, make_tier, outside, kind):
    t = make_tier(root)
    write_all(t, 1, 2)
    path = t.path_of(key(1))
    _plant(kind, path, outside)
    fresh = make_tier(root)  # an index built from the directory, and a stat for unknown keys
    assert not fresh.contains(key(1)), f"a {kind} at a key path must never count as the chunk"
    out = aligned()
    done, hit = _in_thread(lambda: fresh.read_into(key(1), out))
    if not done and kind == "fifo":  # unblock the stuck open so the process can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert done, f"read_into hung on a {kind}"
    assert hit is False and fresh.counters()["read_not_regular"] == 1
    assert t.read_into(key(1), out) is False  # the tier that wrote it: index says yes, the file says no
    assert t.read_into(key(2), out) and np.array_equal(out, payload(2))  # the rest is served
    assert os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode), "not ours: left in place"
    assert _in_thread(lambda: (t.flush(10), t.close(10)))[0], "flush/close hung"
    rep = admin.verify(root)  # verify neither hangs on it nor reports it as a bad chunk
    assert rep.checked == 1 and rep.ok == 1


def test_verify_file_refuses_a_fifo_without_blocking(root, make_tier):
    """The race the scan cannot see: a file swapped for a FIFO between scan and check."""
    t = make_tier(root)
    write_all(t, 1)
    path = t.path_of(key(1))
    os.unlink(path)
    os.mkfifo(path)
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        done, reason = _in_thread(lambda: admin.verify_file(d, os.path.basename(path), None, None))
        if not done:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        assert done and reason == "not_regular (fifo)"
    finally:
        os.close(d)


# ---- 2. a rescan never blocks the engine thread ------------------------------


class _Gated(list):
    """A scan result whose iteration stops half-way until released."""

    def __init__(self, items, reached: threading.Event, release: threading.Event):
        super().__init__(items)
        self.reached, self.release = reached, release

    def __iter__(self):
        for i, x in enumerate(list.__iter__(self)):
            if i == len(self) // 2:
                self.reached.set()
                assert self.release.wait(30)
            yield x


def test_rescan_never_blocks_touch_or_reads(root, make_tier, monkeypatch):
    """A rescan parked in the middle of rebuilding the index must not stop touch/read/write.

    The old rebuild held the index lock for the whole merge and sort (2-7 s
    at 150k files); ``benchmarks/bench_fs_rescan.py`` measures the latency.
    """
    t = make_tier(root)
    write_all(t, *range(8))
    reached, release = threading.Event(), threading.Event()
    real_walk = fslayout.walk_namespace

    def gated_walk(ns_dir, out, *args, **kw):
        return iter(_Gated(list(real_walk(ns_dir, out, *args, **kw)), reached, release))

    monkeypatch.setattr(fslayout, "walk_namespace", gated_walk)
    scanner = threading.Thread(target=t.rescan)
    scanner.start()
    try:
        assert reached.wait(30)
        out = aligned()
        done, ok = _in_thread(lambda: (t.touch(key(1)), t.read_into(key(2), out), t.contains(key(3)),
                                       t.submit_write(key(100), filled(100)).wait(10)), timeout=10)
        assert done, "touch/read/write waited for the rescan"
        assert ok[1] and ok[2] and ok[3]
        assert t._index.remove(key(5)) is not None  # an eviction meanwhile
    finally:
        release.set()
        scanner.join(30)
    order = t.keys_lru_order()
    assert key(100) in order, "a write during the rescan is kept (it is not in the scan)"
    assert key(5) not in order, "a removal during the rescan is not undone by the scan"
    assert order[-3:] == [key(1), key(2), key(100)], "what was used during the rescan is the most recent"
    assert t._index.used_bytes == len(order) * FILE


# ---- 3. an unreadable subdirectory -------------------------------------------

_NOBODY = NOBODY_PRELUDE + r"""
from tpu_offload.core.fs.cli import main
import contextlib, io
os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)   # root is never denied: stop being root
t = FileTier(sys.argv[1], layout(), 64 << 10, capacity_bytes=None, fs_metrics=FsMetrics(CollectorRegistry()))
hits = [t.read_into(key(i), aligned()) for i in range(int(sys.argv[3]))]
res = {"uid": os.getuid(), "state": t.state.value, "hits": hits, "usage": t.usage(),
       "counters": t.counters(), "warnings": warnings}
t.close()
for cmd in (["inspect"], ["verify"], ["evict", "--budget", "1GiB"]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([cmd[0], sys.argv[1], *cmd[1:]])
    res[cmd[0]] = [code, err.getvalue()]
print(json.dumps(res))
"""


def test_unreadable_subdirectory_is_skipped_counted_and_the_rest_served(root, make_tier):
    """Really unreadable: the tier and the CLI run as ``nobody`` against a root-owned 0700 directory.

    (Root is never denied, so a permission failure needs a non-root process;
    no monkeypatching.)
    """
    n = 24
    w = make_tier(root)
    write_all(w, *range(n))
    w.close()
    for dirpath, dirs, files in os.walk(root):
        os.chown(dirpath, 65534, 65534)
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chown(os.path.join(dirpath, f), 65534, 65534)
    locked = os.path.dirname(os.path.dirname(w.path_of(key(0))))  # one first-level fan-out directory
    os.chown(locked, 0, 0)
    os.chmod(locked, 0o700)
    behind = {i for i in range(n) if w.path_of(key(i)).startswith(locked + os.sep)}
    r = run_child(_NOBODY, root, os.path.join(REPO, "tests", "fs"), str(n))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["uid"] != 0
    assert out["state"] == "rw", "one unreadable directory must not turn the tier off"
    assert [i for i, h in enumerate(out["hits"]) if not h] == sorted(behind)
    assert out["usage"]["unreadable_paths"] == 1 and out["counters"]["scan_unreadable"] >= 1
    assert len([m for m in out["warnings"] if "could not be read" in m]) == 1
    for cmd in ("inspect", "verify", "evict"):
        code, err = out[cmd]
        assert code == 4, (cmd, code, err)
        assert locked in err and "Permission denied" in err and "Traceback" not in err, err


# ---- 4. symlinks never lead out of the root ----------------------------------


def _symlink_fanout(t, k, target):
    """Replace the key's second-level fan-out directory by a symlink to ``target``."""
    d = os.path.dirname(t.path_of(k))
    if os.path.isdir(d):
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    os.symlink(target, d)


def test_writes_never_land_outside_through_a_symlinked_fanout(root, make_tier, outside):
    """The symlink is moved into the quarantine (never followed, never deleted) and the write lands inside."""
    t = make_tier(root)
    fan = os.path.dirname(t.path_of(key(1)))
    _symlink_fanout(t, key(1), outside)
    write_all(t, 1)
    assert os.listdir(outside) == [], "a write followed a symlink out of the root"
    assert os.path.isdir(fan) and not os.path.islink(fan) and os.path.isfile(t.path_of(key(1)))
    qdir = os.path.join(t.ns_dir, fslayout.QUARANTINE)
    (moved,) = os.listdir(qdir)
    assert os.readlink(os.path.join(qdir, moved)) == outside, "the symlink was not kept"
    assert t.counters()["repairs_moved_aside"] == 1 and "dropped_unsafe_path" not in t.counters()
    write_all(t, OTHER)  # keys under other fan-out directories still work


def test_reads_evictions_and_touches_never_act_outside(root, make_tier, outside):
    t = make_tier(root, capacity_bytes=3 * FILE, touch_interval_s=0)
    write_all(t, 1)
    name = os.path.basename(t.path_of(key(1)))
    with open(os.path.join(outside, name), "wb") as f:  # a corrupt "chunk" of someone else's
        f.write(MAGIC + b"\0" * (FILE - len(MAGIC)))
    old = time.time() - 7200
    os.utime(os.path.join(outside, name), (old, old))
    _symlink_fanout(t, key(1), outside)
    assert t.read_into(key(1), aligned()) is False  # a corrupt read would delete the file it reached
    t.touch(key(1))
    t._index.add(key(1), FILE)  # as if still indexed: now make the budget evict it
    write_all(t, OTHER, OTHER + 1, OTHER + 2)
    t.flush(10)
    assert os.listdir(outside) == [name], "a file outside the root was deleted"
    assert os.stat(os.path.join(outside, name)).st_mtime == pytest.approx(old, abs=1), "restamped through a symlink"


def test_symlinked_namespace_directory_turns_the_tier_off(root, make_tier, outside):
    os.symlink(outside, os.path.join(root, layout().namespace()))
    t = make_tier(root)
    assert t.state is TierState.OFF
    assert t.submit_write(key(1), filled(1)) is None and os.listdir(outside) == []


# ---- 5. evict deletes only what is ours --------------------------------------


def test_evict_deletes_only_our_magic_files_and_our_temps(root, make_tier):
    t = make_tier(root, quarantine=True)
    write_all(t, *range(4))
    d = os.path.dirname(t.path_of(key(0)))
    qdir = os.path.join(t.ns_dir, fslayout.QUARANTINE)
    os.makedirs(qdir, exist_ok=True)
    theirs_q = os.path.join(qdir, f"{key(9).hex()}.magic.1")  # quarantined because it is NOT ours
    with open(theirs_q, "wb") as f:
        f.write(b"their data" * 1000)
    ours_q = os.path.join(qdir, f"{key(0).hex()}.checksum.1")
    shutil.copyfile(t.path_of(key(0)), ours_q)  # a copy: a hard link is not ours (it also lives elsewhere)
    swap = os.path.join(d, ".tmp.notes.txt.swp")  # an editor's swap file
    ours_tmp = os.path.join(d, fslayout.temp_name(key(0).hex()))
    empty_tmp = os.path.join(d, fslayout.temp_name(key(1).hex()))  # a writer killed before its first byte
    named_like_ours = os.path.join(d, fslayout.temp_name(key(2).hex()))  # our name, someone else's bytes
    for p, body in ((swap, b"x"), (ours_tmp, MAGIC + b"x"), (empty_tmp, b""), (named_like_ours, b"x")):
        with open(p, "wb") as f:
            f.write(body)
    old = time.time() - 86400
    for p in (theirs_q, ours_q, swap, ours_tmp, empty_tmp, named_like_ours):
        os.utime(p, (old, old))
    rep = admin.evict(root, budget_bytes=FILE, high_pct=1, low_pct=1, tmp_age_s=600)
    assert rep.temps_removed == 2 and not os.path.exists(ours_tmp) and not os.path.exists(empty_tmp)
    assert os.path.exists(named_like_ours), "a file named like our temps without our magic is not ours"
    assert os.path.exists(swap), "an editor's .tmp.* file is not ours"
    assert os.path.exists(theirs_q), "a quarantined file without our magic is not ours"
    assert not os.path.exists(ours_q) and rep.not_ours == 2
    assert rep.evicted_files == 5  # our quarantined copy and our 4 chunks


# ---- 6. CLI values are validated like config values ----------------------------


@pytest.mark.parametrize("flag,value", [
    ("--budget", "0.5"), ("--budget", "0"), ("--budget", "nan"), ("--budget", "-1GiB"), ("--budget", "9" * 5000),
    ("--tmp-age", "-1"), ("--tmp-age", "nan"), ("--tmp-age", "inf"), ("--tmp-age", "5"),
    ("--high", "nan"), ("--low", "inf"), ("--high", "0"),
])
def test_cli_refuses_bad_values_naming_flag_value_and_allowed(root, make_tier, capsys, flag, value):
    t = make_tier(root)
    write_all(t, 1, 2)
    with pytest.raises(SystemExit) as e:
        cli_main(["evict", root, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert flag in err and "allowed" in err and (value if len(value) < 50 else value[:40]) in err, err
    assert "digits" not in err, "Python's int-limit message instead of ours"
    assert t.contains(key(1)) and os.path.exists(t.path_of(key(2))), "nothing may be deleted"


# ---- 7. snapshots never replace a directory they did not write ------------------


def _host_tier(n=3):
    pool = HostChunkPool(4, CHUNK)
    mgr = LRUChunkManager(4, CHUNK)
    keys = [key(i) for i in range(n)]
    alloc = mgr.prepare_store(keys)
    for k, s in zip(alloc.keys, alloc.slots):
        pool.row(int(s))[:] = payload(int.from_bytes(k[:4], "big") % 1000)
        pool.valid[s] = True
    mgr.complete_store(list(alloc.keys), success=True)
    return mgr, pool


@pytest.mark.parametrize("what", ["user directory", "symlink", "file"])
def test_snapshot_refuses_a_path_it_did_not_write(tmp_path, what):
    mgr, pool = _host_tier()
    path = tmp_path / "snap"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    if what == "user directory":
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    elif what == "symlink":
        path.symlink_to(precious)
    else:
        path.write_text("mine")
    with pytest.raises(SnapshotPathError, match="refusing to replace"):
        snapshot_host_tier(mgr, pool, str(path), layout())
    assert (precious / "thesis.tex").read_text() == "years of work"
    if what == "user directory":
        assert (path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "temp left behind"


def test_snapshot_replaces_only_empty_dirs_and_its_own_snapshots(tmp_path):
    mgr, pool = _host_tier()
    path = tmp_path / "snap"
    path.mkdir()
    assert snapshot_host_tier(mgr, pool, str(path), layout()) == 3  # empty: fine
    assert snapshot_host_tier(mgr, pool, str(path), layout()) == 3  # our own: replaced
    assert sorted(p.name for p in path.iterdir()) == ["chunks.npy", "index.json"]


# ---- 8. clock skew -------------------------------------------------------------


def test_future_mtime_is_clamped_and_still_evicted(root, make_tier):
    t = make_tier(root)
    write_all(t, 0, 1, 2)
    t.close()
    future, old = time.time() + 86400, time.time() - 3600
    os.utime(t.path_of(key(0)), (future, future))  # stamped by a host whose clock runs a day ahead
    for i in (1, 2):
        os.utime(t.path_of(key(i)), (old, old))
    b = make_tier(root, capacity_bytes=3 * FILE)
    assert os.stat(b.path_of(key(0))).st_mtime < time.time() + 5, "the future mtime is set back to now"
    assert b.counters()["future_mtimes_clamped"] == 1
    for i in (3, 4, 5, 6):
        time.sleep(0.02)
        write_all(b, i)
    b.flush(10)
    assert not os.path.exists(b.path_of(key(0))), "a file stamped in the future must still be evicted"
    assert sorted(b.keys_lru_order()) == sorted(key(i) for i in (4, 5, 6))


def test_cli_evict_clamps_future_mtimes(root, make_tier):
    t = make_tier(root)
    write_all(t, 0, 1)
    future = time.time() + 86400
    os.utime(t.path_of(key(0)), (future, future))
    rep = admin.evict(root, budget_bytes=1 << 40)
    assert rep.future_mtimes_clamped == 1 and rep.clock == "server"
    assert os.stat(t.path_of(key(0))).st_mtime < time.time() + 5


def test_a_clock_running_ahead_keeps_another_writers_temp(root, make_tier, monkeypatch):
    """Ages are judged on the file server's clock, not ours (here: an hour ahead)."""
    t = make_tier(root)
    write_all(t, 1)
    live = os.path.join(os.path.dirname(t.path_of(key(1))), fslayout.temp_name(key(1).hex()))
    with open(live, "wb") as f:
        f.write(b"being written by another host")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    b = make_tier(root, stale_tmp_s=600)  # its start-up rescan reaps stale temps
    rep = admin.evict(root, budget_bytes=1 << 40, tmp_age_s=600)
    monkeypatch.undo()
    assert os.path.exists(live), "a live writer's temp file was deleted by a host whose clock runs ahead"
    assert b.counters().get("stale_temps_removed", 0) == 0 and rep.temps_removed == 0
    assert abs(b._index.offset + 3600) < 5, "the index keeps recency on the server's clock"


# ---- 9. config -------------------------------------------------------------------


def test_capacity_below_one_chunk_is_refused(root, fp):
    cfg = OffloadConfig.from_sources({"shared_storage_path": root, "fs_capacity": "64KiB", "fs_allow_unauthenticated": True}, env={})
    with pytest.raises(ConfigError, match=r"fs_capacity_bytes: value 65536 .*allowed: at least one chunk file, 69632"):
        FileTier.from_config(cfg, fp, CHUNK)
    with pytest.raises(ValueError, match="smaller than one chunk file"):
        FileTier(root, fp, CHUNK, capacity_bytes=FILE - 1)


# ---- 7. directories we did not make, hardlinks, trailing bytes -------------------


@pytest.mark.parametrize("owner,mode", [(65534, 0o777), (65534, 0o700)])
def test_a_namespace_made_by_someone_else_or_writable_by_others_is_never_adopted(root, make_tier, owner, mode):
    """Another tenant creates our namespace first (sticky world-writable root) and plants a chunk."""
    planter = make_tier(root)  # writes a valid chunk the way any tenant could
    write_all(planter, 1)
    planter.close()
    for dirpath, _, _ in os.walk(planter.ns_dir):
        os.chown(dirpath, owner, owner)
        os.chmod(dirpath, mode)
    t = make_tier(root)
    assert t.state is TierState.OFF
    assert not t.contains(key(1)) and t.read_into(key(1), aligned()) is False
    assert t.submit_write(key(2), filled(2)) is None
    assert os.path.exists(planter.path_of(key(1))), "not ours: left alone"


def test_a_fanout_directory_of_another_uid_is_not_used(root, make_tier):
    t = make_tier(root, capacity_bytes=8 * FILE)
    write_all(t, 1)
    d = os.path.dirname(t.path_of(key(1)))
    os.chown(d, 65534, 65534)  # as if another uid had made it (and put key(1)'s file there)
    t2 = make_tier(root)
    assert not t2.contains(key(1)) and t2.read_into(key(1), aligned()) is False
    assert t2.counters()["read_not_regular"] == 1
    ticket = t2.submit_write(key(1), filled(1))
    assert ticket is not None and ticket.wait(10) is False and t2.counters()["dropped_unsafe_path"] == 1
    assert key(1) not in t2.keys_lru_order(), "a rescan indexed a file in a directory that is not ours"
    write_all(t2, OTHER)  # other fan-out directories still work


def test_a_hardlinked_chunk_is_not_served_and_its_other_name_never_restamped(root, make_tier, outside):
    t = make_tier(root, touch_interval_s=0)
    write_all(t, 1)
    far = os.path.join(outside, "linked")
    os.link(t.path_of(key(1)), far)
    old = time.time() - 7200
    os.utime(far, (old, old))
    t2 = make_tier(root, touch_interval_s=0)
    assert not t2.contains(key(1))
    assert t2.read_into(key(1), aligned()) is False
    t2.touch(key(1))
    t2.flush(10)
    assert os.stat(far).st_mtime == pytest.approx(old, abs=1), "restamped a file outside the root"
    assert key(1) not in t2.keys_lru_order()


def test_a_chunk_with_trailing_bytes_is_not_served(root, make_tier):
    t = make_tier(root)
    write_all(t, 1)
    with open(t.path_of(key(1)), "ab") as f:
        f.write(b"junk")
    out = aligned()
    assert t.read_into(key(1), out) is False
    assert t.counters()["corrupt_length"] == 1


# ---- 8. the budget counts only our bytes ---------------------------------------


def _sparse(path, size, head=b"", age=86400):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    old = time.time() - age  # by default oldest of all: first in line for any eviction
    os.utime(path, (old, old))


def test_a_sparse_foreign_file_never_makes_evict_delete_everyones_chunks(root, make_tier):
    """Tenant B's own namespace holds one sparse 1 TiB file without our magic: A's chunks are not evicted."""
    t = make_tier(root)
    write_all(t, *range(8))
    theirs = os.path.join(root, "tenant-b-namespace", "ab", "cd", "abcd" * 8)
    _sparse(theirs, 1 << 40)
    for _ in range(2):  # every cron run
        rep = admin.evict(root, budget_bytes=100 * FILE)
        assert not rep.triggered and rep.evicted_files == 0 and rep.not_ours == 1
    assert all(os.path.exists(t.path_of(key(i))) for i in range(8))
    assert os.path.exists(theirs)


def test_a_sparse_chunk_in_the_namespace_counts_at_its_allocated_bytes(root, make_tier):
    """One sparse chunk-named file with our magic (1 TiB apparent) must not make a rescan evict the real chunks."""
    t = make_tier(root, capacity_bytes=10 * FILE)
    write_all(t, *range(8))
    name = "ee" * 36
    _sparse(os.path.join(t.ns_dir, "ee", "ee", name), 1 << 40, MAGIC, age=0)  # the most recent: evicted last
    t.rescan()
    assert all(os.path.exists(t.path_of(key(i))) for i in range(8)), "real chunks were evicted"
    assert t.usage()["used_bytes"] <= 9 * FILE
    rep = admin.evict(root, budget_bytes=10 * FILE)
    assert not rep.triggered and rep.used_before <= 9 * FILE


def test_the_tier_never_evicts_a_file_without_our_magic(root, make_tier):
    t = make_tier(root, capacity_bytes=3 * FILE)
    theirs = os.path.join(t.ns_dir, "ee", "ee", "ee" * 36)
    _sparse(theirs, FILE, b"NOTOURS!" * 8)
    with open(theirs, "r+b") as f:  # fully allocated, so it counts like a chunk and is LRU-first
        f.write(b"x" * FILE)
    os.utime(theirs, (time.time() - 86400,) * 2)
    t.rescan()
    write_all(t, 1, 2, 3, 4)
    t.flush(10)
    assert os.path.exists(theirs), "the tier deleted a file without our magic"
