"""DP attention in the transfer programs: the cache's block dimension split over attention-DP ranks.

tpu-inference shards every KV cache over ``ATTN_DATA`` on its block
dimension (``kv_cache_manager``): rank r's devices hold global blocks
[r * n, (r + 1) * n). A chunk stored from one rank's range must load into
another's, bit-exact, and the host tier must hold each block once (a slice
per device), not once per rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.layout import KVLayout

LAYERS, BLOCKS = 2, 16  # 8 blocks per rank at DP 2


def _caches(mesh, shape, spec, dtype, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        bits = rng.integers(0, 256, size=BLOCKS * int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
        x = bits.view(dtype).reshape(BLOCKS, *shape)
        if np.issubdtype(np.dtype(dtype), np.floating) or dtype == jnp.bfloat16:
            x = np.where(np.isnan(x.astype(np.float32)), np.zeros_like(x), x)
        out.append(jax.device_put(x, NamedSharding(mesh, spec)))
    return out


def _bits(a):
    x = np.asarray(a)
    return x.view(f"uint{8 * x.dtype.itemsize}")


CASES = {
    # DeepSeek's latent cache (32-token packing): blocks over attn_dp, a whole copy on every "model" device
    "mla_fp8": ((1, 32, 128), P("attn_dp", None), jnp.float8_e4m3fn),
    "mla_bf16": ((1, 32, 128), P("attn_dp", None), jnp.bfloat16),
    # a latent cache whose first (untiled) dim takes the slices: the DMA kernel writes each rank's part
    "mla_major": ((4, 16, 128), P("attn_dp", None), jnp.bfloat16),
    # a dense model under DP attention: heads over "model"
    "dense": ((16, 4, 64), P("attn_dp", None, "model", None), jnp.bfloat16),
}


MESHES = {"dp2": ((2, 2), ("attn_dp", "model")), "dp4": ((4, 1), ("attn_dp", "model"))}


@pytest.mark.parametrize("path", ["program", "device_put"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_cross_ranks_bit_exact(case, path):
    mesh = make_mesh("auto", shape=(2, 2), names=("attn_dp", "model"))
    shape, spec, dtype = CASES[case]
    caches = _caches(mesh, shape, spec, dtype, seed=3)
    layout = KVLayout.from_caches(caches)
    (g,) = layout.groups
    assert g.block_axes == ("attn_dp",)
    one_copy = int(np.prod(shape)) * np.dtype(dtype).itemsize * LAYERS
    assert layout.block_bytes == one_copy  # not one copy per rank or per device
    assert layout.device_block_bytes() * 4 == one_copy
    eng = TransferEngine(layout, num_slots=6, blocks_per_chunk=2, staging_blocks=4, path=path)
    ref = [_bits(c) for c in caches]
    # rank 0's blocks 1, 2; rank 1's 9, 14; one chunk straddling both ranks' ranges
    eng.store(caches, [StoreChunk(0, [1, 2]), StoreChunk(3, [9, 14]), StoreChunk(5, [7, 8])]).block_until_ready()
    eng.complete_store([0, 3, 5], True)
    # rank 0's chunk into rank 1's range, rank 1's into rank 0's, the straddler swapped
    caches, done = eng.load(caches, [LoadChunk(0, [12, 13]), LoadChunk(3, [4, -1]), LoadChunk(5, [15, 0])])
    done.block_until_ready()
    got = [_bits(c) for c in caches]
    moved = {12: 1, 13: 2, 4: 9, 15: 7, 0: 8}
    for layer in range(LAYERS):
        for dst in range(BLOCKS):
            want = ref[layer][moved.get(dst, dst)]
            assert np.array_equal(got[layer][dst], want), (layer, dst)
    for c in caches:
        assert c.sharding.spec == spec


def test_slab_holds_one_slice_per_device():
    mesh = make_mesh("auto", shape=(2, 2), names=("attn_dp", "model"))
    shape, spec, dtype = CASES["mla_fp8"]
    eng = TransferEngine(KVLayout.from_caches(_caches(mesh, shape, spec, dtype, 0)), num_slots=4,
                         blocks_per_chunk=1, staging_blocks=2)
    (slab,) = eng.slabs[0]
    assert slab.shape == (4, 1, LAYERS, 1, 32, 128)
    assert {tuple(s.data.shape) for s in slab.addressable_shards} == {(4, 1, LAYERS, 1, 8, 128)}


@pytest.mark.parametrize("path", ["program", "device_put"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dp", sorted(MESHES))
def test_dma_kernel_under_dp_bit_exact(dp, case, path):
    """The DMA kernel (TPU interpret mode) under DP attention: each rank's devices DMA its own blocks
    (local ids) into its share of staging, one all-to-all per pass spreads the slices. Chunks of every
    rank cross into other ranks' ranges, a rank with more chunks than its share of staging takes two
    passes, and the DMA counter counts each rank's coalesced runs. At DP 4 one device per rank
    (DeepSeek-V3 at DP 8's shape: no copy within a rank); at DP 2 the latent cache has 2 copies per rank."""
    shape, names = MESHES[dp]
    mesh = make_mesh("auto", shape=shape, names=names)
    ranks = shape[0]
    per_rank = BLOCKS // ranks
    bshape, spec, dtype = CASES[case]
    if bshape[2] % shape[1] and spec[2:3] == ("model",):
        pytest.skip("heads do not divide")
    caches = _caches(mesh, bshape, spec, dtype, seed=5)
    layout = KVLayout.from_caches(caches)
    (g,) = layout.groups
    assert g.ranks == ranks and g.block_axes == ("attn_dp",)
    eng = TransferEngine(layout, num_slots=8, blocks_per_chunk=2, staging_blocks=2 * ranks, path=path, kernel="dma")
    assert eng.programs.kernel == "dma"
    ref = [_bits(c) for c in caches]
    last = BLOCKS - 2  # the last rank's last two blocks
    # rank 0: two chunks (two passes with a 1-chunk share); the last rank: one adjacent chunk
    stores = [StoreChunk(0, [1, 2]), StoreChunk(1, [3, 0]), StoreChunk(2, [last, last + 1])]
    eng.store(caches, stores).block_until_ready()
    parts = ranks if g.split_dim < len(g.block_shape) - 2 else 1  # a DMA per rank's part of an untiled slice
    assert eng.dmas["gather"] == (1 + 2 + 1) * LAYERS * parts  # (1, 2) is a run; (3, 0) is not; (14, 15) is
    eng.complete_store([0, 1, 2], True)
    # rank 0's chunks into the last rank's range and back into rank 0's, the last rank's into rank 0's
    loads = [LoadChunk(0, [last - 2, last - 1]), LoadChunk(1, [5, -1]), LoadChunk(2, [6, 7])]
    caches, done = eng.load(caches, loads)
    done.block_until_ready()
    got = [_bits(c) for c in caches]
    moved = {last - 2: 1, last - 1: 2, 5: 3, 6: last, 7: last + 1}
    for layer in range(LAYERS):
        for dst in range(BLOCKS):
            assert np.array_equal(got[layer][dst], ref[layer][moved.get(dst, dst)]), (layer, dst)
    compiled = eng.programs.compiles
    assert compiled == len(eng.programs.all_programs(path))  # one program each, for two passes of any size
    for c in caches:
        assert c.sharding.spec == spec


def test_dma_kernel_under_dp_refuses_a_chunk_across_ranks():
    """A chunk belongs to one request, on one rank; the DMA kernel stages it on that rank's devices."""
    mesh = make_mesh("auto", shape=(2, 2), names=("attn_dp", "model"))
    shape, spec, dtype = CASES["dense"]
    caches = _caches(mesh, shape, spec, dtype, seed=1)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=2, staging_blocks=4,
                         kernel="dma")
    with pytest.raises(ValueError, match="attention-DP rank 1"):
        eng.store(caches, [StoreChunk(0, [7, 8])])
