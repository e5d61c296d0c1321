"""CUDA path of the transfer engine: pinned slab, streams, events. Skipped without CUDA.

These check what the CPU tests cannot: asynchronous completion through
``event.query()``, ``wait()``, ordering after the compute stream, and the
expedited-load lane.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from gpu_offload.torch_backend.engine import HostTransferEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_BLOCKS, PAGE, LAYERS = 256, 64 << 10, 4


def spec(blocks, first=0):
    return types.SimpleNamespace(block_ids=np.asarray(blocks, np.int32), group_sizes=[len(blocks)],
                                 block_indices=[first])


def slots(s):
    return types.SimpleNamespace(block_ids=np.asarray(s, np.int32))


def poll(engine, job_ids, timeout=30.0):
    got, deadline = set(), time.monotonic() + timeout
    while got != set(job_ids):
        assert time.monotonic() < deadline, "transfer never completed"
        got |= {r.job_id for r in engine.get_finished()}
    return got


@pytest.mark.parametrize("k", [1, 4])
def test_cuda_round_trip_is_bit_exact_and_asynchronous(k):
    dev = torch.device("cuda")
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, device=dev) for _ in range(LAYERS)]
    w = HostTransferEngine(tensors, [PAGE] * LAYERS, [tuple(range(LAYERS))], 64, k, staging_blocks=16)
    assert w.strategy == "staged" and w._registered, "slab should be pinned with cudaHostRegister"
    rng = np.random.default_rng(0)
    perm = rng.permutation(NUM_BLOCKS)
    n = 10 * k + (k - 1)  # ragged last chunk when k > 1
    src, dst = perm[:n], perm[n : 2 * n]
    host = rng.permutation(64)[: -(-n // k)]
    want = [t[torch.as_tensor(src, device=dev)].clone() for t in tensors]

    w.submit_store(1, spec(src), slots(host))
    poll(w, {1})
    w.submit_load(2, slots(host), spec(dst))
    w.wait({2})
    poll(w, {2})
    for t, x in zip(tensors, want):
        assert torch.equal(t[torch.as_tensor(dst, device=dev)], x)
    assert w.take_load_error_blocks() == set()
    w.shutdown()


def test_an_unpinned_slab_still_round_trips_and_says_so(monkeypatch):
    """cudaHostRegister failing (here: refused by a stand-in runtime) leaves the slab pageable: the engine
    reports pinned=False (the worker's tpu_offload_host_tier_pinned gauge) and its copies stay bit-exact."""
    from gpu_offload.torch_backend import cuda_rt

    dev = torch.device("cuda")
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, device=dev) for _ in range(LAYERS)]
    pinned = HostTransferEngine(tensors, [PAGE] * LAYERS, [tuple(range(LAYERS))], 16, 1)
    assert pinned.pinned is True
    pinned.shutdown()
    real = cuda_rt.runtime()

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def host_register(self, ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(cuda_rt, "runtime", lambda: Refusing())
    w = HostTransferEngine(tensors, [PAGE] * LAYERS, [tuple(range(LAYERS))], 16, 1)
    assert w.pinned is False and not w._registered
    want = [t[torch.as_tensor([5, 6], device=dev)].clone() for t in tensors]
    w.submit_store(1, spec([5, 6]), slots([0, 1]))
    poll(w, {1})
    w.submit_load(2, slots([0, 1]), spec([40, 41]))
    poll(w, {2})
    for t, x in zip(tensors, want):
        assert torch.equal(t[torch.as_tensor([40, 41], device=dev)], x)
    w.shutdown()


def test_store_sees_kv_written_on_the_compute_stream_and_expedited_loads_work():
    dev = torch.device("cuda")
    tensors = [torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8, device=dev)]
    w = HostTransferEngine(tensors, [PAGE], [(0,)], 8, 1)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy ...
    tensors[0][3].fill_(7)  # ... so this write lands late; the store must wait for it
    w.submit_store(1, spec([3]), slots([0]))
    poll(w, {1})
    assert (w.pool.slab[0, :PAGE] == 7).all()
    w.submit_load(2, slots([0]), spec([9]), expedited=True)
    w.wait({2})
    poll(w, {2})
    assert torch.equal(tensors[0][9], tensors[0][3])
    w.shutdown()


def test_many_stores_in_one_step_never_wait_on_index_uploads():
    """Six store jobs queued behind a busy compute stream: the upload pool grows
    instead of synchronizing, and every job still lands bit-exact."""
    dev = torch.device("cuda")
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, device=dev)]
    w = HostTransferEngine(tensors, [PAGE], [(0,)], 64, 1)
    torch.cuda._sleep(200_000_000)  # keeps the lane stream's copies (and uploads) queued
    for j in range(6):
        w.submit_store(j, spec([4 * j, 4 * j + 1]), slots([2 * j, 2 * j + 1]))
    assert w._store_lane._ring.pool.grown >= 2  # 4 buffers, 6 uploads in flight
    poll(w, set(range(6)))
    for j in range(6):
        for i in range(2):
            assert np.array_equal(w.pool.slab[2 * j + i, :PAGE], tensors[0][4 * j + i].cpu().numpy().view(np.uint8))
    w.shutdown()


def test_both_directions_at_once_through_many_staging_halves():
    """60-block store and load in flight together, each through an 8-slot staging buffer (4-slot halves:
    15 pieces per job, the copy stream and the lane stream taking turns), behind a busy compute stream."""
    dev = torch.device("cuda")
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, device=dev) for _ in range(LAYERS)]
    w = HostTransferEngine(tensors, [PAGE] * LAYERS, [tuple(range(LAYERS))], 128, 1, staging_blocks=8)
    a, b, c = np.arange(0, 60), np.arange(60, 120), np.arange(120, 180)
    w.submit_store(1, spec(a), slots(range(60)))
    poll(w, {1})
    want_a = [t[torch.as_tensor(a, device=dev)].clone() for t in tensors]
    torch.cuda._sleep(50_000_000)
    w.submit_store(2, spec(b), slots(range(60, 120)))
    w.submit_load(3, slots(range(60)), spec(c))
    poll(w, {2, 3})
    for t, x in zip(tensors, want_a):
        assert torch.equal(t[torch.as_tensor(c, device=dev)], x)
    for i, blk in enumerate(b):
        for layer, t in enumerate(tensors):
            got = w.pool.slab[60 + i, layer * PAGE:(layer + 1) * PAGE]
            assert np.array_equal(got, t[int(blk)].cpu().numpy().view(np.uint8)), (i, layer)
    assert w.take_load_error_blocks() == set()
    w.shutdown()


@pytest.mark.parametrize("k,first", [(1, 0), (4, 3)])
def test_fused_gather_moves_the_same_bytes_as_the_index_gather(k, first):
    """The Triton kernel (one launch per piece) against the per-tensor gathers, both directions: two KV
    groups, pages of 64 KiB and of 24 KiB (not a divisor of the slot row), a chunk entered mid-way, a ragged
    last chunk, 8 staging blocks (several pieces per job). Host slab and loaded blocks byte for byte."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    pages = [PAGE, PAGE, 24 << 10]
    groups = [(0, 1), (2,)]
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, device=dev) for p in pages]
    rng = np.random.default_rng(k)
    perm = rng.permutation(NUM_BLOCKS)
    n0, n1 = 5 * k + 1, 3 * k
    skip = first % k
    s0, s1 = -(-(skip + n0) // k), -(-(skip + n1) // k)
    src, dst = perm[: n0 + n1], perm[n0 + n1: 2 * (n0 + n1)]
    host = rng.permutation(64)[: s0 + s1]
    gspec = types.SimpleNamespace(block_ids=np.asarray(src, np.int32), group_sizes=[n0, n1],
                                  block_indices=[first, first])
    lspec = types.SimpleNamespace(block_ids=np.asarray(dst, np.int32), group_sizes=[n0, n1],
                                  block_indices=[first, first])
    out = {}
    for gather in ("index", "fused"):
        for t in tensors:
            t[torch.as_tensor(dst, device=dev)] = 0
        w = HostTransferEngine(tensors, pages, groups, 64, k, staging_blocks=8, zero_pool=True, gather=gather)
        assert w.gather_used == gather
        w.submit_store(1, gspec, slots(host))
        poll(w, {1})
        w.submit_load(2, slots(host), lspec)
        poll(w, {2})
        assert w.take_load_error_blocks() == set()
        out[gather] = (w.pool.slab.copy(), [t[torch.as_tensor(dst, device=dev)].cpu() for t in tensors])
        w.shutdown()
    assert np.array_equal(out["fused"][0], out["index"][0])
    for i, (a, b, t) in enumerate(zip(out["fused"][1], out["index"][1], tensors)):
        assert torch.equal(a, b)
        mine = slice(0, n0) if i in groups[0] else slice(n0, n0 + n1)  # pages of the group holding tensor i
        assert torch.equal(a[mine], t[torch.as_tensor(src[mine], device=dev)].cpu())
