"""One action by a tenant sharing our uid (or by another uid on a shared root) never switches the tier off for good.

What is ours heals: a directory of ours we can no longer search or write is
set back to our mode, and whatever sits at one of our names (a directory at a
chunk's name, a file, FIFO or symlink at a fan-out's name) is moved into the
quarantine, never deleted. What cannot heal says so (state, metric, one
warning) and is retried every ``readonly_retry_s``. Permission bits do not
stop root, so the chmod cases run in a child that drops to ``nobody``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import numpy as np
import pytest

from fs_helpers import FILE, NOBODY_PRELUDE, REPO, aligned, filled, key, payload, run_child, write_all, wait_for
from tpu_offload.core.fs import TierState
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.journal import TIER_OFF, TIER_ON, FileJournal

OTHER = 0x12345678  # a key under other fan-out directories than key(0..65535) ("12/34")
OTHER2 = 0x56780000  # and another ("56/78")




def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- modes of our directories, as a non-root tier ----------------------------------------------

_CHILD = NOBODY_PRELUDE + r"""
import time
from tpu_offload.core.fs import safedir
os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)   # root is never denied anything: stop being root
case, retry = sys.argv[3], float(sys.argv[4])
OTHER, OTHER2 = 0x12345678, 0x56780000

def tier():
    return FileTier(sys.argv[1], layout(), 64 << 10, capacity_bytes=None, readonly_retry_s=retry,
                    fs_metrics=FsMetrics(CollectorRegistry()))

def put(t, i):
    buf = aligned(); buf[:] = i % 251
    tk = t.submit_write(key(i), buf)
    return tk is not None and tk.wait(10) is True

def get(t, i):
    out = aligned()
    return bool(t.read_into(key(i), out) and (out == i % 251).all())

def mode(p):
    return os.stat(p).st_mode & 0o7777

res = {"uid": os.getuid()}
t = tier()
res["first"] = put(t, 1)
ns = t.ns_dir
fan2 = os.path.dirname(t.path_of(key(1))); fan1 = os.path.dirname(fan2)
if case == "namespace":
    os.chmod(ns, 0o500)
    res["runtime_write"] = put(t, OTHER)  # a new fan-out directory: mkdir in the namespace
    res["runtime_state"], res["runtime_mode"] = t.state.value, mode(ns)
    t.flush(10); res["before_restart"] = t.counters(); t.close()
    os.chmod(ns, 0o500)
    t = tier()  # a restart
    res["restart_state"], res["restart_mode"] = t.state.value, mode(ns)
    res["restart_write"] = put(t, OTHER2)
elif case in ("fanout1", "fanout2"):
    locked = fan1 if case == "fanout1" else fan2
    os.chmod(locked, 0)
    res["read"] = get(t, 1)
    os.chmod(locked, 0)
    res["write"] = put(t, 2)
    os.chmod(locked, 0)
    t.flush(10); res["before_restart"] = t.counters(); t.close()
    t = tier()  # a restart: its rescan lists the directory
    res["indexed"] = key(1) in t.keys_lru_order() and key(2) in t.keys_lru_order()
    res["mode"] = mode(locked)
elif case == "cannot_heal":
    real = safedir.fchmod_dir
    def refuse(fd, m):
        raise PermissionError(1, "Operation not permitted")
    safedir.fchmod_dir = refuse  # e.g. an immutable or otherwise unchangeable directory
    os.chmod(ns, 0o500)
    res["broken_write"] = put(t, OTHER)
    res["broken_state"] = t.state.value
    res["broken_usage_state"] = t.usage()["state"]
    res["dropped_while_read_only"] = t.submit_write(key(OTHER2), aligned()) is None
    safedir.fchmod_dir = real  # the cause is gone
    time.sleep(retry + 0.05)
    res["back_write"] = put(t, OTHER2)
    res["back_state"], res["back_mode"] = t.state.value, mode(ns)
res["state"] = t.state.value
t.flush(10)
res.update(counters=t.counters(), warnings=warnings)
t.close()
print(json.dumps(res))
"""


def _as_nobody(root, case, retry=60.0):
    os.chown(root, 65534, 65534)
    r = run_child(_CHILD, root, os.path.join(REPO, "tests", "fs"), case, str(retry))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["uid"] != 0 and out["first"]
    return out


def test_chmod_0500_on_our_namespace_heals_while_running_and_at_restart(root):
    out = _as_nobody(root, "namespace")
    assert out["runtime_write"] and out["runtime_state"] == "rw" and out["runtime_mode"] == 0o700
    assert out["restart_state"] == "rw" and out["restart_mode"] == 0o700 and out["restart_write"]
    assert out["before_restart"]["repairs_mode"] == 1 and out["counters"]["repairs_mode"] == 1
    assert not [w for w in out["warnings"] if "is read-only" in w or "is off" in w], out["warnings"]


@pytest.mark.parametrize("level", ["fanout1", "fanout2"])
def test_chmod_0000_on_one_fanout_directory_heals(root, level):
    out = _as_nobody(root, level)
    assert out["read"], "a read under the chmod-0000 directory missed"
    assert out["write"], "a write under the chmod-0000 directory was dropped"
    assert out["indexed"], "the rescan after a restart skipped the directory"
    assert out["mode"] == 0o700 and out["state"] == "rw"
    assert out["before_restart"]["repairs_mode"] == 2 and out["counters"]["repairs_mode"] == 1
    assert "dropped_eacces" not in out["before_restart"] and out["before_restart"].get("read_errors", 0) == 0
    # Two repairs before the restart, one after: one warning per tier, the rest at info.
    assert sum("repairs_total" in w for w in out["warnings"]) == 2, out["warnings"]


def test_a_mode_that_cannot_be_repaired_is_read_only_says_why_and_comes_back_by_itself(root):
    out = _as_nobody(root, "cannot_heal", retry=0.3)
    assert not out["broken_write"] and out["broken_state"] == "read_only" == out["broken_usage_state"]
    assert out["dropped_while_read_only"]
    assert out["counters"]["repairs_failed"] >= 1
    failed = [w for w in out["warnings"] if "cannot heal" in w]
    assert len(failed) == 1 and "namespace directory" in failed[0] and "Operation not permitted" in failed[0]
    assert sum("read-only" in w for w in out["warnings"]) == 1
    assert out["back_write"] and out["back_state"] == "rw" and out["back_mode"] == 0o700


# ---- entries in the way of our names ------------------------------------------------------------


def _quarantined(t):
    q = os.path.join(t.ns_dir, fslayout.QUARANTINE)
    return [os.path.join(q, n) for n in os.listdir(q)] if os.path.isdir(q) else []


def test_a_directory_at_a_hot_chunks_name_is_moved_aside_and_the_write_succeeds(root, make_tier):
    t = make_tier(root)
    write_all(t, 1)
    path = t.path_of(key(1))
    os.unlink(path)
    os.mkdir(path)
    with open(os.path.join(path, "theirs"), "w") as f:
        f.write("not ours")
    write_all(t, 1)
    out = aligned()
    assert os.path.isfile(path) and t.read_into(key(1), out) and np.array_equal(out, payload(1))
    (moved,) = _quarantined(t)
    assert os.path.basename(moved).startswith(os.path.basename(path) + ".blocking.")
    with open(os.path.join(moved, "theirs")) as f:
        assert f.read() == "not ours", "what was in the way was not kept"
    c = t.counters()
    assert c["repairs_moved_aside"] == 1 and "dropped_unsafe_path" not in c


@pytest.mark.parametrize("kind", ["file", "fifo", "symlink"])
@pytest.mark.parametrize("level", [1, 2])
def test_a_non_directory_at_a_fanout_name_is_moved_aside(root, make_tier, kind, level, caplog):
    caplog.set_level(logging.WARNING, logger="tpu_offload.fs")
    t = make_tier(root)
    fan2 = os.path.dirname(t.path_of(key(OTHER)))
    target = fan2 if level == 2 else os.path.dirname(fan2)
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    if kind == "file":
        with open(target, "w") as f:
            f.write("precious")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        os.symlink("/etc", target)
    write_all(t, OTHER)
    out = aligned()
    assert t.read_into(key(OTHER), out) and np.array_equal(out, payload(OTHER))
    (moved,) = _quarantined(t)
    if kind == "file":
        with open(moved) as f:
            assert f.read() == "precious"
    elif kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(moved).st_mode)
    else:
        assert os.readlink(moved) == "/etc"
    assert t.counters()["repairs_moved_aside"] == 1
    warned = [r.getMessage() for r in caplog.records if "moved to quarantine" in r.getMessage()]
    assert len(warned) == 1 and target.split(os.sep)[-1] in warned[0]
    t.rescan()
    assert key(OTHER) in t.keys_lru_order() and os.path.exists(moved), "the rescan or CLI removed it"


# ---- a namespace that is not ours any more ---------------------------------------------------------


@pytest.mark.parametrize("owner", ["same uid", "another uid"])
def test_a_namespace_moved_aside_and_replaced_turns_the_tier_off_and_tells_the_scheduler(root, make_tier, owner):
    t = make_tier(root, readonly_retry_s=0.3)
    t.journal = FileJournal()
    t.files.ns.recheck_s = 0  # the path is re-checked before every operation (else within 1 s)
    write_all(t, 1)
    t.journal.take()
    aside = t.ns_dir + ".aside"
    os.rename(t.ns_dir, aside)
    os.mkdir(t.ns_dir, 0o700)
    if owner == "another uid":
        os.chown(t.ns_dir, 65534, 65534)
    assert t.submit_write(key(2), filled(2)).wait(10) is False
    assert t.state is TierState.OFF and t.usage()["state"] == "off"
    assert (TIER_OFF, b"") in t.journal.take(), "the scheduler was not told"
    assert not t.contains(key(1))
    assert not os.path.exists(t.path_of(key(2))) and not os.path.exists(aside + t.path_of(key(2))[len(t.ns_dir):])
    if owner == "another uid":  # theirs is never adopted: still off after a retry
        time.sleep(0.35)
        t.contains(key(1))
        time.sleep(0.3)
        assert t.state is TierState.OFF
        os.rmdir(t.ns_dir)  # the cause is gone
    time.sleep(0.35)
    t.contains(key(1))  # any use after the retry delay re-vets the path
    assert wait_for(lambda: t.state is TierState.RW)
    assert (TIER_ON, b"") in t.journal.take()
    write_all(t, 2)
    assert os.path.isfile(t.path_of(key(2))) and os.stat(t.ns_dir).st_uid == os.geteuid()


@pytest.mark.parametrize("mode,warned", [(0o2775, True), (0o777, True), (0o770, True), (0o1777, False),
                                         (0o3770, False), (0o755, False)])
def test_a_root_others_can_write_without_the_sticky_bit_gets_one_warning(root, make_tier, caplog, mode, warned):
    caplog.set_level(logging.WARNING, logger="tpu_offload.fs")
    os.chmod(root, mode)
    make_tier(root)
    make_tier(root, name="fs-b")
    got = [r.getMessage() for r in caplog.records if "sticky" in r.getMessage()]
    assert len(got) == (1 if warned else 0), got
    if warned:
        assert root in got[0] and "chmod +t" in got[0] and "rename this tier's namespace directory" in got[0]


# ---- eviction re-checks each victim --------------------------------------------------------------


def test_two_tiers_on_one_budget_b_never_evicts_what_a_just_read(root, make_tier):
    """B's last rescan chose 0, 1, 2 as least recent; A reads them; B evicts 3, 4, 5 instead."""
    n = 6
    b = make_tier(root, capacity_bytes=n * FILE, rescan_bytes=1 << 40, rescan_interval_s=3600, threads=1)
    a = make_tier(root, touch_interval_s=0, threads=1)
    write_all(b, *range(n))  # B's view: 0 is the least recent
    time.sleep(0.05)
    out = aligned()
    for i in (0, 1, 2):
        assert a.read_into(key(i), out) and np.array_equal(out, payload(i))
    assert a.flush(10)  # A's restamps are down
    write_all(b, n, n + 1, n + 2)  # over budget: B evicts three
    present = [i for i in range(n + 3) if os.path.exists(b.path_of(key(i)))]
    assert present == [0, 1, 2, 6, 7, 8], present
    assert b.counters()["evictions_skipped_used"] == 3 and b.counters()["evicted"] == 3


def test_what_cannot_be_moved_aside_drops_that_chunk_only_and_says_why(root, make_tier, caplog):
    """The quarantine's own name is blocked by a file: the directory at the chunk's name stays, that write is
    dropped with one warning naming the path and the cause; other chunks are written; fixed, it heals."""
    caplog.set_level(logging.WARNING, logger="tpu_offload.fs")
    t = make_tier(root)
    write_all(t, 1)
    path = t.path_of(key(1))
    os.unlink(path)
    os.mkdir(path)
    qname = os.path.join(t.ns_dir, fslayout.QUARANTINE)
    with open(qname, "w") as f:
        f.write("in the way")
    assert t.submit_write(key(1), filled(1)).wait(10) is False
    assert os.path.isdir(path) and t.state is TierState.RW
    c = t.counters()
    assert c["repairs_failed"] == 1 and c["dropped_unsafe_path"] == 1
    failed = [r.getMessage() for r in caplog.records if "cannot heal" in r.getMessage()]
    assert len(failed) == 1 and os.path.basename(path) in failed[0] and "quarantine" in failed[0]
    write_all(t, 2)  # the rest of the tier writes
    os.unlink(qname)  # the cause is gone: the next write of the chunk heals
    write_all(t, 1)
    assert os.path.isfile(path)
