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

Per pass of B blocks (1, 16, 64, 1,000 by default), per direction, every program the pass runs:

* store (HBM cache -> host):
  ours (program path, the default everywhere): the DMA gather, then one host-copy trip per chunk
  (``store``); ours (device_put path, opt-in): the DMA gather, then ``take_chunks`` (the whole staging
  buffer, every pass) and a runtime ``device_put`` per chunk; tpu-inference: its save path as its
  connector runs it, ``stack_kv_cache_cross_layers`` (``pure_jax_...`` under DP attention) compiled
  for its block buckets (``TPU_OFFLOAD_BLOCK_SIZE_BUCKETS``: 1..64) with B decomposed into them
  (1,000 = 15 x 64 + 32 + 8), chunk = one block, then a runtime ``device_put`` per block;
  raw: one contiguous ``dynamic_slice`` of B blocks from every layer (the floor).
* load (host -> HBM cache): ours: one host-copy trip per chunk (``load``), then the DMA scatter;
  device_put: ``put_chunks`` (the whole staging buffer) then the scatter; tpu-inference:
  ``update_kv_caches_one`` (``pure_jax_update_kv_caches_one`` under DP attention) per bucket; raw: one
  contiguous ``dynamic_update_slice``.

A DMA kernel is counted as reading and writing what it moves (the cost model sees ~0 inside it); a
loop body is counted once per trip (the cost model counts it once); host bytes are left out of ours.
``launches``: programs per pass (runtime transfers not counted).

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
sys.path[:0] = [HERE, ROOT]

from tpu_offload.testing import cpu_support  # noqa: E402

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


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tpu-inference 0.32's TPU_OFFLOAD_BLOCK_SIZE_BUCKETS default


def buckets(n: int) -> list[int]:
    """tpu-inference's ``_decompose_into_buckets``: greedy, largest bucket first."""
    out = []
    for b in sorted(BUCKETS, reverse=True):
        while n >= b:
            out.append(b)
            n -= b
    return out


def theirs(caches, mesh, n: int, dp: bool):
    """tpu-inference 0.32's save-path gather and load-path insert for ``n`` blocks (one bucket), the
    variants its connector calls (``pure_jax_*`` under DP attention)."""
    from tpu_inference.offload import utils

    rep = NamedSharding(mesh, P())
    ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
    spec = tuple(caches[0].sharding.spec)[1:]
    group = (tuple(range(len(caches))),)
    stacked = jax.ShapeDtypeStruct((1, len(caches), *caches[0].shape[1:]), caches[0].dtype,
                                   sharding=NamedSharding(mesh, P(None, None, *spec)))
    if dp:
        gather = lambda: utils.pure_jax_stack_kv_cache_cross_layers.lower(caches, ids, num_blocks=n,
                                                                          grouped_indices=group).compile()
        scatter = lambda: utils.pure_jax_update_kv_caches_one.lower(
            caches, [stacked] * n, ids, mesh=mesh, cached_kv_sharding_spec=caches[0].sharding.spec,
            indices_sharding=rep, grouped_indices=group).compile()
    else:
        gather = lambda: utils.stack_kv_cache_cross_layers.lower(caches, ids, num_blocks=n,
                                                                 grouped_indices=group).compile()
        scatter = lambda: utils.update_kv_caches.lower(
            caches, [stacked] * n, ids, ids, ids, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep), mesh=mesh,
            src_sharding_spec=P(None, *spec), dest_sharding_spec=caches[0].sharding.spec,
            replicated_sharding_spec=P(), grouped_indices=group).compile()
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
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 64, 1000], help="blocks moved per pass")
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
    from tpu_offload.selfcheck import pass_figures

    ours = aot.measure(programs)
    dput = aot.measure(programs, "device_put") if programs.ranks == 1 else None
    block = layout.device_block_bytes()
    layers = len(caches)
    rows = []
    their = {}  # bucket -> (gather figures, scatter figures, gather ops, scatter ops)
    dp = args.attn_dp > 1

    def their_bucket(b):
        if b not in their:
            got = []
            for build in theirs(caches, mesh, b, dp):
                build = functools.cache(build)
                try:
                    f = aot.figures("theirs", build, b * block)
                    got.append((f, aot.tensorcore_ops(build().as_text(), b)))
                except Exception as e:  # the compiler's own refusal is the result
                    got.append((str(e).splitlines()[0][:200], 0))
            their[b] = got
        return their[b]

    for n in args.blocks:
        moved = n * block
        trips = -(-n // programs.bpc)
        adjacent = [_blocks(programs, n, 1)] * len(layout.groups)
        scattered = [_blocks(programs, n, 2)] * len(layout.groups)
        r_gather, r_scatter = raw(caches, mesh, n)
        for d, (direction, wrapper, host) in enumerate((("store", "take_chunks", "store"),
                                                         ("load", "put_chunks", "load"))):
            kernel = "gather" if direction == "store" else "scatter"
            dmas = (programs.dma_count(adjacent, kernel), programs.dma_count(scattered, kernel))
            if n <= programs.staging_blocks:
                pf = pass_figures(programs, ours, n)["programs"]
                ops = (aot.tensorcore_ops(getattr(programs, kernel)().as_text(), n)
                       + aot.tensorcore_ops(getattr(programs, host)().as_text(), trips))
                rows.append(_row(direction, n, "ours (program, default)", max(pf[kernel]["scratch"], pf[host]["scratch"]),
                                 pf[kernel]["hbm_accessed"] + pf[host]["hbm_accessed"], moved,
                                 ours[kernel].compile_s + ours[host].compile_s, "once, any B", ops, dmas, 2))
                if dput is not None:
                    pd = pass_figures(programs, dput, n, "device_put")["programs"]
                    ops = (aot.tensorcore_ops(getattr(programs, kernel)().as_text(), n)
                           + aot.tensorcore_ops(getattr(programs, wrapper)().as_text(), n))
                    rows.append(_row(direction, n, "ours (device_put, opt-in)",
                                     max(pd[kernel]["scratch"], pd[wrapper]["scratch"]),
                                     pd[kernel]["hbm_accessed"] + pd[wrapper]["hbm_accessed"], moved,
                                     dput[kernel].compile_s + dput[wrapper].compile_s, "once, any B", ops, dmas, 2))
            parts = [their_bucket(b)[d] for b in buckets(n)]
            errors = [f for f, _ in parts if isinstance(f, str)]
            if errors:
                rows.append({"direction": direction, "blocks": n, "path": "tpu-inference", "error": errors[0]})
            else:
                their_dmas = (layers * len(parts), n * layers) if direction == "load" else (0, 0)
                rows.append(_row(direction, n, "tpu-inference", max(f.hbm_scratch for f, _ in parts),
                                 sum(f.bytes_accessed for f, _ in parts), moved,
                                 sum(their_bucket(b)[d][0].compile_s for b in set(buckets(n))),
                                 f"per bucket {sorted(set(buckets(n)), reverse=True)}", sum(o for _, o in parts),
                                 their_dmas, len(parts)))
            build = functools.cache(r_gather if direction == "store" else r_scatter)
            try:
                f = aot.figures(direction, build, moved)
                rows.append(_row(direction, n, "raw contiguous", f.hbm_scratch, f.bytes_accessed, moved, f.compile_s,
                                 "per B", aot.tensorcore_ops(build().as_text(), n), (0, 0), 1))
            except Exception as e:
                rows.append({"direction": direction, "blocks": n, "path": "raw contiguous",
                             "error": str(e).splitlines()[0][:200]})
    cols = ["direction", "blocks", "path", "launches", "tensorcore_ops", "dmas_adjacent", "dmas_scattered",
            "hbm_scratch_mib", "accessed_mib", "moved_mib", "accessed_per_moved", "compile_s", "compiles"]
    dp = f" = attention DP {args.attn_dp}" if args.attn_dp > 1 else ""
    title = (f"{args.model} on {args.topology} (TP {args.tp}{dp}), {args.num_blocks} blocks of {args.block_size} tokens, "
             f"per device, per pass; ours: {len(programs.slab_rows)} host slabs, staging {programs.staging_blocks} blocks")
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


def _row(direction, n, who, scratch, accessed, moved, compile_s, compiles, ops, dmas, launches):
    return {"direction": direction, "blocks": n, "path": who, "launches": launches, "tensorcore_ops": ops,
            "dmas_adjacent": dmas[0],
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
    paths = ["ours (program, default)", "ours (device_put, opt-in)", "tpu-inference", "raw contiguous"]
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
