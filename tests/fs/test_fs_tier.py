"""FileTier behaviour on a healthy disk: I/O, queueing, capacity, restart, metrics."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fs_helpers import CHUNK, FILE, aligned, key, mounted, payload
from tpu_offload.core.config import OffloadConfig
from tpu_offload.core.fs import FileTier, TierState
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.format import MAGIC
from tpu_offload.core.metrics import OffloadMetrics


def _slot(i):
    """The payload in a page-aligned buffer, like a HostChunkPool row."""
    out = aligned()
    out[:] = payload(i)
    return out


def _write_all(tier, idx):
    tickets = [tier.submit_write(key(i), _slot(i)) for i in idx]
    assert all(t is not None for t in tickets)
    assert all(t.wait(30) for t in tickets)


def _read(tier, i):
    out = aligned()
    return out if tier.read_into(key(i), out) else None


def test_round_trip_and_contains(root, make_tier):
    t = make_tier(root)
    assert not t.contains(key(1)) and _read(t, 1) is None
    _write_all(t, range(4))
    for i in range(4):
        assert t.contains(key(i))
        assert np.array_equal(_read(t, i), payload(i))
    assert not t.contains(key(99))
    c = t.counters()
    assert c["writes_ok"] == 4 and c["reads_ok"] == 4 and c["read_misses"] == 1
    assert c["bytes_written"] == 4 * CHUNK and c["bytes_read"] == 4 * CHUNK


def test_contains_has_no_side_effects(root, make_tier):
    t = make_tier(root)
    _write_all(t, range(3))
    order = t.keys_lru_order()
    before = {k: os.stat(t.path_of(k)).st_mtime_ns for k in order}
    for _ in range(3):
        assert t.contains(key(0))
    t.flush(10)
    assert t.keys_lru_order() == order
    assert {k: os.stat(t.path_of(k)).st_mtime_ns for k in order} == before


def test_another_process_view_sees_files_through_stat(root, make_tier):
    a, b = make_tier(root), make_tier(root)  # b's index was built before a wrote
    _write_all(a, [7])
    assert key(7) not in b.keys_lru_order()
    assert b.contains(key(7))
    assert np.array_equal(_read(b, 7), payload(7))
    assert key(7) in b.keys_lru_order()  # a verified read adopts it


def test_unaligned_and_wrong_sized_buffers(root, make_tier):
    t = make_tier(root, o_direct=True)
    raw = np.empty(CHUNK + 1, dtype=np.uint8)
    unaligned = raw[1:]
    unaligned[:] = payload(3)
    assert t.submit_write(key(3), unaligned).wait(10)
    out = np.empty(CHUNK + 1, dtype=np.uint8)[1:]
    assert t.read_into(key(3), out) and np.array_equal(out, payload(3))
    with pytest.raises(ValueError):
        t.submit_write(key(4), np.zeros(CHUNK - 1, np.uint8))
    with pytest.raises(ValueError):
        t.read_into(key(3), np.zeros(CHUNK + 4096, np.uint8))
    with pytest.raises(ValueError):
        t.submit_write(key(4), np.zeros((2, CHUNK), np.uint8)[:, ::2].reshape(-1)[:CHUNK].reshape(2, -1).T)


def test_o_direct_on_disk_and_clean_fallback_on_ramfs(root, make_tier):
    t = make_tier(root, o_direct=True)
    _write_all(t, [1])
    assert t.files.direct, "ext4 takes O_DIRECT; the tier should keep using it"
    assert np.array_equal(_read(t, 1), payload(1))
    with mounted("ramfs") as d:  # ramfs refuses O_DIRECT with EINVAL
        r = make_tier(d, o_direct=True)
        _write_all(r, [2])
        assert not r.files.direct
        assert np.array_equal(_read(r, 2), payload(2))
        assert r.counters().get("writes_failed", 0) == 0
        r.close()


class _Gate:
    """Holds every write at the publish step until released."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, tmp):
        self.entered.set()
        assert self.release.wait(30)


def test_queue_full_drops_without_blocking(root, make_tier):
    t = make_tier(root, threads=1, queue_depth=3)
    gate = t.files.before_publish = _Gate()
    tickets = [t.submit_write(key(0), payload(0))]
    assert gate.entered.wait(10)
    t0 = time.perf_counter()
    tickets += [t.submit_write(key(i), payload(i)) for i in range(1, 6)]
    assert time.perf_counter() - t0 < 0.5, "a full queue must not block the caller"
    assert [x is not None for x in tickets] == [True, True, True, False, False, False]
    assert t.counters()["dropped_queue_full"] == 3
    gate.release.set()
    assert t.flush(10)
    assert [t.contains(key(i)) for i in range(6)] == [True] * 3 + [False] * 3
    assert t.submit_write(key(9), payload(9)) is not None  # room again


def test_cancel_or_wait_cancels_queued_and_waits_for_running(root, make_tier):
    t = make_tier(root, threads=1)
    gate = t.files.before_publish = _Gate()
    running = t.submit_write(key(1), payload(1))
    assert gate.entered.wait(10)
    slot = payload(2).copy()
    queued = t.submit_write(key(2), slot)
    assert queued.cancel_or_wait(1) and queued.succeeded() is False
    slot[:] = 0  # the reused slot's new bytes must never land under key(2)
    assert running.cancel_or_wait(0.2) is False  # running: cannot cancel, still held
    gate.release.set()
    assert running.cancel_or_wait(10) and running.succeeded()
    t.flush(10)
    assert t.contains(key(1)) and not t.contains(key(2))
    assert t.counters()["dropped_cancelled"] == 1


def test_same_key_in_flight_is_written_once(root, make_tier):
    t = make_tier(root, threads=1)
    gate = t.files.before_publish = _Gate()
    first = t.submit_write(key(1), payload(1))
    assert gate.entered.wait(10)
    dup = t.submit_write(key(1), payload(1))
    assert dup is not None and dup.done()
    gate.release.set()
    assert first.wait(10)
    again = t.submit_write(key(1), payload(1))
    assert again.wait(10)
    c = t.counters()
    assert c["writes_ok"] == 1 and c["writes_dedup"] == 1 and c["writes_exist"] == 1


def test_reads_go_before_queued_writes(root, make_tier):
    t = make_tier(root, threads=1)
    _write_all(t, [50])
    gate = t.files.before_publish = _Gate()
    t.submit_write(key(1), payload(1))
    assert gate.entered.wait(10)
    order = []
    t.files.before_publish = lambda tmp: order.append("write")
    for i in range(2, 5):
        t.submit_write(key(i), payload(i))
    out = aligned()
    done = threading.Event()
    assert t.submit_read(key(50), out, lambda ok: (order.append(("read", ok)), done.set()))
    gate.release.set()
    assert done.wait(10) and t.flush(10)
    assert order[0] == ("read", True) and order.count("write") == 3
    assert np.array_equal(out, payload(50))


def test_capacity_evicts_least_recently_used(root, make_tier):
    t = make_tier(root, capacity_bytes=4 * FILE, threads=1, touch_interval_s=0)
    _write_all(t, range(4))
    assert _read(t, 0) is not None  # 0 becomes most recent
    t.touch(key(1))
    _write_all(t, [4, 5])
    t.flush(10)
    assert sorted(i for i in range(6) if t.contains(key(i))) == [0, 1, 4, 5]
    assert t.counters()["evicted"] == 2
    assert t.stats().used_chunks == 4 and t.stats().capacity_chunks == 4


def test_restart_rebuilds_index_in_last_access_order(root, make_tier):
    a = make_tier(root)
    _write_all(a, range(5))
    a.close()
    now = time.time()
    # Give each file a distinct last access in the past: 3 oldest ... 1 newest
    # (kernel timestamps are coarse: a restamp "now" can trail time.time()).
    for age, i in enumerate([1, 4, 0, 2, 3], start=1):
        p = a.path_of(key(i))
        os.utime(p, (now - 100 * age, now - 100 * age))
    b = make_tier(root, capacity_bytes=5 * FILE, touch_interval_s=0)
    assert b.keys_lru_order() == [key(i) for i in [3, 2, 0, 4, 1]]
    assert all(b.contains(key(i)) for i in range(5))
    assert _read(b, 3) is not None  # now the most recent, on disk too
    b.flush(10)
    assert os.stat(b.path_of(key(3))).st_mtime > now - 5
    _write_all(b, [9])  # over budget: the oldest by last access goes (2, not 3)
    b.flush(10)
    assert not b.contains(key(2)) and b.contains(key(3))
    c = make_tier(root)
    assert c.keys_lru_order()[-1] in (key(9), key(3))
    assert c.keys_lru_order()[:3] == [key(0), key(4), key(1)]


def test_stale_temps_are_removed_at_start_young_ones_kept(root, make_tier, fp):
    a = make_tier(root)
    _write_all(a, [1])
    d = os.path.dirname(a.path_of(key(1)))
    old_tmp = os.path.join(d, fslayout.temp_name("deadbeef"))  # our own naming: only those are reaped
    young_tmp = os.path.join(d, fslayout.temp_name("deadbeef"))
    theirs = os.path.join(d, fslayout.temp_name("deadbeef"))  # our naming, not our bytes: not ours
    for p, body in ((old_tmp, MAGIC + b"partial"), (young_tmp, MAGIC + b"partial"), (theirs, b"their data")):
        with open(p, "wb") as f:
            f.write(body)
    for p in (old_tmp, theirs):
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    b = make_tier(root, stale_tmp_s=600)
    assert not os.path.exists(old_tmp) and os.path.exists(young_tmp) and os.path.exists(theirs)
    assert b.counters()["stale_temps_removed"] == 1
    assert b.keys_lru_order() == [key(1)]


def test_from_config(root, fp):
    assert FileTier.from_config(OffloadConfig(), fp, CHUNK) is None
    cfg = OffloadConfig.from_sources({"shared_storage_path": root, "fs_capacity": "1MiB", "fs_allow_unauthenticated": True,
                                      "fs_threads": 3, "fs_queue_depth": 5})
    reg = CollectorRegistry()
    t = FileTier.from_config(cfg, fp, CHUNK, OffloadMetrics(reg))
    try:
        assert t.capacity_bytes == 1 << 20 and t.queue_depth == 5 and t.state is TierState.RW
        assert t.ns_dir == os.path.join(root, fp.namespace())
    finally:
        t.close()


def test_metrics_are_exported(root, make_tier):
    reg = CollectorRegistry()
    om = OffloadMetrics(reg)
    t = make_tier(root, metrics=om, capacity_bytes=2 * FILE, threads=1)
    _write_all(t, range(3))
    assert _read(t, 2) is not None and _read(t, 0) is None
    # a corrupt file: flip a payload byte of key 2
    with open(t.path_of(key(2)), "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 1]))
    assert _read(t, 2) is None
    t.flush(10)
    g = lambda name, **lb: reg.get_sample_value(name, {"tier": "fs", **lb})  # noqa: E731
    assert g("tpu_offload_fs_bytes_total", op="write") == 3 * CHUNK
    assert g("tpu_offload_fs_bytes_total", op="read") == CHUNK
    assert g("tpu_offload_fs_ops_total", op="write", result="ok") == 3
    assert g("tpu_offload_fs_ops_total", op="read", result="miss") == 1
    assert g("tpu_offload_fs_latency_seconds_count", op="write") == 3
    assert g("tpu_offload_fs_evicted_files_total") == 1
    assert g("tpu_offload_fs_corrupt_files_total", reason="checksum") == 1
    assert g("tpu_offload_evicted_chunks_total") == 1
    assert g("tpu_offload_load_errors_total") == 1
    assert g("tpu_offload_stored_chunks_total") == 3
    assert g("tpu_offload_tier_capacity_chunks") == 2
    assert g("tpu_offload_tier_used_chunks") == 1
    assert g("tpu_offload_fs_capacity_bytes") == 2 * FILE
    assert g("tpu_offload_fs_used_bytes") == FILE
    assert g("tpu_offload_fs_state", state="rw") == 1
    # a second tier on the same registry shares the families
    t2 = make_tier(root, metrics=om, name="fs2")
    assert t2.fs_metrics is t.fs_metrics


_MULTIPROC_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from fs_helpers import aligned, key, layout
from tpu_offload.core.fs import FileTier, FsMetrics
t = FileTier(sys.argv[1], layout(), 64 << 10, capacity_bytes=1 << 30, fs_metrics=FsMetrics(CollectorRegistry()))
b = aligned(); b[:] = 7
assert t.submit_write(key(1), b).wait(10)
t.fs_metrics.refresh(force=True)
reg = CollectorRegistry()
MultiProcessCollector(reg)  # what vLLM's /metrics exports under PROMETHEUS_MULTIPROC_DIR
out = {f"{s.name}{sorted(s.labels.items())}": s.value for fam in reg.collect() for s in fam.samples
       if s.name.startswith("tpu_offload_fs_") and not s.name.endswith(("_total", "_bucket", "_count", "_sum"))}
t.close()
print(json.dumps(out))
"""


def test_usage_gauges_are_exported_under_prometheus_multiproc_dir(root, tmp_path):
    """vLLM's server reads only the multiprocess files there: the tier's gauges must be in them."""
    import json
    import subprocess
    import sys

    from fs_helpers import REPO, child_env

    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    r = subprocess.run([sys.executable, "-c", _MULTIPROC_CHILD, root, os.path.join(REPO, "tests", "fs")],
                       capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["tpu_offload_fs_used_bytes[('tier', 'fs')]"] == FILE
    assert got["tpu_offload_fs_capacity_bytes[('tier', 'fs')]"] == 1 << 30
    assert got["tpu_offload_fs_files[('tier', 'fs')]"] == 1
    assert got["tpu_offload_fs_state[('state', 'rw'), ('tier', 'fs')]"] == 1


def test_a_crashed_writers_temp_stamped_in_the_future_goes_once_unchanged_on_our_clock(root, make_tier):
    """Clock skew cannot keep a crashed writer's temp alive: a rescan judges it by our own monotonic
    observation (unchanged for stale_tmp_s across rescans), not by its mtime against any wall clock."""
    a = make_tier(root)
    _write_all(a, [1])
    d = os.path.dirname(a.path_of(key(1)))
    other_host = "0badc0de" if fslayout.HOST_TAG != "0badc0de" else "0badc0df"
    crashed = os.path.join(d, f".tmp.{key(1).hex()[:16]}.4242.{other_host}.11111111.0")  # another host's pid
    live = os.path.join(d, f".tmp.{key(1).hex()[:16]}.4243.{other_host}.11111111.1")
    for p in (crashed, live):
        with open(p, "wb") as f:
            f.write(MAGIC + b"partial")
        future = time.time() + 86400  # its host's clock ran a day ahead
        os.utime(p, (future, future))
    b = make_tier(root, stale_tmp_s=0.5)
    assert os.path.exists(crashed) and os.path.exists(live)  # at start nothing says it is stale
    time.sleep(0.3)
    b.rescan()
    assert os.path.exists(crashed), "reaped before it stayed unchanged for stale_tmp_s"
    time.sleep(0.4)
    with open(live, "ab") as f:  # a live writer keeps changing its temp
        f.write(b"more")
    b.rescan()
    assert not os.path.exists(crashed), "a future-stamped crashed temp outlived stale_tmp_s of our clock"
    assert os.path.exists(live), "a temp that is still being written was reaped"
    assert b.counters()["unchanged_temps_removed"] == 1


def test_a_dead_local_writers_temp_goes_at_start_whatever_its_mtime(root, make_tier):
    import subprocess
    import sys

    a = make_tier(root)
    _write_all(a, [1])
    d = os.path.dirname(a.path_of(key(1)))
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)  # this host, this boot and pid namespace, exited
    tmp = os.path.join(d, f".tmp.{key(1).hex()[:16]}.{dead_pid}.{fslayout.HOST_TAG}.22222222.0")
    with open(tmp, "wb") as f:
        f.write(MAGIC + b"partial")
    future = time.time() + 86400
    os.utime(tmp, (future, future))
    b = make_tier(root, stale_tmp_s=600)
    assert not os.path.exists(tmp) and b.counters()["dead_temps_removed"] == 1
