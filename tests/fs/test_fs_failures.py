"""Filesystem failures injected for real: ENOSPC, read-only mounts, EACCES.

Each turns the tier read-only (or off) with exactly one warning; callers see
only dropped writes and misses, never an exception.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

from fs_helpers import NOBODY_PRELUDE, aligned, filled, key, layout, mounted, payload, readonly_bind, run_child
from tpu_offload.core.fs import TierState
from tpu_offload.core.fs import layout as fslayout

BIG = 256 << 10


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "tpu_offload.fs"]


def test_enospc_on_a_small_tmpfs(make_tier, caplog):
    caplog.set_level(logging.INFO, logger="tpu_offload.fs")
    with mounted("tmpfs", "size=2m") as d:
        t = make_tier(d, chunk_bytes=BIG, threads=2, readonly_retry_s=0.5)
        tickets = [t.submit_write(key(i), filled(i, BIG)) for i in range(16)]
        results = [x.wait(30) if x is not None else None for x in tickets]
        assert t.flush(30)
        assert t.state is TierState.READ_ONLY
        ok = [i for i, r in enumerate(results) if r]
        assert 3 <= len(ok) < 8, results  # 2 MiB hold ~7 files of 260 KiB
        assert len(_warnings(caplog)) == 1, [r.getMessage() for r in _warnings(caplog)]
        c = t.counters()
        assert c["dropped_enospc"] >= 1 and c["dropped"] == 16 - len(ok)
        assert t.submit_write(key(99), filled(99, BIG)) is None  # read-only: dropped at once
        assert fslayout.scan_namespace(t.ns_dir).temps == [], "a failed write must remove its temp"
        out = aligned(BIG)
        for i in ok:  # what made it is still served
            assert t.read_into(key(i), out) and np.array_equal(out, payload(i, BIG))
        # Space comes back (an evictor ran): after the retry delay, writes resume.
        for i in ok:
            os.unlink(t.path_of(key(i)))
        time.sleep(0.6)
        again = t.submit_write(key(50), filled(50, BIG))
        assert again is not None and again.wait(10)
        assert t.state is TierState.RW and t.contains(key(50))
        assert len(_warnings(caplog)) == 1
        t.close()


_FSIZE_CHILD = r"""
import json, logging, resource, signal, sys
from prometheus_client import CollectorRegistry
from fs_helpers import aligned, key, layout
from tpu_offload.core.fs import FileTier, FsMetrics
warnings = []
class H(logging.Handler):
    def emit(self, r):
        if r.levelno >= logging.WARNING: warnings.append(r.getMessage())
logging.getLogger("tpu_offload.fs").addHandler(H())
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead of killing us
n = 256 << 10
resource.setrlimit(resource.RLIMIT_FSIZE, (n // 2, n // 2))
t = FileTier(sys.argv[1], layout(), n, capacity_bytes=None, threads=1, fs_metrics=FsMetrics(CollectorRegistry()))
buf = aligned(n); buf[:] = 3
res = [t.submit_write(key(i), buf) for i in range(3)]
res = [None if r is None else r.wait(10) for r in res]
t.flush(10)
print(json.dumps({"results": res, "state": t.state.value, "counters": t.counters(), "warnings": warnings}))
"""


def test_file_size_limit_fallback_for_enospc(root):
    """Same failure class without a mount: RLIMIT_FSIZE makes the write fail (EFBIG)."""
    from fs_helpers import REPO

    env_code = f"import sys; sys.path.insert(0, {os.path.join(REPO, 'tests', 'fs')!r})\n" + _FSIZE_CHILD
    r = run_child(env_code, root)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["results"][0] is False and out["state"] == "read_only"
    assert out["counters"]["dropped_efbig"] == 1 and out["counters"]["dropped_read_only"] >= 1
    assert len(out["warnings"]) == 1
    assert fslayout.scan_namespace(os.path.join(root, layout().namespace())).temps == []


def test_read_only_bind_mount(root, make_tier, caplog):
    caplog.set_level(logging.INFO, logger="tpu_offload.fs")
    w = make_tier(root)
    assert w.submit_write(key(1), filled(1)).wait(10)
    with readonly_bind(root) as ro:
        t = make_tier(ro)
        assert t.state is TierState.READ_ONLY
        assert len(_warnings(caplog)) == 1
        assert t.contains(key(1))
        out = aligned()
        assert t.read_into(key(1), out) and np.array_equal(out, payload(1))
        for i in range(5):
            assert t.submit_write(key(10 + i), filled(i)) is None
        assert t.counters()["dropped_read_only"] == 5
        t.touch(key(1))  # restamping fails quietly on a read-only mount
        assert t.flush(10)
        assert len(_warnings(caplog)) == 1
        t.close()


def test_tmpfs_remounted_read_only_while_running(make_tier, caplog):
    caplog.set_level(logging.INFO, logger="tpu_offload.fs")
    import subprocess
    with mounted("tmpfs", "size=8m") as d:
        t = make_tier(d, threads=1)
        assert t.submit_write(key(1), filled(1)).wait(10)
        subprocess.run(["mount", "-o", "remount,ro", d], check=True)
        try:
            tickets = [t.submit_write(key(i), filled(i)) for i in range(2, 6)]
            assert tickets[0] is not None and tickets[0].wait(10) is False
            assert t.state is TierState.READ_ONLY
            assert t.counters()["dropped_erofs"] == 1
            assert t.submit_write(key(9), filled(9)) is None
            assert t.read_into(key(1), aligned())
            assert len(_warnings(caplog)) == 1
        finally:
            subprocess.run(["mount", "-o", "remount,rw", d], check=True)
        t.close()


_NOBODY_CHILD = NOBODY_PRELUDE + r"""
os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)   # root cannot be denied anything: stop being root
t = FileTier(sys.argv[1], layout(), 64 << 10, capacity_bytes=None, fs_metrics=FsMetrics(CollectorRegistry()))
buf = aligned(); buf[:] = 1
res = {"uid": os.getuid(), "state": t.state.value, "contains": t.contains(key(1)),
       "read": t.read_into(key(1), aligned()), "write": t.submit_write(key(2), buf) is not None}
t.flush(10)
res.update(counters=t.counters(), warnings=warnings)
print(json.dumps(res))
"""


def _as_nobody(root):
    from fs_helpers import REPO
    r = run_child(_NOBODY_CHILD, root, os.path.join(REPO, "tests", "fs"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_permission_denied_namespace_is_off(root, make_tier):
    """Root-owned 0750 namespace: nobody can neither list nor create it."""
    w = make_tier(root)
    assert w.submit_write(key(1), filled(1)).wait(10)
    os.chmod(root, 0o755)
    out = _as_nobody(root)
    assert out["uid"] != 0
    assert out["state"] == "off" and len(out["warnings"]) == 1
    assert out["contains"] is False and out["read"] is False and out["write"] is False


def test_permission_denied_files_read_as_misses(root, make_tier):
    """Our directories, a root-owned 0600 file in them: the read fails EACCES, a miss; the file stays."""
    w = make_tier(root)
    assert w.submit_write(key(1), filled(1)).wait(10)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
        if dirpath != root:
            os.chown(dirpath, 65534, 65534)
    out = _as_nobody(root)
    assert out["state"] == "rw"
    assert out["contains"] is True and out["read"] is False and out["write"] is True
    assert out["counters"]["read_errors"] == 1
    assert len(out["warnings"]) == 1  # the first failed read
    assert os.path.exists(w.path_of(key(1))), "a file we cannot read is not ours to delete"


def test_a_namespace_another_uid_owns_is_not_adopted(root, make_tier):
    """Listable, but root's: nobody's tier turns off (one warning naming the owner) and touches nothing."""
    w = make_tier(root)
    assert w.submit_write(key(1), filled(1)).wait(10)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
    out = _as_nobody(root)
    assert out["state"] == "off"
    assert out["contains"] is False and out["read"] is False and out["write"] is False
    assert len(out["warnings"]) == 1 and "owned by uid 0" in out["warnings"][0]
    assert os.path.exists(w.path_of(key(1)))
