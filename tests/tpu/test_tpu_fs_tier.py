"""The shared-filesystem tier under the TPU host tier.

Files written by one engine are promoted into another engine's host tier and
loaded; the stand-in forward checks every KV position it reads, so a wrong
promotion fails the run.
"""

import functools
import os
import time

import pytest

from tpu_standin import chunk_files, prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture
def make(fs_harness):
    return functools.partial(fs_harness, staging_blocks=8, blocks_per_chunk=2)


def test_write_back_on_eviction_and_mixed_prefix(make, tmp_path):
    h = make(fs_write_mode="write_back", num_cpu_chunks=4, fs_write_back_lag_s=3600)  # eviction only
    p = prompt(6 * 2 * BS, 2)  # 6 chunks, the host tier holds 4
    h.add(p, max_tokens=1)
    h.run()
    h.wrk.fs.tier.flush(timeout=30)
    assert len(chunk_files(tmp_path / "kv")) == 2  # exactly the two evicted chunks were written back
    assert h.sched.reset_prefix_cache()
    matched = []
    orig = h.conn_s.get_num_new_matched_tokens
    h.conn_s.get_num_new_matched_tokens = lambda r, n: matched.append(orig(r, n)) or matched[-1]
    core = h.sch.metrics.core  # hits by tier, as a router and the serving benchmark read them
    hit = lambda tier: core.registry.get_sample_value(  # noqa: E731
        "tpu_offload_hit_tokens_total", {"tier": tier, **core.labels}) or 0
    before = hit("fs"), hit("cpu")  # the registry is process-wide
    h.add(p, max_tokens=2)
    h.run()
    # Chunks 0-1 come from files, 2-3 from host RAM; promoting needs 2 host slots, so the
    # prefix stops where the tier (4 slots) could not hold files and host hits together.
    assert matched[0] == (4 * 2 * BS, True)
    assert (hit("fs") - before[0], hit("cpu") - before[1]) == (2 * 2 * BS, 2 * 2 * BS)
    assert h.wrk.totals["loaded_chunks"] == 4
    assert h.wrk.totals.get("load_errors", 0) == 0
    assert h.sch.manager.stats().pinned_chunks == 0 and not h.sch.has_pending_work()


def test_corrupt_file_is_a_load_error_and_recomputed(make, tmp_path):
    a = make(fs_write_mode="write_through")
    p = prompt(4 * 2 * BS, 3)
    a.add(p, max_tokens=1)
    a.run()
    a.wrk.fs.tier.flush(timeout=30)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "kv") for f in fs if not f.startswith(".")]
    target = sorted(paths, key=os.path.getmtime)[1]  # the second chunk written
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) - 100)
        f.write(b"\xff" * 50)
    b = make(fs_write_mode="write_through")
    b.add(p, max_tokens=2)
    b.run()  # recomputed from the bad chunk on: the forward check passes
    assert b.wrk.totals["load_errors"] >= 1
    assert b.sch.manager.stats().pinned_chunks == 0 and not b.sch.has_pending_work()


def test_reset_connector_forgets_host_and_file_tiers(make, tmp_path):
    """reset_prefix_cache(reset_connector=True) after an RL weight update: nothing stored before
    it comes back, from host RAM or from files; what is stored after it is found again."""
    h = make(fs_write_mode="write_through")
    p = prompt(5 * 2 * BS, 4)
    h.add(p, max_tokens=1)
    h.run()
    h.wrk.fs.tier.flush(timeout=30)
    old_ns = h.sch.fs.ns_dir
    assert len(chunk_files(old_ns)) == 5
    assert h.sched.reset_prefix_cache(reset_connector=True)  # vLLM's route to OffloadScheduler.reset_cache
    assert h.sch.fs.ns_dir != old_ns
    matched = []
    orig = h.conn_s.get_num_new_matched_tokens
    h.conn_s.get_num_new_matched_tokens = lambda r, n: matched.append(orig(r, n)) or matched[-1]
    h.add(p, max_tokens=1)
    h.run()
    assert matched[0] == (0, False)  # neither tier serves the old weights' KV
    assert h.wrk.totals.get("loaded_chunks", 0) == 0
    h.wrk.fs.tier.flush(timeout=30)
    assert h.wrk.fs.tier.ns_dir == h.sch.fs.ns_dir  # the worker writes where the scheduler looks
    assert len(chunk_files(h.sch.fs.ns_dir)) == 5  # recomputed KV, new namespace
    deadline = time.monotonic() + 30  # the old tier retires on a thread: its namespace's files go
    while chunk_files(old_ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert chunk_files(old_ns) == [], "a reset leaked the old namespace"
    assert h.sched.reset_prefix_cache()  # HBM forgets; the new namespace and host tier serve
    matched.clear()
    h.add(p + [7], max_tokens=1)
    h.run()
    assert matched[0] == (5 * 2 * BS, True)
