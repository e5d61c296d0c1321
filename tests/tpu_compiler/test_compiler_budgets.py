"""Every transfer program, compiled by the TPU compiler at real deployment shapes, within budget.

The budgets (per device, from the compiler's own analysis): gather/scatter
take at most 1.1x the bytes a full pass (1,000 staging blocks) moves in HBM
scratch and access at most 3x them (tpu-inference's insert accesses 2.0x,
its gather 6x); store/load read and update the host slabs in place; the slab
allocator's scratch does not grow with the tier. gather/scatter are Pallas
kernels of DMAs: the HLO is checked for any loop over blocks (the cost model
counts a loop body once and does not see inside a kernel).
"""

import re

import jax
import numpy as np
import pytest

from tpu_offload.connector import aot
from tpu_offload.core.config import _bytes as parse_bytes

GIB = 1 << 30

# (topology, TP, model, blocks in the KV cache, host tier, staging blocks); 128-token pages.
DEPLOYMENTS = [
    ("TPU7x:2x2x1", 8, "Qwen3-32B", 20000, "720GiB", 1000),  # the llm-d tpu-v7 guide; configs/tpu-inference
    ("TPU7x:2x2x1", 8, "Llama-3.1-70B", 16000, "720GiB", 1000),
    ("TPU7x:2x2x1", 8, "Llama-3.1-8B", 40000, "720GiB", 1000),
    ("TPU7x:2x2x1", 8, "Qwen2.5-7B", 40000, "256GiB", 1000),  # 4 KV heads, each on 2 devices
    ("TPU7x:2x2x1", 8, "gpt-oss-120b", 40000, "256GiB", 1000),  # head_dim 64
    ("TPU7x:2x2x1", 8, "DeepSeek-V3", 2000, "720GiB", 1000),  # MLA: a whole latent copy (20 GB) per device
    ("TPU7x:2x2x2", 16, "Llama-3.1-70B", 16000, "720GiB", 1000),  # two hosts, 8 KV heads over 16 devices
    ("v6e:2x4", 8, "Llama-3.1-8B", 6000, "128GiB", 256),
    ("v5e:2x2", 4, "Llama-3.1-8B", 3000, "64GiB", 128),
]
IDS = [f"{t}-tp{tp}-{m}" for t, tp, m, *_ in DEPLOYMENTS]


def build(topology, tp, model_name, num_blocks, cpu_bytes, staging):
    model = aot.MODELS[model_name]
    mesh = aot.compile_only_mesh(topology, tp)
    caches = aot.kv_cache_avals(mesh, model, num_blocks, 128)
    _, replicas = aot.padded_kv_heads(model, tp)
    from tpu_offload.jax_backend.layout import KVLayout

    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    num_slots = parse_bytes(cpu_bytes) // layout.block_bytes  # one-block chunks, as shipped
    return aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=1, staging_blocks=staging,
                                   head_replicas=replicas)


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=IDS)
def deployment(request):
    programs = build(*request.param)
    return request.param, programs, aot.measure(programs)


def test_every_program_fits_its_budget(deployment):
    (topology, tp, model, *_), programs, figs = deployment
    assert aot.budget_failures(programs, figs) == [], (topology, model)
    staging = programs.layout.device_block_bytes() * programs.staging_blocks
    ring = any(g.replicas > 1 for g in programs.layout.groups)
    for f in figs.values():  # nothing near what a TPU7x/v6e/v5e chip has, whatever the block count
        if ring and f.program == "scatter":  # the replicas' slices, received once per pass: one staging buffer
            assert f.hbm_scratch <= staging + (4 << 20), (f.program, f.hbm_scratch, staging)
        else:
            assert f.hbm_scratch < 64 << 20, (f.program, f.hbm_scratch)


def test_gather_and_scatter_are_dma_kernels_not_block_loops(deployment):
    """No TensorCore loop over blocks: each program is DMA kernels (tpu_custom_call) and, with
    replicated heads, the replicas' ring on the whole staging buffer; no while, no gather/scatter
    ops (each made the TPU compiler copy every layer's cache). MLA's latent slices lie along a tiled
    dimension a DMA cannot address, so MLA keeps the loop kernel (its ring still once per pass)."""
    (_, _, model, *_, staging), programs, figs = deployment
    mla = programs.layout.groups[0].replica_axes != ()
    assert programs.kernel == ("loop" if mla else "dma"), model
    for name in ("gather", "scatter"):
        hlo = getattr(programs, name)().as_text()
        assert not re.search(r"= \S+ (gather|scatter)\(", hlo), name
        f = figs[name]
        assert f.hbm_scratch <= 1.1 * f.moved and f.bytes_accessed <= (6 if mla else 3) * f.moved, (name, f)
        if mla:
            continue
        assert not re.search(r"\bwhile\(", hlo), name
        assert re.search(r'custom_call_target="tpu_custom_call"', hlo), name
    # the figures are for a full pass: 1,000 blocks at every TPU7x deployment
    assert figs["gather"].moved == programs.staging_blocks * programs.layout.device_block_bytes()
    assert programs.staging_blocks == staging
    st = programs.scatter().memory_analysis()
    assert st.alias_size_in_bytes >= st.argument_size_in_bytes - programs.layout.device_block_bytes() * programs.staging_blocks - (1 << 20)


def while_bodies(hlo: str) -> list[str]:
    """The text of every while loop's body computation."""
    names = re.findall(r"\bbody=%?([\w.\-]+)", hlo)
    return [m.group(0) for n in names for m in [re.search(rf"(?ms)^%?{re.escape(n)} .*?^}}", hlo)] if m]


def test_ring_runs_once_per_pass_outside_any_loop():
    """Replicated heads (Qwen2.5-7B at TP 8) and MLA (DeepSeek-V3): the scatter's collective-permutes
    are replicas - 1 shifts of the whole staging buffer, none inside a loop body."""
    for d in (DEPLOYMENTS[3], [d for d in DEPLOYMENTS if d[2] == "DeepSeek-V3"][0]):
        programs = build(*d)
        g = programs.layout.groups[0]
        hlo = programs.scatter().as_text()
        starts = [line for line in hlo.splitlines() if re.search(r"collective-permute(-start)?\(", line)]
        assert len(starts) == g.replicas - 1, (d[2], starts)
        staging = ",".join(map(str, (programs.staging_blocks, len(g.layers), *g.piece_shape)))
        assert all(f"[{staging}]" in line for line in starts), (d[2], starts)
        bodies = while_bodies(hlo)
        assert len(bodies) == (g.replicas if g.replica_axes else 0), d[2]  # MLA: a block loop per slice
        assert not any("collective-permute" in b for b in bodies), d[2]


def test_tensorcore_ops_do_not_grow_with_blocks():
    """TensorCore ops per call, from the HLO with loops counted per trip: the DMA kernels' stay a
    handful at 16, 64 and 1,000 blocks; the loop kernel's grow with every block (Qwen3-32B)."""
    d = DEPLOYMENTS[0]
    model, mesh = aot.MODELS[d[2]], aot.compile_only_mesh(d[0], d[1])
    caches = aot.kv_cache_avals(mesh, model, d[3], 128)
    for kernel in ("dma", "loop"):
        programs = aot.deployment_programs(caches, mesh, num_slots=1000, blocks_per_chunk=1, staging_blocks=d[5],
                                           kernel=kernel)
        for name in ("gather", "scatter"):
            hlo = getattr(programs, name)().as_text()
            ops = [aot.tensorcore_ops(hlo, n) for n in (16, 64, 1000)]
            if kernel == "dma":
                assert ops[0] == ops[1] == ops[2] <= 8, (name, ops)
            else:
                assert ops[2] > ops[1] > ops[0] >= 16, (name, ops)


def test_dma_count_per_call():
    """The counter tests and figures read: one DMA per (layer, run of adjacent blocks)."""
    programs = build(*DEPLOYMENTS[0])
    layers = len(programs.layout.groups[0].layers)
    n = programs.staging_blocks
    adjacent = [(np.arange(100, 100 + n), np.arange(n))]
    scattered = [(np.arange(n) * 2, np.arange(n))]
    assert programs.dma_count(adjacent, "gather") == layers
    assert programs.dma_count(adjacent, "scatter") == layers
    assert programs.dma_count(scattered, "gather") == n * layers


def test_host_slabs_updated_in_place(deployment):
    _, programs, figs = deployment
    slab = aot.slab_device_bytes(programs)
    st, ld = figs["store"], figs["load"]
    assert st.host_argument == st.host_alias >= slab and st.host_temp == 0
    assert ld.host_argument >= slab and ld.host_temp == 0 and ld.host_output == 0
    assert figs["alloc_slabs"].hbm_scratch < slab / 16  # zero slabs are not filled on HBM first


def test_start_up_check_uses_the_compiled_figures(deployment):
    """The connector's HBM check at registration reads these same programs' scratch."""
    _, programs, figs = deployment
    assert programs.scratch_bytes() == max(f.hbm_scratch for f in figs.values())


def test_replicated_heads_store_each_head_once():
    """Qwen2.5-7B's 4 KV heads at TP 8: every device keeps half of each block's tokens, so the
    host tier holds the model's real KV (not 8 copies of 4 heads)."""
    programs = build(*DEPLOYMENTS[3])
    g = programs.layout.groups[0]
    assert g.replicas == 2 and g.piece_shape[0] == 64
    assert programs.layout.block_bytes * 2 == programs.layout.replicated_block_bytes
    # the TPU variant permutes the slices in their own dtype; only XLA:CPU needs them as raw bits
    from tpu_offload.jax_backend.programs import collectives_as_bits

    assert not collectives_as_bits(programs.layout)
    assert "collective-permute" in programs.scatter().as_text()
    assert "bitcast-convert" not in programs.scatter().as_text()


def test_mla_latent_cache_is_stored_once():
    """DeepSeek-V3's latent cache is whole on every device of the model axis (8 copies at TP 8).
    Each device keeps an eighth of every block, so the host tier holds it once: bytes per token
    (all layers) against Llama-3.1-70B, a GQA model with 8 KV heads."""
    programs = build(*[d for d in DEPLOYMENTS if d[2] == "DeepSeek-V3"][0])
    g = programs.layout.groups[0]
    assert g.replica_axes == ("model",) and g.replicas == 8
    assert g.block_shape == (4, 32, 640)  # 128-token page, 32-token packing, 512 latent + 64 rope padded to 128
    per_token = programs.layout.block_bytes / 128
    assert per_token == 61 * 640 * 2  # 78 KiB: one copy
    assert programs.layout.replicated_block_bytes / 128 == per_token  # the cache's own spec is one copy too
    gqa = build(*DEPLOYMENTS[1]).layout.block_bytes / 128  # Llama-3.1-70B: 80 layers x 8 heads x 2 x 128 x 2
    assert gqa == 80 * 8 * 2 * 128 * 2 and per_token < gqa / 4
    assert "collective-permute" in programs.scatter().as_text()  # the copies are reassembled on load


def test_whole_deployment_compiles_in_seconds():
    """Start-up compiles every program once (no buckets): the deployment shape stays quick."""
    programs = build(*DEPLOYMENTS[0])
    figs = aot.measure(programs)
    assert set(figs) == {"gather", "scatter", "store", "load", "alloc_slabs"}
    assert sum(f.compile_s for f in figs.values()) < 120
    assert jax.devices()[0].platform == "cpu"  # the runtime never needed a TPU


# The device_put host path (opt-in) at one deployment per cache layout: KV heads split over the devices
# (the shipped Qwen3-32B), KV heads replicated over devices (Qwen2.5-7B), head_dim 64 (gpt-oss-120b), MLA
# (DeepSeek-V3), and the smaller chips. Its two programs have an array per staging chunk, so at 1,000
# chunks the TPU compiler takes 80-105 s per deployment: each deployment is compiled with a staging buffer
# of 1 chunk and of many, its own for the smaller chips, DEVICE_PUT_STAGING for the other TPU7x layouts;
# the shipped deployment at 1, 16, 64 and its own 1,000. (These programs always run over the whole staging
# buffer: a pass of fewer chunks costs a full one, docs/tpu/host-paths.md.) Llama-3.1-8B and -70B at TP 8 have
# Qwen3-32B's layout (8 KV heads of 128), Llama-3.1-70B at TP 16 Qwen2.5-7B's (each head on 2 devices).
DEVICE_PUT = [d for d in DEPLOYMENTS if d[2] != "Llama-3.1-70B" and d[:3] != ("TPU7x:2x2x1", 8, "Llama-3.1-8B")]
DEVICE_PUT_STAGING = 64
DEVICE_PUT_SIZES = [(d, s) for d in DEVICE_PUT  # the shipped deployment at 1, 16, 64 and its own staging
                    for s in ((1, 16, 64, d[5]) if d is DEPLOYMENTS[0] else
                              (1, d[5] if d[0] != "TPU7x:2x2x1" else DEVICE_PUT_STAGING))]


@pytest.mark.parametrize("d,staging", DEVICE_PUT_SIZES,
                         ids=[f"{IDS[DEPLOYMENTS.index(d)]}-staging{s}" for d, s in DEVICE_PUT_SIZES])
def test_device_put_path_programs_fit(d, staging):
    """The device_put host path's two extra programs, one call each per pass (slice every chunk out of
    staging for one batched device_put; write back the chunks one batched device_put brought) move
    a pass's chunks, nothing more: their outputs (take) are the chunks themselves, no scratch. HBM
    access is read every chunk once and write it once (2x the pass), with one chunk as with many;
    put_chunks has the compiler prefetch some chunks into on-chip memory first, which the cost model
    counts four more times (``aot.Figures.hbm_accessed``): half of a small pass, so 4x the pass in raw
    bytes accessed."""
    programs = build(*d[:5], staging)
    assert programs.staging_blocks == staging
    pass_bytes = programs.layout.device_block_bytes() * programs.staging_blocks
    figs = {n: aot.figures(n, getattr(programs, n), pass_bytes) for n in ("take_chunks", "put_chunks")}
    for f in figs.values():
        assert f.hbm_scratch <= 0.1 * pass_bytes and f.hbm_accessed <= 2.05 * pass_bytes, f
        assert f.host_argument == f.host_output == 0  # the host side is the runtime's device_put
    assert figs["take_chunks"].on_chip_prefetch == 0
    put = programs.put_chunks().memory_analysis()
    assert put.alias_size_in_bytes >= pass_bytes  # staging updated in place
    assert set(programs.all_programs("device_put")) == {"gather", "scatter", "take_chunks", "put_chunks"}


def test_the_on_chip_prefetch_is_read_from_the_hlo():
    """``aot.on_chip_prefetch`` counts a copy-start's destination in memory space 1 (VMEM), by its dtype
    and shape, and nothing in other spaces."""
    hlo = ("%copy-start.7 = (bf16[1,28,64,1,2,128]{5,4,3,2,1,0:T(2,128)(2,1)S(1)}, bf16[1,28,64,1,2,128]"
           "{5,4,3,2,1,0:T(2,128)(2,1)}, u32[]{:S(2)}) copy-start(%param.17), backend_config={}\n"
           "%copy-start.8 = (f32[4,8]{1,0:T(8,128)S(1)}, f32[4,8]{1,0}, u32[]{:S(2)}) copy-start(%p.2)\n"
           "%copy-start.9 = (f32[4,8]{1,0:T(8,128)S(5)}, f32[4,8]{1,0}, u32[]{:S(2)}) copy-start(%p.3)\n"
           "%add.1 = f32[4,8]{1,0:S(1)} add(%a, %b)\n")
    assert aot.on_chip_prefetch(hlo) == 28 * 64 * 2 * 128 * 2 + 4 * 8 * 4


def _deepseek_dp8():
    """DeepSeek-V3 as tpu-inference serves it on TPU7x:2x2x1: DP attention turns TP 8 into 8 attention-DP
    ranks (one latent head per device), the cache's blocks split over them, 2,000 pages each."""
    model = aot.MODELS["DeepSeek-V3"]
    mesh = aot.compile_only_mesh("TPU7x:2x2x1", 8, attn_dp=8)
    caches = aot.kv_cache_avals(mesh, model, 8 * 2000, 128)
    from tpu_offload.jax_backend.layout import KVLayout

    layout = KVLayout.from_caches(caches, mesh)
    num_slots = parse_bytes("720GiB") // layout.block_bytes // 8 * 8  # an equal partition per rank
    return aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=1, staging_blocks=1000)


@pytest.fixture(scope="module")
def deepseek_dp8():
    programs = _deepseek_dp8()
    return programs, aot.measure(programs)


def test_mla_under_dp_attention_stores_one_copy_in_place(deepseek_dp8):
    """Each block lives on one rank's device and stays there: the host tier holds it once (78 KiB per
    token, bf16), in the rows of that rank's partition, in its device's host memory, updated and read
    in place."""
    programs, figs = deepseek_dp8
    g = programs.layout.groups[0]
    assert g.block_axes == ("attn_dp",) and g.ranks == 8 and g.replicas == 1 and g.block_shape == (4, 32, 640)
    assert programs.layout.block_bytes / 128 == 61 * 640 * 2
    assert programs.layout.slab_sharding(g, "pinned_host").spec[0] == "attn_dp"
    assert aot.budget_failures(programs, figs) == []
    for f in figs.values():
        if f.program not in ("gather", "scatter", "load_cross"):
            assert f.hbm_scratch <= 64 << 20, (f.program, f.hbm_scratch, f.moved)


def _llama70b_dp2():
    """A dense model under DP attention: Llama-3.1-70B at TPU7x TP 8 as 2 attention-DP ranks of 4 devices,
    8,000 pages each; a rank's devices split its blocks' KV heads."""
    model = aot.MODELS["Llama-3.1-70B"]
    mesh = aot.compile_only_mesh("TPU7x:2x2x1", 8, attn_dp=2)
    caches = aot.kv_cache_avals(mesh, model, 2 * 8000, 128)
    from tpu_offload.jax_backend.layout import KVLayout

    layout = KVLayout.from_caches(caches, mesh)
    num_slots = parse_bytes("720GiB") // layout.block_bytes // 2 * 2
    return aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=1, staging_blocks=1000)


@pytest.fixture(scope="module")
def llama70b_dp2():
    programs = _llama70b_dp2()
    return programs, aot.measure(programs)


def test_dense_under_dp_attention_keeps_heads_per_rank(llama70b_dp2):
    """A dense model under DP attention: a rank's 4 devices split its blocks' KV heads (no copies), and
    each keeps its heads of its rank's blocks, in its own host memory."""
    programs, figs = llama70b_dp2
    g = programs.layout.groups[0]
    assert g.block_axes == ("attn_dp",) and g.ranks == 2 and g.replicas == 1 and g.head_shards == 4
    assert aot.budget_failures(programs, figs) == []


@pytest.mark.parametrize("shape", ["deepseek_dp8", "llama70b_dp2"])
def test_dp_attention_is_no_block_loop_within_the_budgets(shape, request):
    """Under DP attention each device DMAs its own rank's blocks (its local ids) into its own share of
    staging and back: no while loop, no collective at all (an all-to-all kernel relaid
    DeepSeek-V3's blocks: 2.0x scratch, 11x accessed; the loop kernel all-reduced every block per layer
    and trip: 61,000 all-reduces per pass), the same handful of TensorCore ops at 16, 64 and 1,000
    blocks, within the 1.1x scratch / 3x accessed budgets. Only a load into another rank crosses
    (``load_cross``): ``ranks - 1`` ppermutes of at most a quarter of a rank's share each, 3 to 4 such
    buffers of scratch (0.75x a device's staging at DP 2, 0.99x at DP 8): within one staging buffer."""
    programs, figs = request.getfixturevalue(shape)
    assert programs.kernel == "dma"
    for name in ("gather", "scatter"):
        hlo = getattr(programs, name)().as_text()
        assert not re.search(r"\bwhile\(", hlo), name
        assert re.search(r'custom_call_target="tpu_custom_call"', hlo), name
        assert not re.findall(r"(all-to-all|collective-permute|all-reduce|all-gather)(-start)?\(", hlo), name
        ops = [aot.tensorcore_ops(hlo, n) for n in (16, 64, 1000)]
        assert ops[0] == ops[1] == ops[2] <= 4, (name, ops)
        f = figs[name]
        assert f.moved == programs.staging_blocks * programs.layout.device_block_bytes()
        assert f.hbm_scratch <= 1.1 * f.moved and f.bytes_accessed <= 3 * f.moved, (name, f)
    for name in ("store", "load"):  # a rank's own chunks: no collective
        hlo = getattr(programs, name)().as_text()
        assert not re.findall(r"(all-to-all|collective-permute|all-reduce|all-gather)(-start)?\(", hlo), name
    hlo = programs.load(cross=True).as_text()
    assert len(re.findall(r"collective-permute(-start)?\(", hlo)) == programs.ranks - 1
    staging = programs.staging_blocks * programs.layout.device_block_bytes()
    assert figs["load_cross"].hbm_scratch <= (0.76 if programs.ranks == 2 else 1.0) * staging, figs["load_cross"]


@pytest.mark.parametrize("blocks", [16, 1000])
def test_default_path_pass_scales_with_what_it_moves(blocks):
    """The staging path (``program``: what ``auto`` runs on TPU where the direct kernel cannot, and its fallback;
    the direct kernel is test_direct_kernel.py), Qwen3-32B at TP 8 on TPU7x, a pass of ``blocks`` blocks,
    adjacent and scattered: every program it runs (gather, store; load, scatter) costs what the pass moves.
    Per device: HBM scratch <= 1.1x the pass; bytes accessed <= 3x for gather/scatter/store; nothing
    compiled or run at the full staging size (the staging buffer is only passed through, aliased); no
    loop over blocks in gather/scatter. The host copies (store/load) run one asynchronous copy per chunk
    in place in the slab (a loop over the pass's chunks: libtpu 0.0.48 refuses a Pallas DMA into host
    memory at a dynamic offset, LLO_CHECK multiplier_in_bytes % word_size); the load's in-place update
    of staging counts 4x in the cost model (a host-to-HBM copy, then the update read and written)."""
    from tpu_offload.connector.worker import transfer_path
    from tpu_offload.core.config import OffloadConfig
    from tpu_offload.selfcheck import pass_figures

    assert transfer_path(OffloadConfig(), [type("D", (), {"platform": "tpu"})()]) == "program"
    programs = build(*DEPLOYMENTS[0])
    figs = aot.measure(programs)
    layers = len(programs.layout.groups[0].layers)
    adjacent = [(np.arange(100, 100 + blocks), np.arange(blocks))]
    scattered = [(np.arange(blocks) * 7 + 3, np.arange(blocks))]
    for moves, runs in ((adjacent, 1), (scattered, blocks)):  # one DMA per (layer, run): what the pass moves
        assert programs.dma_count(moves, "gather") == runs * layers
        assert programs.dma_count(moves, "scatter") == runs * layers
    fig = pass_figures(programs, figs, blocks)
    assert fig["moved"] == blocks * (4 << 20)
    for name in ("gather", "scatter", "store", "load"):
        p = fig["programs"][name]
        assert p["scratch"] <= 1.1 * fig["moved"], (name, p)
        limit = 4.01 if name == "load" else 3.01  # 3x plus the index vectors the loop body reads
        assert p["hbm_accessed"] <= limit * fig["moved"], (name, p)
    staging = ",".join(map(str, (programs.staging_blocks, layers, *programs.layout.groups[0].piece_shape)))
    for name in ("gather", "scatter", "store", "load"):
        hlo = getattr(programs, name)().as_text()
        for line in hlo.splitlines():  # a full-staging-size value is only passed through, never made
            if f"[{staging}]" not in line.split("=", 1)[-1].split("(", 1)[0] or "=" not in line:
                continue
            op = aot._opcode(line)
            assert op in ("parameter", "get-tuple-element", "tuple", "bitcast", "custom-call", "while", "copy-start",
                          "copy-done", "opt-barrier") or "dynamic-update-slice" in line, (name, line[:200])
        if name in ("gather", "scatter"):
            assert not re.search(r"\bwhile\(", hlo) and aot.tensorcore_ops(hlo, blocks) <= 8, name
        else:  # one trip per chunk of the pass (each one asynchronous copy), never the staging buffer's count
            assert aot.tensorcore_ops(hlo, blocks) < aot.tensorcore_ops(hlo, programs.staging_blocks) or \
                blocks == programs.staging_blocks, name
