"""Device sources: chunks vLLM's own block pool still caches, as hits (no engine needed).

The scheduler side runs against vLLM's real ``BlockPool``; the worker side
copies engine block to engine block on CPU tensors (both copy strategies:
"staged" is the indexed path CUDA uses). The real engine is in
test_gpu_interleaved.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_offload.torch_backend.engine import HostTransferEngine
from gpu_offload.vllm.device_source import DeviceSource
from gpu_offload.vllm.fs_specs import HostLoadSpec
from gpu_offload.vllm.manager import HostTierManager

TPB = 16  # tokens per block


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def key(i: int) -> bytes:
    return make_offload_key(h(i), 0)


def cache(pool: BlockPool, hashes) -> list[int]:
    """Blocks cached under ``hashes`` and free (evictable), as after their request finished."""
    blocks = pool.get_new_blocks(len(hashes))
    for b, x in zip(blocks, hashes):
        k = make_block_hash_with_group_id(x, 0)
        b.set_block_hash(k)
        pool.cached_block_hash_to_block.insert(k, b)
    pool.free_blocks(blocks)
    return [b.block_id for b in blocks]


def ctx(req_id: str, n_chunks: int, k: int = 1) -> ReqContext:
    c = ReqContext(req_id=req_id)
    for i in range(n_chunks):
        c.set_offload_key_position(key(i * k + k - 1), (i + 1) * k * TPB)
    return c


def stored(mgr, keys, c):
    out = mgr.prepare_store(keys, c)
    mgr.complete_store(out.keys_to_store, c)


@pytest.fixture
def parts():
    pool = BlockPool(32, enable_caching=True, hash_block_size=TPB)
    mgr = HostTierManager(8, 4096, blocks_per_chunk=1, tokens_per_block=TPB)
    mgr.bind_device(DeviceSource(pool, 0, 1, TPB))
    yield pool, mgr
    mgr.shutdown()


def lookup(mgr, c, keys, block_hashes=()):
    """One vLLM lookup of a request, as the hooks scope it; stops at the first miss. vLLM's own hit
    is not given (the rule for the first chunk after it is tested on its own)."""
    mgr.device.begin(c.req_id, list(block_hashes))
    hits = []
    for k in keys:
        r = mgr.lookup(k, c)
        if r is LookupResult.MISS:
            break
        hits.append(k)
    mgr.device.end(c.req_id, len(hits))
    return hits


def test_a_chunk_only_the_device_holds_is_a_hit_pinned_until_its_load_completes(parts):
    pool, mgr = parts
    c = ctx("r", 3)
    stored(mgr, [key(0), key(2)], c)  # tier: 0 and 2
    (b1,) = cache(pool, [h(1)])  # device: 1 only
    free = pool.get_num_free_blocks()
    assert lookup(mgr, c, [key(0), key(1), key(2)]) == [key(0), key(1), key(2)]
    assert pool.blocks[b1].ref_cnt == 1 and pool.get_num_free_blocks() == free - 1  # vLLM cannot reuse it
    spec = mgr.prepare_load([key(0), key(1), key(2)], c)
    mgr.device.settle("r")
    assert isinstance(spec, HostLoadSpec)
    assert spec.block_ids[1] == -1 and spec.device_blocks == [None, (b1,), None]
    assert spec.block_ids[0] >= 0 and spec.block_ids[2] >= 0
    assert mgr.get_load_source(key(1), c) == CacheHitSource.DEVICE
    assert mgr.get_load_source(key(0), c) == CacheHitSource.HOST
    assert (mgr.hit_chunks, mgr.device_hit_chunks) == (2, 1)
    assert pool.blocks[b1].ref_cnt == 1  # settle keeps what the load took
    mgr.complete_load([key(0), key(1), key(2)], c)
    assert pool.blocks[b1].ref_cnt == 0 and pool.get_num_free_blocks() == free
    assert mgr.index.stats().pinned_chunks == 0 and mgr.ignored_completions == 0
    assert mgr.device.pinned_blocks == 0


def test_the_device_copy_is_taken_when_both_hold_a_chunk(parts):
    pool, mgr = parts
    c = ctx("r", 1)
    stored(mgr, [key(0)], c)
    (b0,) = cache(pool, [h(0)])
    assert lookup(mgr, c, [key(0)]) == [key(0)]
    spec = mgr.prepare_load([key(0)], c)
    assert spec.device_blocks == [(b0,)] and mgr.index.stats().pinned_chunks == 0
    mgr.complete_load([key(0)], c)
    assert mgr.index.stats().pinned_chunks == 0 and pool.blocks[b0].ref_cnt == 0


def test_pins_not_taken_by_a_load_are_released(parts):
    pool, mgr = parts
    b = cache(pool, [h(0), h(1)])
    c = ctx("r", 2)
    lookup(mgr, c, [key(0), key(1)])
    assert [pool.blocks[x].ref_cnt for x in b] == [1, 1]
    mgr.prepare_load([key(0)], c)  # vLLM accepted one chunk only
    mgr.device.settle("r")
    assert [pool.blocks[x].ref_cnt for x in b] == [1, 0]
    mgr.complete_load([key(0)], c)
    # a lookup without hits, a finished request, a reset: no reference survives them
    lookup(mgr, ctx("s", 1), [key(5)])
    lookup(mgr, c, [key(0), key(1)])
    mgr.on_request_finished(c)
    assert mgr.device.pinned_blocks == 0
    lookup(mgr, c, [key(0), key(1)])
    mgr.reset_cache()
    assert mgr.device.pinned_blocks == 0 and all(pool.blocks[x].ref_cnt == 0 for x in b)


def test_a_lookup_that_was_not_allocated_is_retried_once_without_device_sources(parts):
    """Pins shrink vLLM's free blocks; a request it could not allocate must not keep them."""
    pool, mgr = parts
    cache(pool, [h(0)])
    c = ctx("r", 1)
    assert lookup(mgr, c, [key(0)]) == [key(0)]  # ... and vLLM found no room: no prepare_load
    assert lookup(mgr, c, [key(0)]) == []  # the retry holds no pin
    assert mgr.device.pinned_blocks == 0
    assert lookup(mgr, c, [key(0)]) == [key(0)]  # the next one may use the device again


def test_a_failed_device_load_is_not_sourced_from_the_device_again(parts):
    pool, mgr = parts
    cache(pool, [h(0)])
    c = ctx("r", 1)
    lookup(mgr, c, [key(0)])
    mgr.prepare_load([key(0)], c)
    mgr.forget_chunks([key(0)])  # the load failed (hooks)
    mgr.complete_load([key(0)], c)
    assert lookup(mgr, ctx("s", 1), [key(0)]) == []


def test_chunks_of_several_blocks_need_every_block_on_the_device():
    pool = BlockPool(32, enable_caching=True, hash_block_size=TPB)
    mgr = HostTierManager(8, 4096, blocks_per_chunk=2, tokens_per_block=TPB)
    mgr.bind_device(DeviceSource(pool, 0, 2, TPB))
    hashes = [h(i) for i in range(4)]  # chunk 0: blocks 0-1 (key 1), chunk 1: blocks 2-3 (key 3)
    c = ctx("r", 2, k=2)
    b = cache(pool, [h(0), h(1), h(3)])  # block 2 is gone: chunk 1 is not on the device
    assert lookup(mgr, c, [key(1), key(3)], hashes) == [key(1)]
    spec = mgr.prepare_load([key(1)], c)
    assert spec.device_blocks == [(b[0], b[1])]
    mgr.complete_load([key(1)], c)
    assert mgr.device.pinned_blocks == 0


def test_the_load_decision_counts_device_chunks(parts):
    pool, mgr = parts
    mgr.costs.mode = "auto"
    cache(pool, [h(0), h(1)])
    c = ctx("r", 2)
    assert lookup(mgr, c, [key(0), key(1)]) == [key(0), key(1)]
    mgr.on_schedule_end(types.SimpleNamespace(new_req_ids=["r"]))
    assert sum(n for (action, _, tier), n in mgr.decision_tokens.items() if tier == "hbm") == 2 * TPB


# ---- worker: engine block -> engine block --------------------------------------------

NUM_BLOCKS, NUM_SLOTS = 32, 8


@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_worker_copies_device_chunks_after_the_forward_and_counts_them(strategy):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, 2048), dtype=torch.int8, generator=g) for _ in range(2)]
    eng = HostTransferEngine(tensors, [2048, 2048], [(0, 1)], NUM_SLOTS, 2, strategy=strategy,
                             tokens_per_block=[TPB])
    before = [t.clone() for t in tensors]
    # store blocks 4,5 into slot 3: chunk 0 of the load comes from the host
    eng.submit_store(1, types.SimpleNamespace(block_ids=np.array([4, 5]), group_sizes=[2], block_indices=[0]),
                     types.SimpleNamespace(block_ids=np.array([3])))
    eng.get_finished()
    # chunk 0 <- slot 3, chunk 1 <- device blocks 10, 11; destination blocks 20-23
    src = types.SimpleNamespace(block_ids=np.array([3, -1]), device_blocks=[None, (10, 11)])
    dst = types.SimpleNamespace(block_ids=np.array([20, 21, 22, 23]), group_sizes=[4], block_indices=[0])
    eng.submit_load(2, src, dst)
    assert all(torch.equal(t[22], b[22]) for t, b in zip(tensors, before))  # nothing before the forward
    done = eng.get_finished()
    assert [r.job_id for r in done] == [2] and done[0].ok
    for t, b in zip(tensors, before):
        assert torch.equal(t[20], b[4]) and torch.equal(t[21], b[5])
        assert torch.equal(t[22], b[10]) and torch.equal(t[23], b[11])
    assert eng.hits["hbm"] == [1, 2 * TPB] and eng.hits["cpu"] == [1, 2 * TPB]
    # vLLM's transfer metrics count bytes over the bus only
    assert eng.stats.loaded_bytes == 2 * 2 * 2048 and eng.stats.device_copied_bytes == 2 * 2 * 2048
    assert eng.take_load_errors() == (set(), set())


def test_a_malformed_device_source_fails_the_job_not_the_engine():
    tensors = [torch.zeros((NUM_BLOCKS, 1024), dtype=torch.int8)]
    eng = HostTransferEngine(tensors, [1024], [(0,)], NUM_SLOTS, 1, strategy="direct")
    src = types.SimpleNamespace(block_ids=np.array([-1]), device_blocks=[(NUM_BLOCKS + 5,)])
    dst = types.SimpleNamespace(block_ids=np.array([7]), group_sizes=[1], block_indices=[0])
    eng.submit_load(9, src, dst)
    assert [r.job_id for r in eng.get_finished()] == [9]
    assert eng.take_load_errors() == ({7}, {9})


def test_the_first_chunk_after_vllms_own_hit_is_left_to_vllm(parts):
    """There vLLM capped its hit on purpose (a prompt's last token is recomputed)."""
    pool, mgr = parts
    cache(pool, [h(0), h(1)])
    c = ctx("r", 2)
    mgr.device.begin("r", [], num_computed_tokens=TPB)  # vLLM holds chunk 0 and stopped before chunk 1
    assert mgr.lookup(key(1), c) is LookupResult.MISS
    mgr.device.end("r", 0)
    assert mgr.device.pinned_blocks == 0
