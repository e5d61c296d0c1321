"""The JAX data path on an emulated 8-device mesh: bit-exact store -> load.

KV heads are sharded over the 'model' axis exactly like tpu-inference's
caches; the host tier must keep that sharding (each device, hence each
process, holds only its own heads).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import MESH_KINDS, make_mesh
from tpu_offload.core.config import ConfigError
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.memory import check_staging_fits

NB, BS, HEADS, DIM, LAYERS = 40, 16, 8, 32, 3

pytestmark = pytest.mark.jax


def make_caches(mesh, dtype, seed=0, layers=LAYERS, heads=HEADS):
    sh = NamedSharding(mesh, P(None, None, "model", None))
    keys = jax.random.split(jax.random.key(seed), layers)
    return [jax.device_put(jax.random.normal(k, (NB, BS, heads, DIM)).astype(dtype), sh) for k in keys]


def bits(x):
    return np.asarray(x).view(np.uint8)


class CompileCounter:
    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


COMPILES = CompileCounter()


@pytest.mark.parametrize("path", ["program", "device_put"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bpc,n_chunks,staging", [(1, 1, 4), (1, 9, 4), (2, 3, 4), (4, 5, 8), (3, 2, 7)])
def test_store_load_bit_exact(any_mesh, dtype, bpc, n_chunks, staging, path):
    """Round trips across chunk sizes and counts, including batches larger
    than the staging buffer (several passes, nothing dropped) and a staging
    size that is not a multiple of the chunk (7 blocks, 3-block chunks), on
    Auto (tpu-inference), Explicit and Manual mesh axes."""
    caches = make_caches(any_mesh, dtype)
    shardings = [c.sharding for c in caches]
    ref = [bits(c) for c in caches]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=16, blocks_per_chunk=bpc, staging_blocks=staging,
                         path=path)
    rng = np.random.default_rng(bpc * 100 + n_chunks)
    src = rng.permutation(NB // 2)[: n_chunks * bpc].reshape(n_chunks, bpc)  # sources in the lower half
    slots = rng.permutation(16)[:n_chunks]
    done = eng.store(caches, [StoreChunk(int(s), b.tolist()) for s, b in zip(slots, src)])
    done.block_until_ready()
    eng.complete_store(slots, True)
    dst = NB // 2 + rng.permutation(NB // 2)[: n_chunks * bpc].reshape(n_chunks, bpc)  # upper half
    order = rng.permutation(n_chunks)  # load in a different order than stored
    caches, done = eng.load(caches, [LoadChunk(int(slots[i]), dst[i].tolist()) for i in order])
    done.block_until_ready()
    assert [c.sharding for c in caches] == shardings  # the runner gets its own mesh and spec back
    got = [bits(c) for c in caches]
    for layer in range(LAYERS):
        for c in range(n_chunks):
            for b in range(bpc):
                assert np.array_equal(got[layer][dst[c, b]], ref[layer][src[c, b]]), (layer, c, b)
        untouched = np.setdiff1d(np.arange(NB), dst.ravel())
        assert np.array_equal(got[layer][untouched], ref[layer][untouched])


def test_ragged_tail_and_partial_chunk_load(mesh):
    """A request of 7 blocks with 3-block chunks stores 2 chunks and leaves
    the tail alone; a load that starts mid-chunk (blocks already computed
    locally) writes only the missing blocks."""
    caches = make_caches(mesh, jnp.bfloat16, seed=1)
    ref = [bits(c) for c in caches]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=3, staging_blocks=6)
    req_blocks = [5, 9, 2, 30, 31, 7, 11]  # 7 blocks: chunks (5,9,2) and (30,31,7); block 11 is the tail
    chunks = [StoreChunk(0, req_blocks[0:3]), StoreChunk(1, req_blocks[3:6])]
    eng.store(caches, chunks).block_until_ready()
    eng.complete_store([0, 1], True)
    # New blocks for the second request; its first 4 blocks are computed locally.
    new = [12, 13, 14, 15, 16, 17]
    caches, done = eng.load(caches, [LoadChunk(0, [-1, -1, -1]), LoadChunk(1, [-1, new[4], new[5]])])
    done.block_until_ready()
    got = [bits(c) for c in caches]
    for layer in range(LAYERS):
        assert np.array_equal(got[layer][16], ref[layer][31])
        assert np.array_equal(got[layer][17], ref[layer][7])
        for b in (12, 13, 14, 15, 11):
            assert np.array_equal(got[layer][b], ref[layer][b])


def test_host_tier_sharded_like_the_cache(mesh):
    """Each device's slab shard holds exactly its own head of each stored block."""
    caches = make_caches(mesh, jnp.bfloat16)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=2, staging_blocks=4)
    slab = eng.slabs[0][0]
    assert slab.sharding.memory_kind == "pinned_host"
    assert len(slab.addressable_shards) == 8
    # slab is [slots, bpc, layers, *the cache's block shape]: each device holds 1 of 8 heads, in the
    # cache's own dtype and block layout (what the TPU compiler copies without a relayout)
    assert {(s.data.shape, s.data.dtype) for s in slab.addressable_shards} == {((8, 2, LAYERS, BS, 1, DIM), np.dtype(jnp.bfloat16))}
    assert {s.data.shape for s in eng.staging[0].addressable_shards} == {(4, LAYERS, BS, 1, DIM)}
    eng.store(caches, [StoreChunk(5, [7, 3])]).block_until_ready()
    ref = [bits(c) for c in caches]  # [layer][block, bs, head, dim]
    for shard in eng.slabs[0][0].addressable_shards:  # the store donated the old slab
        head = shard.device.id  # mesh devices in order: device d holds head d
        row = np.asarray(shard.data)[5].view(np.uint8).reshape(2, LAYERS, BS, 1, DIM * 2)
        for b, block in enumerate((7, 3)):
            for layer in range(LAYERS):
                assert np.array_equal(row[b, layer, :, 0], ref[layer][block, :, head]), (head, b, layer)


def test_unpinned_host_and_multiple_slabs(mesh):
    caches = make_caches(mesh, jnp.float32, seed=3)
    ref = [bits(c) for c in caches]
    layout = KVLayout.from_caches(caches)
    eng = TransferEngine(layout, num_slots=10, blocks_per_chunk=1, staging_blocks=8,
                         memory_kind="unpinned_host", max_slab_bytes=3 * layout.block_bytes)
    assert eng.programs.slab_rows == (3, 3, 3, 1)
    assert eng.slabs[0][0].sharding.memory_kind == "unpinned_host"
    slots = [9, 0, 4, 5, 8, 1]  # every slab, out of order, in one batch
    eng.store(caches, [StoreChunk(s, [i]) for i, s in enumerate(slots)]).block_until_ready()
    eng.complete_store(slots, True)
    caches, done = eng.load(caches, [LoadChunk(s, [20 + i]) for i, s in enumerate(slots)])
    done.block_until_ready()
    for layer in range(LAYERS):
        got = bits(caches[layer])
        for i in range(len(slots)):
            assert np.array_equal(got[20 + i], ref[layer][i])


def test_no_recompilation_after_warmup(mesh):
    caches = make_caches(mesh, jnp.bfloat16, seed=4)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=32, blocks_per_chunk=1, staging_blocks=8)
    eng.precompile()
    before, programs = COMPILES.n, eng.programs.compiles
    assert programs == 5  # gather, scatter, store, load, slab allocation: one each, for any block count
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 5, 7, 8, 13, 21, 1, 6]:  # every bucket, padding, and multi-pass sizes
        blocks = rng.permutation(NB)[:n]
        slots = rng.permutation(32)[:n]
        eng.store(caches, [StoreChunk(int(s), [int(b)]) for s, b in zip(slots, blocks)])
        eng.complete_store(slots, True)
        caches, done = eng.load(caches, [LoadChunk(int(s), [int(b)]) for s, b in zip(slots, blocks)])
    done.block_until_ready()
    assert COMPILES.n == before, f"{COMPILES.n - before} backend compilations after warm-up"
    assert eng.programs.compiles == programs


def test_checksum_catches_corrupted_host_bytes(mesh):
    caches = make_caches(mesh, jnp.bfloat16, seed=5)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=1, staging_blocks=2,
                         checksums=True)
    eng.store(caches, [StoreChunk(0, [1]), StoreChunk(1, [2])]).block_until_ready()
    eng.complete_store([0, 1], True)
    assert eng.check_loadable(0) and eng.check_loadable(1)
    view = eng.row_views(1)[3]  # one device's bytes of slot 1
    view[100] ^= 0xFF
    assert eng.check_loadable(0)
    assert not eng.check_loadable(1)
    assert not eng.valid[1]


def test_staging_must_fit_in_hbm(caplog):
    """Staging plus transfer scratch must fit in what the KV cache left free, or start fails
    with the figures and both ways out; fitting into the model's headroom is logged."""
    gib = 1 << 30
    dev = jax.devices()[:1]
    # 16 GiB device, utilization 0.9: say 1.5 GiB is left after the KV cache.
    with pytest.raises(ConfigError) as e:
        check_staging_fits(gib, gib, 100, dev, utilization=0.9, free_bytes=3 * gib // 2, limit_bytes=16 * gib)
    msg = str(e.value)
    assert "needs 2.000 GiB" in msg and "100 blocks (1.000 GiB)" in msg and "1.000 GiB of transfer-program" in msg
    assert "only 1.500 GiB is free" in msg and "missing 512.00 MiB" in msg
    assert "TPU_OFFLOAD_NUM_STAGING_BLOCKS) from 100 to at most 75" in msg  # 1.5 GiB / 20.48 MiB per block
    assert "--gpu-memory-utilization from 0.9 to at most 0.868" in msg  # 0.9 - 0.5/16, rounded down
    assert "0.775 also keeps the model's own headroom whole" in msg  # 0.9 - 2/16
    # That advice: a KV cache 0.5 GiB smaller leaves 2.0 GiB free, which fits (and is logged).
    with caplog.at_level("WARNING", logger="tpu_offload.jax_backend.memory"):
        check_staging_fits(gib, gib, 100, dev, utilization=0.868, free_bytes=2 * gib, limit_bytes=16 * gib)
    assert "lower --gpu-memory-utilization from 0.868 to 0.743" in caplog.text
    check_staging_fits(gib, gib, 100, dev, free_bytes=2 * gib)  # no utilization known: fits, nothing to advise


def test_transfer_scratch_is_counted(mesh):
    """The check sees the compiled programs' own temporary HBM, not just the staging buffer."""
    caches = make_caches(mesh, jnp.bfloat16)
    seen = {}
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=2, staging_blocks=8,
                         hbm_check=lambda staging, scratch: seen.update(staging=staging, scratch=scratch))
    assert seen["staging"] == eng.staging_device_bytes == 8 * LAYERS * BS * DIM * 2
    p = eng.programs
    assert seen["scratch"] == max(x.memory_analysis().temp_size_in_bytes for x in p.all_programs().values())

    seen.clear()
    TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=2, staging_blocks=8, path="device_put",
                   hbm_check=lambda staging, scratch: seen.update(staging=staging, scratch=scratch))
    assert seen["staging"] == 2 * eng.staging_device_bytes  # + the chunks waiting on HBM for their device_put

    def refuse(staging, scratch):
        raise ConfigError("no room")

    with pytest.raises(ConfigError, match="no room"):
        TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=2, staging_blocks=8,
                       hbm_check=refuse)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_hybrid_layer_groups_and_packed_5d_layout(kind):
    """tpu-inference's real cache is (blocks, block_size, heads, packing, head_dim)
    sharded P(BATCH, KV_CONTEXT, KV_HEAD) with tuple axis names; hybrid models
    mix layer shapes. Both must round-trip, one group per shape."""
    mesh = make_mesh(kind, (1, 1, 8), ("data", "pcp", "model"))
    sh = NamedSharding(mesh, P(("data",), ("pcp",), ("model",)))
    shapes = [(NB, 8, 8, 2, 16), (NB, 8, 16, 2, 16), (NB, 8, 8, 2, 16)]  # layers 0 and 2 share a shape
    caches = [jax.device_put(jax.random.normal(jax.random.key(i), s).astype(jnp.bfloat16), sh)
              for i, s in enumerate(shapes)]
    ref = [bits(c) for c in caches]
    layout = KVLayout.from_caches(caches)
    assert [g.layers for g in layout.groups] == [(0, 2), (1,)]
    eng = TransferEngine(layout, num_slots=4, blocks_per_chunk=2, staging_blocks=4)
    eng.store(caches, [StoreChunk(3, [1, 2]), StoreChunk(0, [5, 6])]).block_until_ready()
    eng.complete_store([3, 0], True)
    caches, done = eng.load(caches, [LoadChunk(0, [30, 31]), LoadChunk(3, [32, 33])])
    done.block_until_ready()
    for layer in range(3):
        got = bits(caches[layer])
        for s, d in ((5, 30), (6, 31), (1, 32), (2, 33)):
            assert np.array_equal(got[d], ref[layer][s])


COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def test_programs_stay_on_each_device(any_mesh):
    """Every device moves only its own head shards: no program of the data path
    may contain a cross-device collective, whatever the mesh's axis types."""
    caches = make_caches(any_mesh, jnp.bfloat16, seed=6)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=2, staging_blocks=4)
    p = eng.programs
    for name, prog in [("gather", p.gather()), ("scatter", p.scatter()), ("store", p.store()), ("load", p.load())]:
        hlo = prog.as_text()
        found = [c for c in COLLECTIVES if c in hlo]
        assert not found, f"{name} contains {found}"


def replicated_caches(mesh, dtype, kv_heads, seed=7, layers=LAYERS, any_bits=False):
    """tpu-inference's cache when TP (8) exceeds the model's KV heads: heads padded to TP by
    repeating each one 8 // kv_heads times, K/V merged and packed: (blocks, bs, 8 * per_dev, packing, dim)."""
    tp = mesh.shape["model"]
    packing = 4 // jnp.dtype(dtype).itemsize  # 2 for bf16, 1 for fp32
    per_dev = max(1, 2 // packing)  # merged K/V rows per device for one head
    sh = NamedSharding(mesh, P(None, None, "model"))
    out = []
    for layer in range(layers):
        shape = (NB, BS, kv_heads, per_dev, packing, DIM)
        if any_bits:  # every bit pattern, NaN payloads included: the host tier must not canonicalise them
            uint = {2: np.uint16, 4: np.uint32}[jnp.dtype(dtype).itemsize]
            raw = np.random.default_rng(seed + layer).integers(0, np.iinfo(uint).max, shape, dtype=uint, endpoint=True)
            distinct = jnp.asarray(raw.view(jnp.dtype(dtype)))
        else:
            distinct = jax.random.normal(jax.random.key(seed + layer), shape).astype(dtype)
        padded = jnp.repeat(distinct, tp // kv_heads, axis=2)  # what tpu-inference's weight padding produces
        out.append(jax.device_put(padded.reshape(NB, BS, tp * per_dev, packing, DIM), sh))
    return out


@pytest.mark.parametrize("any_bits", [False, True], ids=["normal", "any-bits"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_replicated_heads_stored_once(any_mesh, dtype, kv_heads, any_bits):
    """TP 8 over 1, 2 or 4 KV heads (as Llama-3-8B at TP 16, or llm-d's multi-host TP 16):
    the host tier and every transfer hold each distinct head once, and loads
    rebuild every replica bit-exactly, whatever the bits (NaN payloads too: on CPU the replicas'
    slices cross as raw bits, see ``collectives_as_bits``)."""
    caches = replicated_caches(any_mesh, dtype, kv_heads, any_bits=any_bits)
    shardings = [c.sharding for c in caches]
    ref = [bits(c) for c in caches]
    r = 8 // kv_heads
    layout = KVLayout.from_caches(caches, head_replicas=r)
    real_block = LAYERS * BS * kv_heads * 2 * DIM * jnp.dtype(dtype).itemsize  # K and V of the model's heads
    assert layout.block_bytes == real_block
    assert layout.replicated_block_bytes == r * real_block
    eng = TransferEngine(layout, num_slots=6, blocks_per_chunk=2, staging_blocks=4)
    assert eng.chunk_bytes == 2 * real_block
    host = sum(s.data.nbytes for per_group in eng.slabs for slab in per_group for s in slab.addressable_shards)
    assert host == 6 * eng.chunk_bytes  # the host tier: real KV size, nothing repeated
    staging = sum(s.data.nbytes for st in eng.staging for s in st.addressable_shards)
    assert staging == 4 * real_block
    src = [[1, 2], [9, 4], [30, 31]]  # 3 chunks: more than the 2-chunk staging buffer
    eng.store(caches, [StoreChunk(s, b) for s, b in zip([5, 0, 3], src)]).block_until_ready()
    eng.complete_store([5, 0, 3], True)
    dst = [[20, 21], [11, 12], [13, 14]]
    caches, done = eng.load(caches, [LoadChunk(s, b) for s, b in zip([3, 5, 0], [dst[2], dst[0], dst[1]])])
    done.block_until_ready()
    assert [c.sharding for c in caches] == shardings
    got = [bits(c) for c in caches]
    for layer in range(LAYERS):
        for sb, db in zip(src, dst):
            for s_, d_ in zip(sb, db):
                assert np.array_equal(got[layer][d_], ref[layer][s_]), (layer, s_, d_)
        untouched = np.setdiff1d(np.arange(NB), np.ravel(dst))
        assert np.array_equal(got[layer][untouched], ref[layer][untouched])


def test_replicated_heads_move_only_missing_slices(mesh):
    """Only the load's scatter talks between devices (replicas exchange their slices);
    gather, store and load stay on each device."""
    caches = replicated_caches(mesh, jnp.bfloat16, kv_heads=2)
    eng = TransferEngine(KVLayout.from_caches(caches, head_replicas=4), num_slots=4, blocks_per_chunk=1,
                         staging_blocks=4)
    p = eng.programs
    for name, prog in [("gather", p.gather()), ("store", p.store()), ("load", p.load())]:
        assert not [c for c in COLLECTIVES if c in prog.as_text()], name
    hlo = p.scatter().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo and "all-reduce" not in hlo


def test_replicas_must_fit_the_layout(mesh):
    caches = replicated_caches(mesh, jnp.bfloat16, kv_heads=2)
    with pytest.raises(ValueError, match="repeated 3 times"):
        KVLayout.from_caches(caches, head_replicas=3)


def test_failed_later_pass_leaves_live_caches(mesh):
    """A load bigger than staging runs in passes, each donating the caches it gets. When pass 2
    fails, the caller must already hold pass 1's output (live, with pass 1's blocks), not the
    donated arrays it started with."""
    caches = make_caches(mesh, jnp.float32, seed=7)
    ref = [bits(c) for c in caches]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=1, staging_blocks=2)
    eng.store(caches, [StoreChunk(s, [s]) for s in range(4)]).block_until_ready()
    eng.complete_store(range(4), True)
    scatter, calls = eng.programs.scatter(), []

    def failing_second_pass(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("transfer failed")
        return scatter(*args)

    eng.programs._cache[("scatter",)] = failing_second_pass
    held = {}
    with pytest.raises(RuntimeError, match="transfer failed"):
        eng.load(caches, [LoadChunk(s, [20 + s]) for s in range(4)], on_pass=lambda c: held.update(caches=c))
    got = [bits(c) for c in held["caches"]]  # pass 1 donated the caches it got (on TPU); its output is live
    for layer in range(LAYERS):
        for s in range(2):
            assert np.array_equal(got[layer][20 + s], ref[layer][s])
