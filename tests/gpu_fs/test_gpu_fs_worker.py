"""The worker side of the file tier, on CPU tensors (no vLLM engine).

A real ``FileTier`` on a temp directory under a real ``HostTransferEngine``:
write-through, write-back through the ring, promotion (async reads, then
the device copy), corrupt files as load errors, and the slot-reuse rule.
A second engine over the same directory stands in for another process.
"""

from __future__ import annotations

import os
import time
import types

import numpy as np
import pytest
import torch

from tpu_offload.core.fs import FileTier
from tpu_offload.core.keys import LayoutFingerprint

from gpu_offload.vllm.fs_specs import HostLoadSpec, HostStoreSpec
from gpu_offload.torch_backend.engine import HostTransferEngine

NUM_BLOCKS, NUM_SLOTS, K = 32, 8, 2
PAGES = (4096, 8192)  # two canonical tensors with different page sizes
FP = LayoutFingerprint("tiny", "int8", 16, K, 2, 2, 64)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, generator=g) for p in PAGES]


def engine(root, mode="write_through", seed=0, ring_slots=None, **tier_kw):
    ts = tensors(seed)
    eng = HostTransferEngine(ts, list(PAGES), [(0, 1)], NUM_SLOTS, K, strategy="direct")
    tier = FileTier(str(root), FP, eng.pool.chunk_bytes, capacity_bytes=None, threads=2, **tier_kw)
    eng.attach_files(tier, mode, ring_slots)
    return eng, ts


def gpu(blocks):
    return types.SimpleNamespace(block_ids=np.asarray(blocks, np.int32), group_sizes=[len(blocks)],
                                 block_indices=[0])


def store(eng, job, blocks, slots, keys, evicted=()):
    eng.submit_store(job, gpu(blocks), HostStoreSpec(slots, keys, evicted))
    assert [r.job_id for r in eng.get_finished()] == [job]


def finish(eng, job_ids, timeout=10.0):
    eng.wait(set(job_ids))
    got = [r.job_id for r in eng.get_finished()]
    assert sorted(got) == sorted(job_ids)


def expected_row(ts, blocks) -> np.ndarray:
    """A chunk's slot bytes per the documented layout: per tensor, its pages back to back."""
    return np.concatenate([t[blocks].numpy().view(np.uint8).reshape(-1) for t in ts])


def file_payload(tier: FileTier, k: bytes) -> np.ndarray:
    out = np.empty(tier.chunk_bytes, np.uint8)
    assert tier.read_into(k, out)
    return out


@pytest.fixture
def root(tmp_path):
    return tmp_path / "fs"


def test_write_through_then_another_engine_promotes_bit_exact(root):
    a, ts = engine(root)
    store(a, 1, [0, 1, 2, 3], [5, 2], [key(1), key(2)])
    assert a.fs.flush(10)
    assert a.fs.stats.writes == 2
    assert np.array_equal(file_payload(a.fs.tier, key(1)), expected_row(ts, [0, 1]))
    assert np.array_equal(file_payload(a.fs.tier, key(2)), expected_row(ts, [2, 3]))

    b, tb = engine(root, seed=1)  # another "process": different KV, empty slab
    b.submit_load(7, HostLoadSpec([3, 6], [key(1), key(2)], [True, True]), gpu([10, 11, 20, 21]))
    finish(b, [7])
    for t_a, t_b in zip(ts, tb):
        assert torch.equal(t_b[[10, 11, 20, 21]], t_a[[0, 1, 2, 3]])
    assert b.fs.stats.promotions == 2 and b.fs.stats.promotion_failures == 0
    assert b.take_load_error_blocks() == set()
    assert b.pool.valid[[3, 6]].all()
    for e in (a, b):
        e.shutdown()


def test_corrupt_file_is_a_load_error_and_is_removed(root):
    a, ts = engine(root)
    store(a, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert a.fs.flush(10)
    path = a.fs.tier.path_of(key(2))
    with open(path, "r+b") as f:  # flip payload bytes of the published file
        f.seek(os.path.getsize(path) - 100)
        f.write(b"\xff" * 8)
    b, tb = engine(root, seed=1)
    before = [t[[12, 13]].clone() for t in tb]
    b.submit_load(2, HostLoadSpec([4, 5], [key(1), key(2)], [True, True]), gpu([10, 11, 12, 13]))
    finish(b, [2])
    assert b.take_load_error_blocks() == {12, 13}  # the corrupt chunk's blocks: recomputed by vLLM
    assert all(torch.equal(t[[12, 13]], x) for t, x in zip(tb, before))  # never copied to the device
    assert all(torch.equal(t_b[[10, 11]], t_a[[0, 1]]) for t_a, t_b in zip(ts, tb))
    assert b.fs.stats.promotion_failures == 1 and not b.pool.valid[5]
    assert b.fs.tier.counters().get("corrupt", 0) == 1 and not os.path.exists(path)
    for e in (a, b):
        e.shutdown()


def test_write_back_saves_evicted_bytes_before_the_slot_is_reused(root):
    a, ts = engine(root, mode="write_back")
    store(a, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert a.fs.stats.writes == 0 and not os.listdir(a.fs.tier.ns_dir)  # nothing written yet
    # key(1) is evicted; its slot 0 now receives blocks 8..9 under key(3)
    store(a, 2, [8, 9], [0], [key(3)], evicted=[key(1)])
    assert a.fs.flush(10)
    assert a.fs.stats.write_backs == 1
    assert np.array_equal(file_payload(a.fs.tier, key(1)), expected_row(ts, [0, 1]))  # old bytes, not new
    assert not a.fs.tier.contains(key(3)) and not a.fs.tier.contains(key(2))
    a.shutdown()


def test_write_back_skips_invalid_slots_and_chunks_that_came_from_files(root):
    a, ts = engine(root, mode="write_back")
    from gpu_offload import testing

    testing.fail_next_stores(a, 1)
    store(a, 1, [0, 1], [0], [key(1)])  # failed: slot 0 invalid
    store(a, 2, [2, 3], [0], [key(2)], evicted=[key(1)])
    assert a.fs.flush(10) and a.fs.stats.write_backs == 0 and not a.fs.tier.contains(key(1))
    store(a, 3, [4, 5], [1], [key(3)])
    store(a, 4, [6, 7], [1], [key(4)], evicted=[key(3)])  # written back
    assert a.fs.flush(10) and a.fs.stats.write_backs == 1
    a.submit_load(5, HostLoadSpec([2], [key(3)], [True]), gpu([20, 21]))  # promoted into slot 2
    finish(a, [5])
    store(a, 6, [8, 9], [2], [key(5)], evicted=[key(3)])  # its bytes are on file already
    assert a.fs.flush(10) and a.fs.stats.write_backs == 1
    a.shutdown()


def test_write_back_ring_full_drops_and_counts(root):
    a, ts = engine(root, mode="write_back", ring_slots=1, queue_depth=1)
    store(a, 1, [0, 1, 2, 3, 4, 5], [0, 1, 2], [key(1), key(2), key(3)])
    # Hold the tier's I/O threads (its queue's re-entrant lock, private): the
    # first write-back cannot finish, so the one-buffer ring stays busy.
    a.fs.tier._workers._cv.acquire()
    try:
        store(a, 2, [8, 9, 10, 11, 12, 13], [0, 1, 2], [key(4), key(5), key(6)],
              evicted=[key(1), key(2), key(3)])
    finally:
        a.fs.tier._workers._cv.release()
    assert a.fs.stats.write_backs == 1 and a.fs.stats.write_backs_ring_full == 2
    assert a.fs.flush(10)
    assert a.fs.tier.contains(key(1)) and not a.fs.tier.contains(key(2))
    assert np.array_equal(file_payload(a.fs.tier, key(1)), expected_row(ts, [0, 1]))
    a.shutdown()


def test_slot_reuse_never_publishes_new_bytes_under_an_old_key(root):
    """A queued write-through of slot 0 (key 1) must not run once slot 0 holds
    key 2's bytes: the overwrite cancels it (or waits for it)."""
    a, ts = engine(root)
    a.fs.tier._workers._cv.acquire()  # hold the I/O threads (private lock): key 1's write stays queued
    try:
        store(a, 1, [0, 1], [0], [key(1)])
        store(a, 2, [2, 3], [0], [key(2)])
    finally:
        a.fs.tier._workers._cv.release()
    assert a.fs.flush(10)
    assert not a.fs.tier.contains(key(1))  # cancelled, never written with key 2's bytes
    assert a.fs.tier.counters().get("dropped_cancelled") == 1
    assert np.array_equal(file_payload(a.fs.tier, key(2)), expected_row(ts, [2, 3]))
    for i in range(3, 12):  # unheld: each overwrite either cancels or waits; files hold their own bytes
        store(a, i, [2 * i, 2 * i + 1], [0], [key(i)])
    assert a.fs.flush(10)
    for i in range(3, 12):
        if a.fs.tier.contains(key(i)):
            assert np.array_equal(file_payload(a.fs.tier, key(i)), expected_row(ts, [2 * i, 2 * i + 1])), i
    assert a.fs.tier.contains(key(11))  # the last one is never overwritten
    a.shutdown()


def test_a_load_on_a_slot_being_promoted_waits_for_it(root):
    a, ts = engine(root)
    store(a, 1, [0, 1], [0], [key(1)])
    assert a.fs.flush(10)
    b, tb = engine(root, seed=1)
    b.fs.tier._workers._cv.acquire()  # the read cannot land before the second load is submitted
    try:
        b.submit_load(2, HostLoadSpec([3], [key(1)], [True]), gpu([10, 11]))
        b.submit_load(3, HostLoadSpec([3], [key(1)], [False]), gpu([20, 21]))  # same slot, plain
        assert b.get_finished() == []
    finally:
        b.fs.tier._workers._cv.release()
    finish(b, [2, 3])
    assert b.take_load_error_blocks() == set()
    for t_a, t_b in zip(ts, tb):
        assert torch.equal(t_b[[10, 11]], t_a[[0, 1]]) and torch.equal(t_b[[20, 21]], t_a[[0, 1]])
    for e in (a, b):
        e.shutdown()


def test_unplaced_chunk_fails_the_load_job(root):
    b, _ = engine(root)
    b.submit_load(1, HostLoadSpec([-1], [key(9)], [True]), gpu([4, 5]))
    finish(b, [1])
    assert b.take_load_error_blocks() == {4, 5}
    b.shutdown()


def _published(tier: FileTier, k: bytes) -> bool:
    return os.path.exists(tier.path_of(k))


def test_write_back_publishes_an_idle_engines_chunks_within_the_lag(root):
    """No engine step after the store: the drainer thread still writes them."""
    ts = tensors(0)
    a = HostTransferEngine(ts, list(PAGES), [(0, 1)], NUM_SLOTS, K, strategy="direct")
    a.attach_files(FileTier(str(root), FP, a.pool.chunk_bytes, capacity_bytes=None, threads=2),
                   "write_back", write_back_lag_s=0.3)
    t0 = time.monotonic()
    store(a, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert not _published(a.fs.tier, key(1)) and a.fs.dirty_chunks == 2  # held back for the lag
    while not (_published(a.fs.tier, key(1)) and _published(a.fs.tier, key(2))):
        assert time.monotonic() - t0 < 5.0, "write-back lag not honoured"
        time.sleep(0.02)
    assert time.monotonic() - t0 >= 0.3 and a.fs.stats.lag_writes == 2 and a.fs.dirty_chunks == 0
    assert np.array_equal(file_payload(a.fs.tier, key(2)), expected_row(ts, [2, 3]))
    store(a, 2, [4, 5], [0], [key(3)], evicted=[key(1)])  # already on file: not written again
    assert a.fs.flush(10) and a.fs.stats.write_backs == 0
    a.shutdown()


def test_write_back_chunks_still_in_ram_reach_the_files_at_shutdown(root):
    a, ts = engine(root, mode="write_back")  # no lag: only eviction or shutdown writes
    store(a, 1, [0, 1, 2, 3, 4, 5], [0, 1, 2], [key(1), key(2), key(3)])
    assert a.fs.flush(10) and not any(_published(a.fs.tier, key(i)) for i in (1, 2, 3))
    a.shutdown()
    assert a.fs.stats.shutdown_writes == 3 and a.fs.stats.writes_dropped == 0
    b, _ = engine(root, seed=1)  # another process's view of the directory
    for i, blocks in ((1, [0, 1]), (2, [2, 3]), (3, [4, 5])):
        assert np.array_equal(file_payload(b.fs.tier, key(i)), expected_row(ts, blocks))
    b.shutdown()


def test_worker_sends_file_tier_metrics_through_vllms_channel(root):
    from gpu_offload.vllm import metrics
    from gpu_offload.vllm.worker import HostOffloadWorker

    w = HostOffloadWorker(tensors(0), list(PAGES), [(0, 1)], NUM_SLOTS, K, strategy="direct",
                          tokens_per_block=[16], rank=3)
    w.fs_metrics = metrics.worker_fs_metrics()
    w.attach_files(FileTier(str(root), FP, w.pool.chunk_bytes, capacity_bytes=1 << 30, threads=2,
                            fs_metrics=w.fs_metrics))
    store(w, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert w.fs.flush(10)
    w.submit_load(2, HostLoadSpec([1], [key(2)], [False]), gpu([9]))  # one block of chunk 2: 16 tokens
    finish(w, [2])
    data = w.take_connector_stats().data["data"]
    declared = metrics.metric_definitions()
    assert set(data) <= set(declared)
    assert data[metrics.FS_BYTES][("fs", "write")] == 2 * w.pool.chunk_bytes
    assert len(data[metrics.FS_LATENCY][("fs", "write")]) == 2
    assert data[metrics.FS_GAUGES["files"]][("fs", "3")] == 2
    assert data[metrics.FS_GAUGES["capacity_bytes"]][("fs", "3")] == 1 << 30
    assert data[metrics.FS_STATE][("fs", "3", "rw")] == 1
    assert metrics.HIT_TOKENS not in data  # hits are sent by rank 0 only (vLLM sums over ranks)
    assert w.take_connector_stats() is None  # the file tier is read at most once a second
    w._stats._next_fs = 0.0  # as if a second had passed
    again = w.take_connector_stats().data["data"]  # counters are deltas, gauges snapshots
    assert metrics.FS_BYTES not in again and metrics.FS_LATENCY not in again
    assert again[metrics.FS_GAUGES["files"]][("fs", "3")] == 2
    w.rank = w._stats.rank = 0
    assert w.take_connector_stats().data["data"][metrics.HIT_TOKENS] == {("cpu",): 16}
    w.shutdown()


def test_a_tenants_chunks_are_signed_with_its_salt_and_only_that_tenant_promotes_them(root):
    """With a secret, the request's cache_salt picks the keys: another salt neither finds nor verifies them."""
    secret = b"a-secret-of-32-bytes-0123456789ab"
    a, ts = engine(root, secret=secret)
    a.submit_store(1, gpu([0, 1, 2, 3]), HostStoreSpec([5, 2], [key(1), key(2)], salt=b"tenant-a"))
    assert [r.job_id for r in a.get_finished()] == [1]
    assert a.fs.flush(10)
    out = np.empty(a.fs.tier.chunk_bytes, np.uint8)
    assert a.fs.tier.read_into(key(1), out, b"tenant-a") and np.array_equal(out, expected_row(ts, [0, 1]))
    assert not a.fs.tier.contains(key(1)) and not a.fs.tier.contains(key(1), b"tenant-b")
    b, tb = engine(root, seed=1, secret=secret)
    before = [t[[10, 11]].clone() for t in tb]
    b.submit_load(7, HostLoadSpec([3], [key(1)], [True], salt=b"tenant-b"), gpu([10, 11]))
    finish(b, [7])
    assert b.take_load_error_blocks() == {10, 11} and all(torch.equal(t[[10, 11]], x) for t, x in zip(tb, before))
    b.submit_load(8, HostLoadSpec([4], [key(1)], [True], salt=b"tenant-a"), gpu([12, 13]))
    finish(b, [8])
    assert b.take_load_error_blocks() == set()
    assert all(torch.equal(t_b[[12, 13]], t_a[[0, 1]]) for t_a, t_b in zip(ts, tb))
    for e in (a, b):
        e.shutdown()


def test_a_failed_promotion_names_just_its_chunk(root):
    """The scheduler hides only the chunks that failed (not every load of the step): the worker names them."""
    a, ts = engine(root)
    store(a, 1, [0, 1, 2, 3], [0, 1], [key(1), key(2)])
    assert a.fs.flush(10)
    with open(a.fs.tier.path_of(key(2)), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    b, _ = engine(root, seed=1)
    b.submit_load(2, HostLoadSpec([4, 5], [key(1), key(2)], [True, True]), gpu([10, 11, 12, 13]))
    finish(b, [2])
    blocks, failures = b.take_load_failures()
    assert blocks == {12, 13} and failures == {2: [key(2)]}
    for e in (a, b):
        e.shutdown()


def test_a_reset_epoch_moves_the_worker_to_a_new_namespace_and_retires_the_old(root):
    from tpu_offload.core.fs.reset import salted

    a, ts = engine(root, mode="write_back")
    old = a.fs.tier
    a.fs._make_tier = lambda epoch: FileTier(str(root), salted(FP, epoch), a.pool.chunk_bytes,
                                             capacity_bytes=None, threads=2)
    store(a, 1, [0, 1], [0], [key(1)])
    a.fs.drain(older_than=None)
    assert a.fs.flush(10) and os.path.exists(old.path_of(key(1)))
    store(a, 2, [2, 3], [1], [key(2)])  # dirty (write-back) when the reset comes: old weights' KV
    a.submit_store(3, gpu([4, 5]), HostStoreSpec([2], [key(3)], epoch="e1"))
    assert [r.job_id for r in a.get_finished()] == [3]
    assert a.fs.tier is not old and a.fs.tier.ns_dir != old.ns_dir and a.fs.stats.reset_discarded == 1
    deadline = time.monotonic() + 30
    while os.path.exists(old.ns_dir) and any(f for _, _, fs in os.walk(old.ns_dir) for f in fs) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(f for _, _, fs in os.walk(old.ns_dir) for f in fs if not f.startswith(".")), "old namespace leaked"
    a.fs.close(10)
    assert os.path.exists(a.fs.tier.path_of(key(3))) and not os.path.exists(a.fs.tier.path_of(key(2)))
    a.shutdown()


def test_a_lease_hint_reaches_each_workers_file_tier_through_the_step_metadata(root):
    """``HostOffloadSpec``'s file tier lives in the workers, the hint in the scheduler's request: our manager
    queues the lease, the scheduler hook puts it on the step's metadata, the worker hook leases the files,
    and another session's traffic through the budget then evicts everything but the leased prefix."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _create_req_context
    from vllm.v1.request import Request

    from tpu_offload.core.fs.format import HEADER_SIZE
    from tpu_offload.core.leases import HINT_KEY
    from gpu_offload.vllm import hooks, metrics
    from gpu_offload.vllm.manager import HostTierManager
    from gpu_offload.vllm.worker import HostOffloadWorker

    def ctx(req_id, params, keys=()):
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        c = _create_req_context(Request(request_id=req_id, prompt_token_ids=[1, 2, 3], sampling_params=sp,
                                        pooling_params=None))
        for i, k in enumerate(keys):
            c.set_offload_key_position(k, (i + 1) * 16)
        return c

    w = HostOffloadWorker(tensors(0), list(PAGES), [(0, 1)], NUM_SLOTS, K, strategy="direct", tokens_per_block=[16])
    budget = 8 * (HEADER_SIZE + w.pool.chunk_bytes)
    w.attach_files(FileTier(str(root), FP, w.pool.chunk_bytes, capacity_bytes=budget, threads=2,
                            lease_max_fraction=0.5))
    m = HostTierManager(NUM_SLOTS, w.pool.chunk_bytes, lease_files=True)
    sched = SimpleNamespace(connector_scheduler=SimpleNamespace(manager=m))
    work = SimpleNamespace(connector_worker=SimpleNamespace(worker=w))
    build_meta = hooks.wrap_build_connector_meta(lambda self, so: SimpleNamespace())
    build_worker_meta = hooks.wrap_build_connector_worker_meta(lambda self: None)

    def step():
        work._connector_metadata = build_meta(sched, SimpleNamespace(total_num_scheduled_tokens=64))
        build_worker_meta(work)

    mine = [key(i) for i in range(4)]
    params = {HINT_KEY: {"session": "agent", "ttl_s": 300}}
    m.on_new_request(ctx("a", params))
    store(w, 1, list(range(8)), [0, 1, 2, 3], mine)
    assert w.fs.flush(10)
    m.on_request_finished(ctx("a", params, mine))
    step()
    assert w.fs.tier.leases.sessions() == 1 and len(w.fs.tier.leases) == 4
    assert m.take_fs_leases() is None  # each order travels once
    for j in range(3):  # another session: 12 chunks through the 8-file budget
        store(w, 2 + j, list(range(8, 16)), [4, 5, 6, 7], [key(100 + 4 * j + i) for i in range(4)])
        assert w.fs.flush(10)
    assert [w.fs.tier.contains(k) for k in mine] == [True] * 4
    assert w.fs.tier.leases.honoured > 0
    w.fs_metrics = metrics.worker_fs_metrics()  # rank 0 sends the file tier's lease series
    data = w.take_connector_stats().data["data"]
    assert data[metrics.LEASED_BYTES] == {("fs",): 4 * w.pool.chunk_bytes}
    assert data[metrics.LEASE_HONOURED] == {("fs",): w.fs.tier.leases.honoured}
    renewed, renew = [], w.fs.tier.renew
    w.fs.tier.renew = lambda session, ttl_s: renewed.append((session, ttl_s)) or renew(session, ttl_s)
    m.on_new_request(ctx("b", params))  # the session is back: the renewal reaches the worker too
    step()
    assert renewed == [("agent", 300.0)]
    w.shutdown()
