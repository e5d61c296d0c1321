"""What a pass dispatches, per path (tpu_offload/testing/pass_counts.py, the counting bench_tpu_aot prints).

At the deployment shape (Qwen3-32B, TP 8, TPU7x:2x2x1, 20,000 blocks, the shipped config): the direct
kernel's calls come from the engine's own planning (``TransferEngine._direct_calls``), one per (group, slab)
each step's part touches, and a pass spans ceil(its bytes / the step budget) steps; tpu-inference's count
holds one runtime transfer per block. Nothing is compiled here: the counts need the layout and the plan only.
"""

import json
import math
import os

import pytest

from tpu_offload.connector import aot
from tpu_offload.core import step_budget
from tpu_offload.core.config import OffloadConfig
from tpu_offload.jax_backend import direct_dma
from tpu_offload.jax_backend.engine import plan_transfers
from tpu_offload.jax_backend.layout import KVLayout
from tpu_offload.testing import pass_counts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKS = (1, 16, 64, 1000)
KINDS = ("adjacent", "scattered")


@pytest.fixture(scope="module")
def deployment():
    extra = json.load(open(os.path.join(ROOT, "configs", "tpu-inference", "offload.json")))["kv_connector_extra_config"]
    cfg = OffloadConfig.from_sources(extra, env={})
    model = aot.MODELS["Qwen3-32B"]
    mesh = aot.compile_only_mesh("TPU7x:2x2x1", 8)
    caches = aot.kv_cache_avals(mesh, model, 20000, 128)
    _, replicas = aot.padded_kv_heads(model, 8)
    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    num_slots = cfg.resolve_num_chunks(layout.block_bytes * cfg.blocks_per_chunk)
    return cfg, layout, num_slots


def ours(deployment, max_slab_bytes=None) -> pass_counts.Ours:
    cfg, layout, num_slots = deployment
    kw = {} if max_slab_bytes is None else {"max_slab_bytes": max_slab_bytes}
    plan = plan_transfers(layout, num_slots=num_slots, blocks_per_chunk=cfg.blocks_per_chunk,
                          staging_blocks=cfg.staging_blocks, **kw)
    direct = direct_dma.DirectPrograms(layout, blocks_per_chunk=cfg.blocks_per_chunk, slab_rows=plan.programs.slab_rows,
                                       memory_kind="pinned_host", capacity=plan.staging_blocks)
    return pass_counts.Ours(plan, num_slots=num_slots, blocks_per_chunk=cfg.blocks_per_chunk,
                            step_budget_bytes=cfg.step_budget_bytes, piece_bytes=cfg.transfer_piece_bytes,
                            direct=direct)


def test_the_step_budget_is_the_configs(deployment):
    cfg, layout, _ = deployment
    o = ours(deployment)
    assert layout.device_block_bytes() == 4 << 20 and cfg.step_budget_bytes == 380_000_000
    assert o.step_blocks == step_budget.blocks(cfg.step_budget_bytes, 4 << 20, 1, cfg.staging_blocks) == 90


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks", BLOCKS)
def test_direct_one_kernel_call_per_piece(deployment, blocks, kind, direction):
    """With the tier in one slab, every pass is one kernel call per piece, and its pieces are
    ceil(pass bytes / step budget): 1, 1, 1 and 12 at 1, 16, 64 and 1,000 blocks, not 2 at every size."""
    cfg, layout, _ = deployment
    o = ours(deployment, max_slab_bytes=1 << 50)
    assert len(o.engine.programs.slab_rows) == 1
    c = o.direct(direction, blocks, kind)
    pieces = step_budget.steps_to_move(blocks, o.step_blocks)
    assert pieces == math.ceil(blocks * layout.device_block_bytes() / cfg.step_budget_bytes)
    assert c.pieces == c.steps == pieces
    assert c.dispatches == c.programs == pieces
    assert c.waits == 0 and c.transfers == 0
    assert c.dispatches == {1: 1, 16: 1, 64: 1, 1000: 12}[blocks]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks", BLOCKS)
def test_direct_calls_are_the_slabs_each_piece_touches(deployment, blocks, kind):
    """The shipped tier (45 slabs of 512 rows): a call per (piece, slab touched), every block in exactly one."""
    o = ours(deployment)
    assert len(o.engine.programs.slab_rows) == 45
    chunks = o.chunks("store", blocks, kind)
    parts = o.steps(chunks)
    calls = [o.direct_calls(p) for p in parts]
    assert [len(c) for c in calls] == [len({c.slot // 512 for c in p}) for p in parts]
    assert sum(len(b) for per in calls for _, _, b, _, _ in per) == blocks
    c = o.direct("store", blocks, kind)
    assert c.pieces == len(parts) and c.dispatches == sum(len(x) for x in calls) >= c.pieces
    if kind == "adjacent":
        assert c.dispatches == {1: 1, 16: 1, 64: 1, 1000: 13}[blocks]  # one step's part crosses slab 0 -> 1
    else:
        assert c.dispatches == {1: 1, 16: 16, 64: 45, 1000: 55}[blocks]


@pytest.mark.parametrize("kind", KINDS)
def test_staging_path_programs(deployment, kind):
    """Staging: per step's part a gather, and per 16 MiB piece (4 blocks) a host copy per slab touched."""
    o = ours(deployment)
    c = o.staging("store", 1000, kind)
    assert c.steps == 12 and c.pieces == 11 * math.ceil(90 / 4) + math.ceil(10 / 4)
    assert c.programs >= c.steps + c.pieces and c.transfers == 0 and c.waits == 0
    assert o.staging("store", 16, "adjacent").dispatches == 1 + 4


@pytest.mark.parametrize("blocks", BLOCKS)
def test_theirs_count_a_runtime_transfer_per_block(blocks):
    buckets = pass_counts.their_buckets(blocks)
    assert sum(buckets) == blocks
    store, load = pass_counts.theirs(blocks, "store"), pass_counts.theirs(blocks, "load")
    assert store.transfers >= blocks and load.transfers >= blocks
    assert store.dispatches == len(buckets) + (1 if blocks in pass_counts.THEIR_BUCKETS else len(buckets)) + blocks
    assert load.dispatches == blocks + 9 * len(buckets)  # update_kv_caches_one: 2 programs + 6 transfers + itself
    assert load.waits == 2 and store.waits == 0 and store.steps == load.steps == 1
    assert pass_counts.theirs(1000, "store").dispatches == 17 + 17 + 1000


def test_counts_grow_with_the_pass(deployment):
    """The regression the counting guards against: a constant '2 launches' at every size."""
    o = ours(deployment)
    for who in (lambda n: o.direct("store", n, "scattered"), lambda n: o.staging("load", n, "adjacent"),
                lambda n: pass_counts.theirs(n, "store")):
        counts = [who(n).dispatches for n in BLOCKS]
        assert counts == sorted(counts) and counts[-1] > counts[0] and len(set(counts)) > 1, counts
