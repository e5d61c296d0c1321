"""The direct host kernel (jax_backend/direct_dma.py), compiled by the TPU compiler at the deployment shape.

Qwen3-32B at TP 8 on TPU7x:2x2x1, 20,000 blocks, the shipped 720 GiB tier in 16 GiB slabs: per (group, slab
size) one store and one load, each one Pallas kernel that DMAs straight between the paged caches and the
host slab. The cost model does not see inside a kernel (its bytes accessed are the index operands), so a
pass's bytes are counted from what the kernel's DMAs move, read and written once each (the usual DMA-kernel
convention: 2x what the pass moves), plus the cost model's figure for every op around the kernel.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from test_compiler_budgets import DEPLOYMENTS
from tpu_offload.connector import aot
from tpu_offload.core.config import _bytes as parse_bytes
from tpu_offload.jax_backend import direct_dma
from tpu_offload.jax_backend.engine import plan_transfers
from tpu_offload.jax_backend.layout import KVLayout

QWEN = DEPLOYMENTS[0]  # TPU7x:2x2x1, TP 8, Qwen3-32B, 20,000 blocks, 720 GiB, 1,000 staging blocks
BLOCKS = (1, 16, 64, 1000)


def _layout(topology, tp, model_name, num_blocks):
    model = aot.MODELS[model_name]
    mesh = aot.compile_only_mesh(topology, tp)
    caches = aot.kv_cache_avals(mesh, model, num_blocks, 128)
    _, replicas = aot.padded_kv_heads(model, tp)
    return KVLayout.from_caches(caches, mesh, head_replicas=replicas)


def direct_programs(deployment=QWEN, blocks_per_chunk: int = 1) -> direct_dma.DirectPrograms:
    topology, tp, model, num_blocks, cpu_bytes, staging = deployment
    layout = _layout(topology, tp, model, num_blocks)
    num_slots = parse_bytes(cpu_bytes) // (layout.block_bytes * blocks_per_chunk)
    plan = plan_transfers(layout, num_slots=num_slots, blocks_per_chunk=blocks_per_chunk, staging_blocks=staging)
    return direct_dma.DirectPrograms(layout, blocks_per_chunk=blocks_per_chunk, slab_rows=plan.programs.slab_rows,
                                     memory_kind="pinned_host", capacity=staging)


@pytest.fixture(scope="module")
def qwen():
    return direct_programs()


def moves(kind: str, n: int):
    """(cache blocks, slab rows, chunk columns) of a pass of ``n`` one-block chunks."""
    if kind == "adjacent":
        return np.arange(100, 100 + n), np.arange(7, 7 + n), np.zeros(n, dtype=np.int64)
    return np.arange(n) * 7 + 3, np.arange(n)[::-1] * 3, np.zeros(n, dtype=np.int64)  # nothing consecutive


def kernel_calls(hlo: str) -> int:
    return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))


def test_the_deployment_is_direct(qwen):
    assert direct_dma.supported(qwen.layout) is None
    assert qwen.tiles == (16,)  # 64 KiB of one device's block per layer: 16 tiles of 4 KiB
    assert qwen.slab_rows[0] == 512 and len(qwen.slab_rows) == 45  # 16 GiB slabs of the 720 GiB tier


@pytest.mark.parametrize("direction", ["store", "load"])
def test_one_kernel_no_scratch_slab_in_place(qwen, direction):
    """Every slab size: one kernel call, no loop, 0 HBM scratch; the slab stays in host memory (S(5)) and the
    store aliases it (updated in place), the load only reads it and writes the caches in place."""
    g = qwen.layout.groups[0]
    cache_bytes = qwen.layout.num_blocks * g.piece_bytes  # a device's caches, all layers
    for rows in sorted(set(qwen.slab_rows)):
        p = getattr(qwen, direction)(0, rows)
        m, hlo = p.memory_analysis(), p.as_text()
        slab = rows * g.piece_bytes * qwen.bpc
        assert m.temp_size_in_bytes == 0 and m.host_temp_size_in_bytes == 0, (direction, rows)
        assert kernel_calls(hlo) == 1 and not re.search(r"\bwhile\(", hlo), (direction, rows)
        assert re.search(r"u8\[%d,1024,32,128\]\{[^}]*S\(5\)\}" % rows, hlo), (direction, rows)  # host memory
        assert m.host_argument_size_in_bytes == slab, (direction, rows)
        if direction == "store":
            assert m.host_alias_size_in_bytes == m.host_output_size_in_bytes == slab
            assert m.alias_size_in_bytes == 0  # the caches are only read
        else:
            assert m.host_output_size_in_bytes == m.host_alias_size_in_bytes == 0
            assert m.alias_size_in_bytes == cache_bytes  # every layer's cache written in place


@pytest.mark.parametrize("kind", ["adjacent", "scattered"])
@pytest.mark.parametrize("blocks", BLOCKS)
def test_pass_costs_twice_what_it_moves(qwen, blocks, kind):
    """A pass of 1, 16, 64 and 1,000 blocks, adjacent or scattered, each direction: one call of one kernel,
    one DMA per (run, layer), each DMA reading and writing its bytes once. Outside the kernel the call only
    stages its index operands (the cost model's bytes accessed), the same few KiB at every size; so per pass
    at most 2x what it moves plus those operands. The staging path moves the same pass gather 2x + store 3x,
    load 4x + scatter 2x (test_compiler_budgets)."""
    g = qwen.layout.groups[0]
    blk, rows, cols = moves(kind, blocks)
    runs = 1 if kind == "adjacent" else blocks
    moved = blocks * g.piece_bytes  # per device
    assert moved == blocks * (4 << 20)
    index_bytes = 4 * (1 + 4 * qwen.capacity)
    for direction in ("store", "load"):
        p = getattr(qwen, direction)(0)
        assert qwen.dma_count(0, blk, rows, cols) == runs * len(g.layers)
        n, *ops = qwen.operands(blk, rows, cols)
        assert int(n[0]) == runs and all(len(o) == qwen.capacity for o in ops)
        per_dma = ops[2][:runs] * qwen.tiles[0] * direct_dma.TILE_BYTES  # bytes of each run, per layer
        kernel = 2 * int(per_dma.sum()) * len(g.layers)  # read once, written once
        assert kernel == 2 * moved
        outside = p.cost_analysis()["bytes accessed"]
        assert outside <= 8 * index_bytes, (direction, outside)
        assert kernel + outside <= 2 * moved + 8 * index_bytes, (direction, blocks, kind)
        assert aot.tensorcore_ops(p.as_text(), blocks) <= 4  # the kernel and its operands, whatever the pass


def test_coalescing_needs_blocks_and_rows_consecutive():
    blk, rows, cols = [5, 6, 7, 9, 10, 11], [0, 1, 2, 3, 4, 8], [0] * 6
    assert direct_dma.coalesce(blk, rows, cols).tolist() == [[5, 0, 3, 0], [9, 3, 2, 0], [11, 8, 1, 0]]
    # several blocks per chunk: consecutive blocks of one chunk sit at different columns of one row
    assert direct_dma.coalesce([4, 5, 6, 7], [2, 2, 3, 3], [0, 1, 0, 1]).tolist() == \
        [[4, 2, 1, 0], [5, 2, 1, 1], [6, 3, 1, 0], [7, 3, 1, 1]]


def test_several_blocks_per_chunk_compile():
    """Four blocks per chunk: a row holds its blocks' tiles one after the other; same figures."""
    p = direct_programs(blocks_per_chunk=4)
    for direction in ("store", "load"):
        prog = getattr(p, direction)(0)
        m = prog.memory_analysis()
        assert m.temp_size_in_bytes == 0 and kernel_calls(prog.as_text()) == 1, direction
        assert m.host_argument_size_in_bytes == p.slab_rows[0] * 4 * (4 << 20)


@pytest.mark.parametrize("model, why", [("Qwen2.5-7B", "replicated"), ("DeepSeek-V3", "replicated")])
def test_layouts_it_cannot_serve_say_why(model, why):
    """Replica slices (repeated heads, MLA's copies) keep the staging path, which rebuilds them."""
    d = next(x for x in DEPLOYMENTS if x[2] == model)
    assert why in direct_dma.supported(_layout(*d[:4]))


def test_cpu_never_runs_it():
    layout = _layout(*QWEN[:4])
    assert "TPU only" in direct_dma.supported(layout, platform="cpu")
    with pytest.raises(ValueError, match="TPU only"):
        direct_dma.store_call(2, 16, (4, 32, 32, 128), platform="cpu")
    assert jnp.dtype(jnp.uint8).itemsize * direct_dma.TILE[0] * direct_dma.TILE[1] == 4096
