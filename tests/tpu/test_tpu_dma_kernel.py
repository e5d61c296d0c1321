"""The gather/scatter DMA kernel (jax_backend/dma.py), run on CPU in TPU interpret mode.

The same kernel source the TPU compiler compiles (tests/tpu_compiler) runs
here with DMAs and semaphores emulated, on emulated CPU meshes at TP 1, 2
and 8, and must move every block bit for bit like a numpy reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from test_tpu_mla import latent_caches
from test_tpu_roundtrip import bits, make_caches, replicated_caches
from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.dma import coalesce, run_operands

pytestmark = pytest.mark.jax
LAYERS = 3


def tp_mesh(tp: int):
    return make_mesh("auto", (1, tp))


def round_trip(caches, layout, path, src, dst, *, bpc, staging, slots=None):
    """Store chunks of ``src`` blocks, load them into ``dst`` blocks; the engine and new caches."""
    n = len(src)
    slots = list(range(n)) if slots is None else slots
    eng = TransferEngine(layout, num_slots=max(slots) + 1, blocks_per_chunk=bpc, staging_blocks=staging, path=path,
                         kernel="dma")
    assert eng.programs.kernel == "dma"
    eng.store(caches, [StoreChunk(s, b) for s, b in zip(slots, src)]).block_until_ready()
    eng.complete_store(slots, True)
    caches, done = eng.load(caches, [LoadChunk(s, b) for s, b in zip(slots, dst)])
    done.block_until_ready()
    return eng, caches


def check(ref, caches, src, dst):
    got = [bits(c) for c in caches]
    moved = {d: s for sb, db in zip(src, dst) for s, d in zip(sb, db) if d >= 0}
    for layer in range(len(ref)):
        expect = ref[layer].copy()
        for d, s in moved.items():
            expect[d] = ref[layer][s]
        assert np.array_equal(got[layer], expect), layer  # moved blocks and every other block


def test_coalesce_runs():
    assert coalesce([], []).shape == (0, 3)
    assert coalesce([5, 6, 7, 9, 2, 3], [0, 1, 2, 3, 4, 5]).tolist() == [[5, 0, 3], [9, 3, 1], [2, 4, 2]]
    assert coalesce([1, 2, 3], [4, 6, 7]).tolist() == [[1, 4, 1], [2, 6, 2]]  # both sides must follow
    assert coalesce([3, 2], [0, 1]).tolist() == [[3, 0, 1], [2, 1, 1]]  # descending is not a run
    ops = run_operands(coalesce([5, 6, 9], [0, 1, 2]), 4)
    assert [o.tolist() for o in ops] == [[2], [5, 9, 0, 0], [0, 2, 0, 0], [2, 1, 0, 0]]
    with pytest.raises(ValueError, match="3 runs exceed the kernel's capacity of 2"):
        run_operands(coalesce([1, 3, 5], [0, 1, 2]), 2)


@pytest.mark.parametrize("path", ["program", "device_put"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_round_trip_bit_exact(tp, dtype, path):
    """Chunks of adjacent and scattered blocks, more than staging holds (two passes), a partial load."""
    mesh = tp_mesh(tp)
    caches = make_caches(mesh, dtype, seed=tp, layers=LAYERS)
    ref = [bits(c) for c in caches]
    src = [[3, 4], [5, 6], [10, 2], [30, 31], [7, 8]]
    dst = [[20, 21], [22, 23], [24, 25], [-1, 27], [36, 37]]
    eng, caches = round_trip(caches, KVLayout.from_caches(caches), path, src, dst, bpc=2, staging=8)
    check(ref, caches, src, dst)
    assert eng.dmas["gather"] > 0 and eng.dmas["scatter"] > 0


@pytest.mark.parametrize("tp,kv_heads", [(2, 1), (8, 2), (8, 4)])
@pytest.mark.parametrize("path", ["program", "device_put"])
def test_replicated_heads_bit_exact(tp, kv_heads, path):
    mesh = tp_mesh(tp)
    caches = replicated_caches(mesh, jnp.bfloat16, kv_heads, any_bits=True)  # NaN payloads too
    ref = [bits(c) for c in caches]
    layout = KVLayout.from_caches(caches, head_replicas=tp // kv_heads)
    src, dst = [[1, 2], [9, 4], [30, 31]], [[20, 21], [11, 12], [13, 14]]
    eng, caches = round_trip(caches, layout, path, src, dst, bpc=2, staging=4)
    check(ref, caches, src, dst)


@pytest.mark.parametrize("tp,rows", [(2, 1), (8, 1), (8, 8)])
def test_mla_latent_copies_bit_exact(tp, rows):
    mesh = tp_mesh(tp)
    caches = latent_caches(mesh, rows)
    ref = [bits(c) for c in caches]
    src, dst = [[3, 7], [0, 11], [5, 6]], [[20, 21], [-1, 22], [23, 19]]
    _, caches = round_trip(caches, KVLayout.from_caches(caches), "program", src, dst, bpc=2, staging=4)
    check(ref, caches, src, dst)
    for c in caches:  # every device's copy is the same whole latent cache
        shards = [np.asarray(s.data).view(np.uint16) for s in c.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)


def test_dma_counter_counts_coalesced_runs():
    """One DMA per (layer, run of blocks adjacent in both the cache and staging); a replicated
    group's scatter one per replica slice."""
    mesh = tp_mesh(8)
    caches = make_caches(mesh, jnp.bfloat16, layers=LAYERS)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=2, staging_blocks=8, kernel="dma")
    eng.store(caches, [StoreChunk(0, [3, 4]), StoreChunk(1, [5, 6]), StoreChunk(2, [10, 2])]).block_until_ready()
    assert eng.last_dmas["gather"] == 3 * LAYERS  # runs 3..6, 10, 2
    eng.complete_store([0, 1, 2], True)
    caches, done = eng.load(caches, [LoadChunk(2, [20, 21]), LoadChunk(0, [22, 23]), LoadChunk(1, [-1, 30])])
    done.block_until_ready()
    assert eng.last_dmas["scatter"] == 2 * LAYERS  # runs 20..23 (staging 0..3), 30 (staging 5)
    assert eng.dmas == {"gather": 3 * LAYERS, "scatter": 2 * LAYERS}

    rep = replicated_caches(mesh, jnp.bfloat16, 2)
    eng = TransferEngine(KVLayout.from_caches(rep, head_replicas=4), num_slots=4, blocks_per_chunk=1,
                         staging_blocks=4, kernel="dma")
    eng.store(rep, [StoreChunk(0, [1]), StoreChunk(1, [2])]).block_until_ready()
    eng.complete_store([0, 1], True)
    assert eng.last_dmas["gather"] == LAYERS
    rep, done = eng.load(rep, [LoadChunk(0, [7]), LoadChunk(1, [8])])
    done.block_until_ready()
    assert eng.last_dmas["scatter"] == 4 * LAYERS  # one run, 4 replica slices


def test_replicas_rebuilt_once_per_pass():
    """The scatter's ring of collective-permutes runs on the whole staging buffer, replicas - 1
    of them per pass (not per block: the ids are runtime data, so a per-block ring would sit in a
    loop); the gather has none."""
    mesh = tp_mesh(8)
    rep = replicated_caches(mesh, jnp.bfloat16, 2)
    eng = TransferEngine(KVLayout.from_caches(rep, head_replicas=4), num_slots=4, blocks_per_chunk=1,
                         staging_blocks=4, kernel="dma")
    hlo = eng.programs.scatter().as_text()
    permutes = [line for line in hlo.splitlines() if "collective-permute(" in line or "collective-permute-start(" in line]
    assert len(permutes) == 3, permutes
    g = eng.programs.layout.groups[0]
    staging = "[" + ",".join(map(str, (4, LAYERS, *g.piece_shape))) + "]"  # one device's whole staging buffer
    assert g.piece_shape[0] == 16 // 4 and all(staging in line for line in permutes), permutes
    assert "collective-permute" not in eng.programs.gather().as_text()


def test_kernel_setting():
    assert OffloadConfig().transfer_kernel == "auto"
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_TRANSFER_KERNEL": "dma"}).transfer_kernel == "dma"
    with pytest.raises(ConfigError, match="'transfer_kernel': value 'pallas' is not allowed"):
        OffloadConfig.from_sources({"transfer_kernel": "pallas"}, env={})
    mesh = tp_mesh(2)
    caches = make_caches(mesh, jnp.float32, layers=1)
    assert TransferEngine(KVLayout.from_caches(caches), num_slots=2, blocks_per_chunk=1,
                          staging_blocks=2).programs.kernel == "loop"  # CPU default: interpret mode is slow
    with pytest.raises(ValueError, match="transfer kernel 'x'"):
        TransferEngine(KVLayout.from_caches(caches), num_slots=2, blocks_per_chunk=1, staging_blocks=2, kernel="x")
