"""Bit-exact round trips of the transfer engine (no vLLM engine needed).

Engine KV tensors of several dtypes are viewed as int8 pages, stored into
host slots, clobbered, and loaded back; the host slab is also checked
against the documented slot layout. Both copy strategies run on CPU: the
"staged" one is the code path CUDA uses (minus streams).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from gpu_offload import testing
from gpu_offload.torch_backend.engine import HostTransferEngine

NUM_BLOCKS = 64
NUM_SLOTS = 24
TOKENS, HEADS, HEAD_DIM = 16, 2, 64


def kv_tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(num_blocks, 2, tokens, heads, head_dim) in ``dtype``, random bits-exact content."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def pages(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8).view(NUM_BLOCKS, -1)


def gpu_spec(blocks, block_index=0, groups=None):
    blocks = np.asarray(blocks, dtype=np.int32)
    if groups is None:
        return types.SimpleNamespace(block_ids=blocks, group_sizes=[len(blocks)], block_indices=[block_index])
    sizes, firsts = zip(*groups)
    return types.SimpleNamespace(block_ids=blocks, group_sizes=list(sizes), block_indices=list(firsts))


def host_spec(slots):
    return types.SimpleNamespace(block_ids=np.asarray(slots, dtype=np.int32))


def make_engine(tensors, k, strategy, staging_blocks=128, groups=None):
    page_bytes = [pages(t).shape[1] for t in tensors]
    groups = groups or [tuple(range(len(tensors)))]
    return HostTransferEngine([pages(t) for t in tensors], page_bytes, groups, NUM_SLOTS, k,
                              strategy=strategy, staging_blocks=staging_blocks)


def slots_for(n_blocks, k, skip=0, start=3):
    n = -(-(skip + n_blocks) // k)
    return [(start + 5 * i) % NUM_SLOTS for i in range(n)]  # scattered, non-consecutive


def check_slab(worker, tensors, blocks, slots, k, skip=0):
    """Page i of the transfer sits at slot (skip+i)//k, sub (skip+i)%k, per tensor region."""
    lay = worker.layout
    for i, b in enumerate(blocks):
        slot, sub = slots[(skip + i) // k], (skip + i) % k
        for t, x in enumerate(tensors):
            a, e = lay.tensor_span(t, sub, sub + 1)
            got = worker.pool.slab[slot, a:e]
            assert np.array_equal(got, pages(x)[b].numpy().view(np.uint8)), (i, t)


STRATEGIES = ["direct", "staged"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("n_blocks", [1, 7, 16])
def test_round_trip_bit_exact(strategy, k, dtype, n_blocks):
    tensors = [kv_tensor(dtype, seed) for seed in range(3)]  # 3 layers
    originals = [t.clone() for t in tensors]
    w = make_engine(tensors, k, strategy, staging_blocks=8)  # staged: several pieces
    blocks = list(np.random.default_rng(n_blocks).permutation(NUM_BLOCKS)[:n_blocks])
    slots = slots_for(n_blocks, k)  # n_blocks=7 with k=2/4: ragged last chunk

    w.submit_store(1, gpu_spec(blocks), host_spec(slots))
    (res,) = w.get_finished()
    assert res.ok and res.nbytes == n_blocks * 3 * pages(tensors[0]).shape[1]
    check_slab(w, tensors, blocks, slots, k)
    assert w.pool.valid[slots].all()

    for t in tensors:
        t[blocks] = 0
    w.submit_load(2, host_spec(slots), gpu_spec(blocks))
    (res,) = w.get_finished()
    assert res.ok and res.nbytes == n_blocks * 3 * pages(tensors[0]).shape[1]
    for t, o in zip(tensors, originals):
        assert torch.equal(pages(t), pages(o))
    assert w.take_load_error_blocks() == set()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("k", [2, 4])
def test_load_starting_inside_a_chunk(strategy, k):
    """block_indices not chunk-aligned: the leading sub-blocks of the first chunk are skipped."""
    tensors = [kv_tensor(torch.float16, s) for s in range(2)]
    w = make_engine(tensors, k, strategy)
    blocks = list(range(10, 10 + 3 * k))  # three whole chunks
    slots = slots_for(len(blocks), k)
    w.submit_store(1, gpu_spec(blocks), host_spec(slots))
    w.get_finished()

    skip = k - 1  # resume at logical block k-1 of the request
    want = blocks[skip:]
    dst = [40 + i for i in range(len(want))]
    w.submit_load(2, host_spec(slots), gpu_spec(dst, block_index=skip))
    (res,) = w.get_finished()
    assert res.ok
    for t in tensors:
        assert torch.equal(pages(t)[dst], pages(t)[want])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_partial_store_leaves_other_sub_blocks_alone(strategy):
    k = 4
    tensors = [kv_tensor(torch.float32, s) for s in range(2)]
    w = make_engine(tensors, k, strategy)
    w.submit_store(1, gpu_spec([0, 1, 2, 3]), host_spec([5]))
    w.get_finished()
    before = w.pool.slab[5].copy()
    # a store entering the chunk at sub 2 (block_indices=2) writes subs 2..3 only
    w.submit_store(2, gpu_spec([20, 21], block_index=2), host_spec([5]))
    w.get_finished()
    lay = w.layout
    for t in range(2):
        a, e = lay.tensor_span(t, 0, 2)
        assert np.array_equal(w.pool.slab[5, a:e], before[a:e])
    check_slab(w, tensors, [20, 21], [5], k, skip=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_kv_groups_use_their_own_tensors(strategy):
    """Hybrid layout: group 0 lives in tensors 0-1, group 1 in tensor 2."""
    k = 2
    tensors = [kv_tensor(torch.bfloat16, s) for s in range(3)]
    originals = [t.clone() for t in tensors]
    w = make_engine(tensors, k, strategy, groups=[(0, 1), (2,)])
    g0, g1 = [3, 4, 5, 6], [30, 31, 32]
    slots = slots_for(4, k) + slots_for(3, k, start=11)
    spec = gpu_spec(g0 + g1, groups=[(4, 0), (3, 0)])
    w.submit_store(1, spec, host_spec(slots))
    (res,) = w.get_finished()
    assert res.nbytes == (4 * 2 + 3 * 1) * pages(tensors[0]).shape[1]
    tensors[0][g0] = 0
    tensors[1][g0] = 0
    tensors[2][g1] = 0
    w.submit_load(2, host_spec(slots), spec)
    w.get_finished()
    for t, o in zip(tensors, originals):
        assert torch.equal(pages(t), pages(o))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_row_stride_not_a_multiple_of_the_page(strategy):
    """Mixed page sizes (e.g. an MLA-like 1152 B page): the 3-D fallback views."""
    k = 2
    a = torch.randint(-128, 128, (NUM_BLOCKS, 4096), dtype=torch.int8)
    b = torch.randint(-128, 128, (NUM_BLOCKS, 1152), dtype=torch.int8)
    oa, ob = a.clone(), b.clone()
    w = HostTransferEngine([a, b], [4096, 1152], [(0, 1)], NUM_SLOTS, k, strategy=strategy, staging_blocks=2)
    assert w.pool.stride % 1152 != 0
    blocks, slots = [9, 2, 33, 34, 35], slots_for(5, k)
    w.submit_store(1, gpu_spec(blocks), host_spec(slots))
    w.get_finished()
    a[blocks] = 0
    b[blocks] = 0
    w.submit_load(2, host_spec(slots), gpu_spec(blocks))
    w.get_finished()
    assert torch.equal(a, oa) and torch.equal(b, ob)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_from_an_invalid_slot_is_a_load_error(strategy):
    k = 2
    tensors = [kv_tensor(torch.float32, 0)]
    w = make_engine(tensors, k, strategy)
    blocks, slots = [1, 2, 3, 4], [6, 7]
    w.submit_store(1, gpu_spec(blocks), host_spec(slots))
    w.get_finished()
    w.pool.valid[7] = False  # as if the write into slot 7 had failed
    expect_ok = pages(tensors[0])[[1, 2]].clone()
    tensors[0][[1, 2, 3, 4]] = 0
    w.submit_load(2, host_spec(slots), gpu_spec(blocks))
    (res,) = w.get_finished()
    assert res.ok  # the job ran; its invalid pages are load errors
    assert w.take_load_error_blocks() == {3, 4}
    assert w.take_load_error_blocks() == set()  # reported once
    assert torch.equal(pages(tensors[0])[[1, 2]], expect_ok)  # the valid chunk still loaded
    assert w.stats.load_error_jobs == 1 and w.stats.load_error_blocks == 2


def test_injected_failures_fail_whole_jobs_and_leave_slots_invalid():
    tensors = [kv_tensor(torch.float32, 0)]
    w = make_engine(tensors, 1, "direct")
    testing.fail_next_stores(w, 1)
    w.submit_store(1, gpu_spec([1, 2]), host_spec([0, 1]))
    (res,) = w.get_finished()
    assert not res.ok and res.nbytes is None and w.stats.store_failures == 1
    assert not w.pool.valid[[0, 1]].any()

    w.submit_store(2, gpu_spec([1, 2]), host_spec([0, 1]))
    w.get_finished()
    testing.fail_next_loads(w, 1)
    w.submit_load(3, host_spec([0, 1]), gpu_spec([5, 6]))
    (res,) = w.get_finished()
    assert not res.ok and w.take_load_error_blocks() == {5, 6}
    w.submit_load(4, host_spec([0, 1]), gpu_spec([5, 6]))  # the hook fired once only
    w.get_finished()
    assert w.take_load_error_blocks() == set()
    assert torch.equal(pages(tensors[0])[[5, 6]], pages(tensors[0])[[1, 2]])


def test_malformed_spec_is_a_failed_job_not_an_exception():
    w = make_engine([kv_tensor(torch.float32, 0)], 2, "direct")
    assert w.submit_load(1, host_spec([0]), gpu_spec([1, 2, 3])) is True  # needs 2 slots
    (res,) = w.get_finished()
    assert not res.ok and w.take_load_error_blocks() == {1, 2, 3}
    assert w.submit_store(2, gpu_spec([NUM_BLOCKS + 5]), host_spec([0])) is True  # bad block id
    w.get_finished()
    assert w.stats.store_failures == 1


def test_expedited_load_and_wait_follow_the_033_signature():
    tensors = [kv_tensor(torch.float32, 0)]
    originals = tensors[0].clone()
    w = make_engine(tensors, 1, "direct")
    w.submit_store(1, gpu_spec([4, 5]), host_spec([0, 1]))
    w.wait({1})
    assert [r.job_id for r in w.get_finished()] == [1]  # vLLM loads only completed stores
    tensors[0][[4, 5]] = 0
    w.submit_load(2, host_spec([0, 1]), gpu_spec([4, 5]), expedited=True)
    w.wait({2})
    assert [r.job_id for r in w.get_finished()] == [2]
    assert torch.equal(tensors[0], originals)
