"""Ours vs tpu-inference 0.32's offload programs, as the TPU compiler builds them (no TPU needed).

libtpu compiles both for a compile-only topology at the same model, KV cache
(tpu-inference's own ``create_kv_caches`` shape and sharding) and block
counts, and reports per device:

* HBM scratch (``temp_size_in_bytes``): what the program needs on top of its arguments;
* bytes accessed (``cost_analysis``), and that ÷ the bytes the call moves;
* compile seconds.

* TensorCore ops per call, from the optimized HLO with every ``while`` body counted once per
  trip (``aot.tensorcore_ops``; a fusion or a kernel is one op);
* DMAs the call's kernels issue (B blocks in one run of adjacent blocks / B scattered blocks).

Paths compared, per direction:

* gather (HBM cache -> contiguous buffer, the first half of a store):
  ours: the DMA kernel (``dma``, the TPU default) and the ``loop`` kernel, each one program for
  any count; tpu-inference: ``stack_kv_cache_cross_layers`` (its save path; one program per block
  count); raw: a contiguous ``dynamic_slice`` of B blocks from every layer (the floor: no block
  table, nothing to gather).
* scatter (contiguous buffer -> HBM cache, the last half of a load):
  ours: ``dma`` and ``loop``; tpu-inference: ``update_kv_caches`` (its load path: concatenate
  the per-block arrays, unstack the layers, ``multi_layer_copy``'s start and wait kernels per
  layer); raw: one contiguous ``dynamic_update_slice`` of B blocks into every layer.

``cost_analysis`` counts a loop body once and does not see inside a kernel,
so bytes accessed are reported as the compiler gives them.

    python benchmarks/bench_tpu_aot.py [--topology TPU7x:2x2x1] [--tp 8] [--model Qwen3-32B] [--blocks 16 64 1000]
    python benchmarks/bench_tpu_aot.py --model DeepSeek-V3 --attn-dp 8 --num-blocks 16000   # as tpu-inference serves it
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
os.environ.setdefault("NEW_MODEL_DESIGN", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip to share
os.environ["VLLM_PLUGINS"] = ""
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "tests", "tpu_engine")]

import cpu_support  # noqa: E402

cpu_support.prepare_vllm()  # vLLM's kernels for this CPU, torchax, tpu-inference's platform

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from tpu_offload.connector import aot  # noqa: E402
from tpu_offload.core.config import OffloadConfig  # noqa: E402

MIB = 1 << 20


def theirs(caches, mesh, n: int, block_size: int):
    """tpu-inference 0.32's own save-path gather and load-path scatter, lowered for ``n`` blocks."""
    from tpu_inference.offload.utils import stack_kv_cache_cross_layers, update_kv_caches

    rep = NamedSharding(mesh, P())
    ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
    spec = tuple(caches[0].sharding.spec)[1:]
    stacked = jax.ShapeDtypeStruct((1, len(caches), *caches[0].shape[1:]), caches[0].dtype,
                                   sharding=NamedSharding(mesh, P(None, None, *spec)))
    gather = lambda: stack_kv_cache_cross_layers.lower(caches, ids, num_blocks=n).compile()
    scatter = lambda: update_kv_caches.lower(
        caches, [stacked] * n, ids, ids, ids, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep), mesh=mesh,
        src_sharding_spec=P(None, *spec), dest_sharding_spec=caches[0].sharding.spec,
        replicated_sharding_spec=P()).compile()
    return gather, scatter


def raw(caches, mesh, n: int):
    """The floor: B contiguous blocks of every layer, sliced out or written in, no block table."""
    spec = P(None, *tuple(caches[0].sharding.spec)[1:])
    buf = jax.ShapeDtypeStruct((len(caches), n, *caches[0].shape[1:]), caches[0].dtype,
                               sharding=NamedSharding(mesh, P(None, *spec)))
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    out_sh = buf.sharding
    cache_sh = tuple(c.sharding for c in caches)

    def read(cs, s):
        return jnp.stack([lax.dynamic_slice_in_dim(c, s, n, axis=0) for c in cs])

    def write(cs, b, s):
        return tuple(lax.dynamic_update_slice_in_dim(c, b[i], s, axis=0) for i, c in enumerate(cs))

    gather = lambda: jax.jit(read, out_shardings=out_sh).lower(tuple(caches), start).compile()
    scatter = lambda: jax.jit(write, donate_argnums=(0,), out_shardings=cache_sh).lower(tuple(caches), buf, start).compile()
    return gather, scatter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="TPU7x:2x2x1")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--model", default="Qwen3-32B", choices=sorted(aot.MODELS))
    ap.add_argument("--num-blocks", type=int, default=20000, help="blocks in the KV cache (per layer)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tpu-inference", "offload.json"))
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 1000], help="blocks moved per call")
    ap.add_argument("--attn-dp", type=int, default=1,
                    help="attention-DP ranks the TP devices form (DeepSeek-V3 as tpu-inference serves it: --tp 8 --attn-dp 8)")
    args = ap.parse_args()

    import json

    extra = json.load(open(args.config))["kv_connector_extra_config"]
    cfg = OffloadConfig.from_sources(extra, env={})
    model = aot.MODELS[args.model]
    mesh = aot.compile_only_mesh(args.topology, args.tp, attn_dp=args.attn_dp)
    caches = aot.kv_cache_avals(mesh, model, args.num_blocks, args.block_size)
    _, replicas = aot.padded_kv_heads(model, args.tp)
    from tpu_offload.jax_backend.layout import KVLayout

    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    num_slots = cfg.resolve_num_chunks(layout.block_bytes * cfg.blocks_per_chunk) // args.attn_dp * args.attn_dp
    programs = aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=cfg.blocks_per_chunk,
                                       staging_blocks=cfg.staging_blocks, head_replicas=replicas)
    ours = aot.measure(programs)
    loop = aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=cfg.blocks_per_chunk,
                                   staging_blocks=cfg.staging_blocks, head_replicas=replicas, kernel="loop")
    loop_figs = {k: aot.figures(k, getattr(loop, k), 1) for k in ("gather", "scatter")}
    block = layout.device_block_bytes()
    layers = len(caches)
    rows = []
    for n in args.blocks:
        moved = n * block
        adjacent = [_blocks(programs, n, 1)] * len(layout.groups)
        scattered = [_blocks(programs, n, 2)] * len(layout.groups)
        t_gather, t_scatter = theirs(caches, mesh, n, args.block_size)
        r_gather, r_scatter = raw(caches, mesh, n)
        for direction, t_build, r_build in (("gather", t_gather, r_gather), ("scatter", t_scatter, r_scatter)):
            if n <= programs.staging_blocks:  # one call of ours moves at most a staging buffer
                for who, prog, fig in (("ours (dma)", programs, ours[direction]),
                                       ("ours (loop)", loop, loop_figs[direction])):
                    hlo = getattr(prog, direction)().as_text()
                    dmas = (prog.dma_count(adjacent, direction), prog.dma_count(scattered, direction))
                    rows.append(_row(direction, n, who, fig.hbm_scratch, fig.bytes_accessed, moved, fig.compile_s,
                                     "once, any B", aot.tensorcore_ops(hlo, n), dmas))
            their_dmas = (layers, n * layers) if direction == "scatter" else (0, 0)  # multi_layer_copy: per run
            for who, build, dmas in (("tpu-inference", t_build, their_dmas), ("raw contiguous", r_build, (0, 0))):
                build = functools.cache(build)  # compiled once: for the figures and for the HLO
                try:
                    f = aot.figures(direction, build, moved)
                    rows.append(_row(direction, n, who, f.hbm_scratch, f.bytes_accessed, moved, f.compile_s,
                                     "per B", aot.tensorcore_ops(build().as_text(), n), dmas))
                except Exception as e:  # the compiler's own refusal (e.g. RESOURCE_EXHAUSTED) is the result
                    rows.append({"direction": direction, "blocks": n, "path": who, "error": str(e).splitlines()[0][:200]})
    cols = ["direction", "blocks", "path", "tensorcore_ops", "dmas_adjacent", "dmas_scattered", "hbm_scratch_mib",
            "accessed_mib", "moved_mib", "accessed_per_moved", "compile_s", "compiles"]
    dp = f" = attention DP {args.attn_dp}" if args.attn_dp > 1 else ""
    title = (f"{args.model} on {args.topology} (TP {args.tp}{dp}), {args.num_blocks} blocks of {args.block_size} tokens, "
             f"per device; ours: {len(programs.slab_rows)} host slabs, staging {programs.staging_blocks} blocks")
    print_table(rows, cols, title=title)
    extra_rows = [{"program": k, "hbm_scratch_mib": v.hbm_scratch / MIB, "host_argument_mib": v.host_argument / MIB,
                   "host_alias_mib": v.host_alias / MIB, "host_temp_mib": v.host_temp / MIB, "compile_s": v.compile_s}
                  for k, v in ours.items() if k in ("store", "load", "load_cross", "alloc_slabs")]
    print_table(extra_rows, title="ours, host side (one call per slab a pass touches)")
    total = sum(f.compile_s for f in ours.values())
    print(f"ours: every program compiled in {total:.1f} s; budget failures: {aot.budget_failures(programs, ours) or 'none'}")
    write_json("tpu_aot" if args.attn_dp == 1 else f"tpu_aot_dp{args.attn_dp}",
               {"topology": args.topology, "tp": args.tp, "attn_dp": args.attn_dp, "model": args.model, "num_blocks": args.num_blocks,
                           "block_size": args.block_size, "rows": rows, "ours_host": extra_rows,
                           "ours_compile_s_total": total, "ours_programs": {k: v.to_dict() for k, v in ours.items()}})
    _plot(rows, title, "tpu_aot" if args.attn_dp == 1 else f"tpu_aot_dp{args.attn_dp}")


def _row(direction, n, who, scratch, accessed, moved, compile_s, compiles, ops, dmas):
    return {"direction": direction, "blocks": n, "path": who, "tensorcore_ops": ops, "dmas_adjacent": dmas[0],
            "dmas_scattered": dmas[1], "hbm_scratch_mib": scratch / MIB,
            "accessed_mib": accessed / MIB, "moved_mib": moved / MIB, "accessed_per_moved": accessed / moved,
            "compile_s": compile_s, "compiles": compiles}


def _blocks(programs, n: int, stride: int):
    """(block ids, staging positions) of ``n`` blocks, ``stride`` apart in the cache (1: one run). Under DP
    attention, n / ranks blocks of each rank, into its own share of staging."""
    d = programs.ranks
    per, share, k = programs.layout.num_blocks // d, programs.staging_blocks // d, n // d
    ids = np.concatenate([r * per + np.arange(k) * stride for r in range(d)])
    return ids, np.concatenate([r * share + np.arange(k) for r in range(d)])


def _plot(rows, title, name):
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if "error" not in r]
    paths = ["ours (dma)", "ours (loop)", "tpu-inference", "raw contiguous"]
    groups = sorted({(r["direction"], r["blocks"]) for r in ok})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        vals = [next((max(1, r["tensorcore_ops"]) for r in ok if (r["direction"], r["blocks"]) == g and r["path"] == p),
                     0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=p)
    ax.set_xticks([x + width for x in range(len(groups))], [f"{d}\n{b} blocks" for d, b in groups])
    ax.set_yscale("log")
    ax.set_ylabel("TensorCore ops per call (loops per trip)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
