"""The staging path's host copies (jax_backend/host_dma.py), compiled by the TPU compiler at deployment shapes.

Qwen2.5-7B at TP 8 on TPU7x:2x2x1 (4 KV heads repeated twice: the direct kernel cannot serve it, the staging
path's scatter rebuilds each block from both replicas' slices) and Qwen3-32B (the staging path as the direct
kernel's fallback): per slab size one store and one load, each one Pallas kernel per layer group that DMAs
staging chunks to or from their slab rows. The cost model does not see inside a kernel (its bytes accessed are
the index operands), so a pass's bytes are counted per call from what each kernel's DMAs move (read once,
written once), plus the cost model's figure for every op around the kernels: the gather/scatter kernel 2x
in HBM, the host copy 1x in HBM (its other side is the host slab).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from test_compiler_budgets import DEPLOYMENTS
from tpu_offload.connector import aot
from tpu_offload.core.config import _bytes as parse_bytes
from tpu_offload.jax_backend import direct_dma, host_dma
from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.layout import KVLayout
from tpu_offload.jax_backend.programs import HOST_COPY_DEFAULT
from tpu_offload.selfcheck import pass_figures

BLOCKS = (1, 16, 64, 1000)
QWEN25 = DEPLOYMENTS[3]  # Qwen2.5-7B, TP 8: replicated KV heads, the staging path's own deployment
QWEN3 = DEPLOYMENTS[0]  # Qwen3-32B, TP 8
FIGURES: dict = {}  # (model, blocks, kind) -> per-pass figures, printed at the end of the module


def build(topology, tp, model_name, num_blocks, cpu_bytes, staging, host_copy="dma"):
    """test_compiler_budgets.build, with the host copies asked for as kernels (``host_copy``)."""
    model = aot.MODELS[model_name]
    mesh = aot.compile_only_mesh(topology, tp)
    caches = aot.kv_cache_avals(mesh, model, num_blocks, 128)
    _, replicas = aot.padded_kv_heads(model, tp)
    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    num_slots = parse_bytes(cpu_bytes) // layout.block_bytes
    return aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=1, staging_blocks=staging,
                                   head_replicas=replicas, host_copy=host_copy)


def kernel_calls(hlo: str) -> int:
    return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))


@pytest.fixture(scope="module", params=[QWEN25, QWEN3], ids=["Qwen2.5-7B", "Qwen3-32B"])
def programs(request):
    return build(*request.param)


def moves(kind: str, n: int):
    """(cache blocks, staging chunks, slab rows) of a pass of ``n`` one-block chunks: ``adjacent``, consecutive
    blocks into consecutive rows; ``scattered``, nothing consecutive in the cache nor in the slab."""
    if kind == "adjacent":
        return np.arange(100, 100 + n), np.arange(n), np.arange(7, 7 + n)
    return np.arange(n) * 7 + 3, np.arange(n), np.arange(n)[::-1] * 3


def test_host_copies_are_kernels_where_they_can_be(programs):
    assert programs.host_copy == "dma" and programs.host_copy_why is None
    g = programs.layout.groups[0]
    slab = programs._slab_aval(programs.slab_rows[0])[0]
    assert slab.dtype == np.uint8 and slab.shape[2:] == direct_dma.TILE
    assert slab.shape[1] == g.shards * len(g.layers) * direct_dma.tiles_per_block(g.piece_shape, g.dtype)
    if g.replicas == 1:  # a tier either kernel can fill has one slab type
        d = direct_dma.DirectPrograms(programs.layout, blocks_per_chunk=1, slab_rows=programs.slab_rows,
                                      memory_kind="pinned_host", capacity=programs.staging_blocks)
        assert d.slab_aval(0, programs.slab_rows[0]) == slab


def test_the_default_is_the_loop_and_says_why():
    p = build(*QWEN3, host_copy=None)
    assert p.host_copy == "loop" and p.host_copy_why == HOST_COPY_DEFAULT


@pytest.mark.xfail(strict=True, reason="a zero row broadcast in host memory comes out in the u8 (8, 128) tile: the "
                   "allocator relays every 4 KiB-tiled slab through HBM (the direct path's allocator alike)")
def test_tiled_slabs_are_allocated_without_hbm():
    """What keeps the kernels off by default (programs.HOST_COPY_DEFAULT): the allocator of the u8 4 KiB-tiled
    slabs, at the shipped 720 GiB tier, must not fill them on HBM (budget: a sixteenth of a slab)."""
    p = build(*QWEN3)
    scratch = p._slab_allocator().memory_analysis().temp_size_in_bytes
    print(f"tiled slab allocator: {scratch / (1 << 20):.1f} MiB of HBM scratch per device")
    assert scratch <= aot.slab_device_bytes(p) / 16


@pytest.mark.xfail(strict=True, reason="the same allocator, the same u8 (32, 128) slabs: relayed through HBM")
def test_direct_path_slabs_are_allocated_without_hbm():
    """The direct path's allocator (``DirectPrograms.alloc_slabs``) makes the same slabs the same way; the
    start-up check (``selfcheck.direct_figures``) leaves its scratch out."""
    p = build(*QWEN3, host_copy=None)
    d = direct_dma.DirectPrograms(p.layout, blocks_per_chunk=1, slab_rows=p.slab_rows, memory_kind="pinned_host",
                                  capacity=p.staging_blocks)
    scratch = d._build_allocator().memory_analysis().temp_size_in_bytes
    print(f"direct slab allocator: {scratch / (1 << 20):.1f} MiB of HBM scratch per device")
    assert scratch <= aot.slab_device_bytes(p) / 16


HOST_TILES = {  # slab dtype -> the minor (tile) dimensions of its slab
    "u8": (jnp.uint8, (32, 128)), "u32": (jnp.uint32, (8, 128)), "bf16": (jnp.bfloat16, (16, 128))}


def _one_device():
    from jax.experimental import topologies
    from jax.sharding import Mesh
    return Mesh(topologies.get_topology_desc("TPU7x:2x2x1", "tpu").devices[:1], ("x",))


def _zero_slab_scratch(dtype, tile) -> int:
    """HBM scratch of a zero-filled 2 GiB host slab of ``dtype`` made as the allocators make it."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    host = NamedSharding(_one_device(), P(), memory_kind="pinned_host")
    shape = (512, (2 << 30) // (512 * 4096), *tile)

    def make():
        return jnp.broadcast_to(jax.device_put(jnp.zeros((1, *shape[1:]), dtype), host), shape)

    return jax.jit(make, out_shardings=host).lower().compile().memory_analysis().temp_size_in_bytes


def _dynamic_host_dma(dtype, tile):
    """Compiles one kernel that DMAs two HBM rows into a host slab (aliased) at a dynamic row."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def kernel(idx, src, _dst_in, dst, sem):
        c = pltpu.make_async_copy(src.at[pl.ds(idx[0], 2)], dst.at[pl.ds(idx[1], 2)], sem.at[0])
        c.start()
        c.wait()

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 16, *tile), dtype), grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.HOST)],
        out_specs=pl.BlockSpec(memory_space=pl.HOST), scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        input_output_aliases={2: 0}, compiler_params=pltpu.CompilerParams(has_side_effects=True))
    mesh = _one_device()
    dev, host = NamedSharding(mesh, P()), NamedSharding(mesh, P(), memory_kind="pinned_host")
    args = (jax.ShapeDtypeStruct((2,), jnp.int32, sharding=dev), jax.ShapeDtypeStruct((64, 16, *tile), dtype, sharding=dev),
            jax.ShapeDtypeStruct((128, 16, *tile), dtype, sharding=host))
    return jax.jit(call, out_shardings=host, donate_argnums=(2,)).lower(*args).compile()


def test_which_host_tiles_allocate_and_take_dynamic_dmas():
    """Why the kernels' slabs are u8 and why making them costs HBM, as this libtpu has it. A slab zero-filled
    in host memory comes out in an (8, 128) tile, which is what a u32 or bf16 slab is laid out in, so those
    are made without HBM; a u8 slab is laid out in (32, 128) and the relayout runs through HBM. A Pallas DMA
    to a host array at a dynamic offset compiles only for u8's (32, 128) tile (the LLO check wants a 4 KiB
    offset multiplier: u32's is 512 bytes, bf16's 2,048). Either one changing in a later libtpu opens the
    way to slabs that are both made and filled without HBM (the two xfails above)."""
    scratch = {k: _zero_slab_scratch(*v) for k, v in HOST_TILES.items()}
    assert scratch["u32"] <= 16 << 20 and scratch["u8"] >= 2 << 30 and scratch["bf16"] <= 16 << 20, scratch
    _dynamic_host_dma(*HOST_TILES["u8"])
    for name in ("u32", "bf16"):
        with pytest.raises(Exception, match=r"multiplier_in_bytes % word_size"):
            _dynamic_host_dma(*HOST_TILES[name])


def test_layouts_that_keep_the_loop_copies_say_why():
    mla_d = [d for d in DEPLOYMENTS if d[2] == "DeepSeek-V3"][0]
    mla = build(*mla_d, host_copy=None)
    assert mla.host_copy == "loop" and "minor dimension of 640" in mla.host_copy_why
    with pytest.raises(ValueError, match="minor dimension of 640"):
        build(*mla_d)
    assert mla._slab_aval(mla.slab_rows[0])[0].dtype != np.uint8  # the cache's own dtype, as the loop writes
    assert "TPU only" in host_dma.supported(mla.layout, platform="cpu")
    with pytest.raises(ValueError, match="TPU only"):
        host_dma.store_call(1, 16, (4, 16, 32, 128), platform="cpu")


@pytest.mark.parametrize("direction", ["store", "load"])
def test_one_kernel_no_scratch_in_place(programs, direction):
    """Every slab size: one kernel call per group, no loop, 0 HBM scratch; the slab stays in host memory (S(5)),
    a store aliases it (updated in place), a load only reads it and writes staging in place."""
    g = programs.layout.groups[0]
    staging = programs.staging_blocks * programs.layout.device_block_bytes()
    for rows in sorted(set(programs.slab_rows)):
        p = getattr(programs, direction)(rows)
        m, hlo = p.memory_analysis(), p.as_text()
        slab = rows * g.piece_bytes * programs.bpc
        assert m.temp_size_in_bytes == 0 and m.host_temp_size_in_bytes == 0, (direction, rows)
        assert kernel_calls(hlo) == len(programs.layout.groups) and not re.search(r"\bwhile\(", hlo), (direction, rows)
        assert re.search(r"u8\[%d,\d+,32,128\]\{[^}]*S\(5\)\}" % rows, hlo), (direction, rows)
        assert m.host_argument_size_in_bytes == slab, (direction, rows)
        if direction == "store":
            assert m.host_alias_size_in_bytes == m.host_output_size_in_bytes == slab
        else:
            assert m.host_output_size_in_bytes == m.host_alias_size_in_bytes == 0
            assert m.alias_size_in_bytes == staging


def _kernel_bytes(runs: np.ndarray, per: int) -> int:
    """What one call's DMAs move: every run's length x ``per`` bytes (read once and written once)."""
    return int(runs[:, 2].sum()) * per


@pytest.mark.parametrize("kind", ["adjacent", "scattered"])
@pytest.mark.parametrize("blocks", BLOCKS)
def test_staging_pass_costs_at_most_three_times_what_it_moves(programs, blocks, kind):
    """A pass of 1, 16, 64 and 1,000 blocks, adjacent or scattered: store = gather (its DMAs read the caches
    and write staging: 2x) + host copy (its DMAs read staging once: 1x in HBM, and write the slab); load =
    host copy (1x: staging written once) + scatter (2x). Counted per call from the DMAs each kernel issues for
    these operands, plus the cost model's bytes for the ops around the kernels (the index operands: the same
    few KiB at every size). No TensorCore op grows with the pass: the kernels and their operands, a handful."""
    g = programs.layout.groups[0]
    blk, chunks, rows = moves(kind, blocks)
    moved = blocks * programs.layout.device_block_bytes()  # per device
    piece = programs.layout.device_block_bytes() // len(g.layers)  # one device's piece of a block and layer
    chunk = programs.layout.device_block_bytes() * programs.bpc  # one staging chunk, a slab row's device part
    lists = [(blk, chunks)]
    runs = 1 if kind == "adjacent" else blocks
    figs, around = {}, {}  # per program: its bytes; the cost model's bytes around its kernels
    for name in ("gather", "scatter", "store", "load"):
        p = getattr(programs, name)()
        hlo = p.as_text()
        outside = p.cost_analysis()["bytes accessed"]
        tc = [aot.tensorcore_ops(hlo, n) for n in (16, 64, 1000)]
        assert tc[0] == tc[1] == tc[2] and not re.search(r"\bwhile\(", hlo), (name, tc)
        if name in ("store", "load"):  # the kernel and its index operands (gather/scatter: test_compiler_budgets)
            assert tc[0] <= 4, (name, tc)
        if name in ("gather", "scatter"):
            assert programs.dma_count(lists, name) == runs * len(g.layers) * (g.replicas if name == "scatter" else 1)
            count, _, _, length = (o[0] for o in programs.block_args(lists, name))
            per_call = 2 * int(length[: int(count[0])].sum()) * piece * len(g.layers)  # each DMA read, written once
            assert per_call == 2 * moved
            # the scatter: one kernel call per replica's slices (its own, then each ring shift's), and the ring's
            # collective-permutes of the whole staging buffer (the cost model's bytes around the kernels)
            assert kernel_calls(hlo) == (g.replicas if name == "scatter" else 1)
            figs[name] = kernel_calls(hlo) * per_call + outside
            around[name] = outside
            continue
        n, src, dst, length = (o[0] for o in programs.store_args(0, [rows], [chunks]))
        got = np.stack([src, dst, length], axis=1)[: int(n[0])]
        assert len(got) == runs and int(got[:, 2].sum()) == blocks
        assert kernel_calls(hlo) == 1
        hbm = _kernel_bytes(got, chunk)  # the staging side of each DMA; the other side is the host slab
        assert hbm == moved
        assert outside <= 64 << 10, (name, outside)  # the index operands, whatever the pass
        figs[name] = hbm + outside
        around[name] = outside
    store, load = figs["gather"] + figs["store"], figs["load"] + figs["scatter"]
    index = around["gather"] + around["store"]  # the index operands, the same at every pass size
    assert index <= 192 << 10 and store - index == 3 * moved, (store, index, moved)
    if g.replicas == 1:
        index = around["load"] + around["scatter"]
        assert index <= 192 << 10 and load - index == 3 * moved, (load, index, moved)
    else:  # the scatter writes whole blocks: every replica's slices (2x each), and the ring's shifts of staging
        assert load - around["load"] == moved + g.replicas * 2 * moved + around["scatter"], (load, moved)
    pf = pass_figures(programs, aot.measure(programs), blocks)["programs"]
    for name in ("store", "load"):
        assert pf[name]["hbm_accessed"] <= moved + (64 << 10), (name, pf[name])
    FIGURES[(programs.layout.groups[0].replicas, blocks, kind)] = dict(
        moved=moved, gather=figs["gather"], store=figs["store"], load=figs["load"], scatter=figs["scatter"],
        store_pass=store, load_pass=load, index=around["gather"] + around["store"])


@pytest.mark.parametrize("kind", ["adjacent", "scattered"])
@pytest.mark.parametrize("blocks", BLOCKS)
def test_one_kernel_call_per_piece(programs, blocks, kind):
    """The engine's own planning (``TransferEngine._pieces``, ``_by_slab``): with the tier in one slab, each
    pacer piece is one host-copy program of one kernel call per group; the shipped slabs add a call per
    further slab a piece touches, never per chunk."""
    e = object.__new__(TransferEngine)
    e.layout, e.bpc, e.programs = programs.layout, programs.bpc, programs
    e.num_slots = programs.slab_rows[0] * len(programs.slab_rows)
    e.rows_per_slab = programs.slab_rows[0]
    e.pacer = type("P", (), {"piece_bytes": 16 << 20})()
    n = min(blocks, programs.staging_blocks)
    slots = np.arange(n) if kind == "adjacent" else (np.arange(n) * max(1, e.num_slots // n)) % e.num_slots
    for make in (StoreChunk, LoadChunk):
        chunks = [make(int(s), [int(b)]) for s, b in zip(slots, np.arange(n))]
        pieces = e._pieces(chunks)
        calls = [len(e._by_slab([c.slot for c in chunks[sl]])) for sl in pieces]
        per_piece = max(1, (16 << 20) // programs.layout.device_block_bytes())
        assert len(pieces) == -(-n // per_piece)
        assert all(1 <= c <= per_piece for c in calls)
        if kind == "adjacent":
            assert sum(calls) <= len(pieces) + 1, calls  # at most one piece crosses into the next slab
    for name in ("store", "load"):
        assert kernel_calls(getattr(programs, name)().as_text()) == len(programs.layout.groups)


def test_print_figures():
    """The measured figures (bytes per device), for the record: run with -s."""
    for (replicas, blocks, kind), f in sorted(FIGURES.items()):
        mib = {k: round(v / (1 << 20), 3) for k, v in f.items()}
        print(f"replicas={replicas} blocks={blocks} {kind}: {mib}")
