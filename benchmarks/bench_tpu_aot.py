"""Ours vs tpu-inference 0.32's offload, per pass, as the TPU compiler builds it and as each engine dispatches it.

libtpu compiles every program for a compile-only topology (no TPU needed) at the same model and KV cache
(tpu-inference's own ``create_kv_caches`` shape and sharding). Per pass of B blocks (1, 16, 64, 1,000),
adjacent or scattered, per direction, per device, for every path:

* ``dispatches``: programs launched plus runtime transfers outside any program (``device_put``, ``jnp.array``),
  counted by ``tpu_offload/testing/pass_counts.py`` from the code that dispatches them (its docstring cites
  tpu-inference's functions);
* ``steps``: engine steps the pass spans under its per-step budget (``core/step_budget.py``; the scheduler
  admits at most that per step and direction);
* ``waits``: blocking waits on the step thread (``block_until_ready``);
* HBM scratch (``temp_size_in_bytes``, the largest program of the pass);
* bytes accessed per pass ÷ bytes moved (a DMA kernel counted as reading and writing what it moves, the cost
  model's bytes for everything around it; a loop body once per trip; host bytes left out);
* compile seconds of the programs the pass needs (ours: compiled once for any B).

Paths:

* ours, direct (the TPU default here, ``registration.pick_path``): one Pallas kernel call per (layer group,
  slab) each step's part touches (``direct_dma.py``); adjacent blocks into adjacent slots: one call per
  step's part;
* ours, staging (``program``, paced): per step's part, the DMA gather (store) or scatter (load) and, per
  pacer piece (``transfer_piece_bytes``), one host-copy program per slab the piece touches;
* tpu-inference: ``stack_kv_cache_cross_layers`` / ``update_kv_caches`` per bucket (1..64; 1,000 = 15 x 64
  + 32 + 8), plus its per-block ``device_put``-s, its index arrays, and (load) its two ``block_until_ready``
  on the step thread;
* raw contiguous (host): one program copying B contiguous blocks of every layer to host memory
  (``dynamic_slice`` into a ``pinned_host`` output) or back (``dynamic_update_slice`` from a ``pinned_host``
  argument): the floor.

Adjacent: cache blocks 0..B-1 into slots 0..B-1; scattered: every other cache block into slots spread over
the whole tier (as many slabs as the pass can touch).

    python benchmarks/bench_tpu_aot.py [--topology TPU7x:2x2x1] [--tp 8] [--model Qwen3-32B] [--blocks 1 16 64 1000]
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
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from tpu_offload.connector import aot  # noqa: E402
from tpu_offload.core.config import OffloadConfig  # noqa: E402

MIB = 1 << 20


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
    """The floor: B contiguous blocks of every layer copied to host memory in one program, or from host memory
    into the caches, no block table."""
    spec = P(None, *tuple(caches[0].sharding.spec)[1:])
    host = NamedSharding(mesh, P(None, *spec), memory_kind="pinned_host")
    buf = jax.ShapeDtypeStruct((len(caches), n, *caches[0].shape[1:]), caches[0].dtype, sharding=host)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    cache_sh = tuple(c.sharding for c in caches)

    def read(cs, s):
        return jnp.stack([lax.dynamic_slice_in_dim(c, s, n, axis=0) for c in cs])

    def write(cs, b, s):
        b = jax.device_put(b, jax.memory.Space.Device)
        return tuple(lax.dynamic_update_slice_in_dim(c, b[i], s, axis=0) for i, c in enumerate(cs))

    gather = lambda: jax.jit(read, out_shardings=host).lower(tuple(caches), start).compile()
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

    from tpu_offload.connector.registration import pick_path
    from tpu_offload.jax_backend import direct_dma
    from tpu_offload.jax_backend.engine import plan_transfers
    from tpu_offload.jax_backend.layout import KVLayout
    from tpu_offload.selfcheck import pass_figures
    from tpu_offload.testing import pass_counts

    extra = json.load(open(args.config))["kv_connector_extra_config"]
    cfg = OffloadConfig.from_sources(extra, env={})
    model = aot.MODELS[args.model]
    mesh = aot.compile_only_mesh(args.topology, args.tp, attn_dp=args.attn_dp)
    caches = aot.kv_cache_avals(mesh, model, args.num_blocks, args.block_size)
    _, replicas = aot.padded_kv_heads(model, args.tp)
    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    bpc = cfg.blocks_per_chunk
    num_slots = cfg.resolve_num_chunks(layout.block_bytes * bpc) // args.attn_dp * args.attn_dp
    plan = plan_transfers(layout, num_slots=num_slots, blocks_per_chunk=bpc, staging_blocks=cfg.staging_blocks)
    programs = plan.programs
    path = pick_path("program", cfg, layout, platform="tpu")  # what the TPU runs by default here
    direct = (direct_dma.DirectPrograms(layout, blocks_per_chunk=bpc, slab_rows=programs.slab_rows,
                                        memory_kind=cfg.host_memory_kind, capacity=plan.staging_blocks)
              if path == "direct" else None)
    ours_count = pass_counts.Ours(plan, num_slots=num_slots, blocks_per_chunk=bpc,
                                  step_budget_bytes=cfg.step_budget_bytes, piece_bytes=cfg.transfer_piece_bytes,
                                  direct=direct)
    paced = programs.ranks == 1  # the pacer is off under attention DP (engine.pace)
    staging = aot.measure(programs)
    block = layout.device_block_bytes()
    dp = args.attn_dp > 1
    their: dict[int, list] = {}  # bucket -> [(store figures, ...), (load figures, ...)]: compiled once per bucket

    direct_figs = {}
    if direct is not None:
        for direction in ("store", "load"):
            build = functools.cache(lambda d=direction: getattr(direct, d)(0, programs.slab_rows[0]))
            direct_figs[direction] = aot.figures(f"direct_{direction}", build, block)

    def their_bucket(b):
        if b not in their:
            got = []
            for build in theirs(caches, mesh, b, dp):
                try:
                    got.append(aot.figures("theirs", functools.cache(build), b * block))
                except Exception as e:  # the compiler's own refusal is the result
                    got.append(str(e).splitlines()[0][:200])
            their[b] = got
        return their[b]

    rows = []
    for n in args.blocks:
        moved = n * block
        r_gather, r_scatter = raw(caches, mesh, n)
        raw_figs = {}
        for direction, build in (("store", r_gather), ("load", r_scatter)):
            try:
                raw_figs[direction] = aot.figures(direction, functools.cache(build), moved)
            except Exception as e:
                raw_figs[direction] = str(e).splitlines()[0][:200]
        for d, direction in enumerate(("store", "load")):
            kernel, host = ("gather", "store") if direction == "store" else ("scatter", "load")
            pf = pass_figures(programs, staging, n)["programs"]
            parts = [their_bucket(b)[d] for b in pass_counts.their_buckets(n)]
            for kind in ("adjacent", "scattered"):
                def row(who, count, scratch, accessed, compile_s, error=None):
                    r = {"direction": direction, "blocks": n, "pass": kind, "path": who, **count.to_dict()}
                    if error is not None:
                        return {**r, "error": error}
                    return {**r, "hbm_scratch_mib": scratch / MIB, "accessed_mib": accessed / MIB,
                            "moved_mib": moved / MIB, "accessed_per_moved": accessed / moved, "compile_s": compile_s}

                if direct is not None:
                    c = ours_count.direct(direction, n, kind)
                    f = direct_figs[direction]
                    # each call: its DMAs read and write what they move; around the kernel, its index operands
                    rows.append(row("ours (direct, default)", c, f.hbm_scratch, 2 * moved + c.programs * f.bytes_accessed,
                                    f.compile_s))
                c = ours_count.staging(direction, n, kind, paced=paced)
                rows.append(row("ours (staging)" if direct is not None else "ours (staging, default)", c,
                                max(pf[kernel]["scratch"], pf[host]["scratch"]),
                                pf[kernel]["hbm_accessed"] + pf[host]["hbm_accessed"],
                                staging[kernel].compile_s + staging[host].compile_s))
                c = pass_counts.theirs(n, direction, layer_groups=len(layout.groups), attn_dp=dp)
                errors = [f for f in parts if isinstance(f, str)]
                rows.append(row("tpu-inference", c, 0, 0, 0, errors[0]) if errors else
                            row("tpu-inference", c, max(f.hbm_scratch for f in parts),
                                sum(f.bytes_accessed for f in parts),
                                sum(their_bucket(b)[d].compile_s for b in set(pass_counts.their_buckets(n)))))
                f = raw_figs[direction]
                rows.append(row("raw contiguous (host)", pass_counts.floor(), 0, 0, 0, f) if isinstance(f, str) else
                            row("raw contiguous (host)", pass_counts.floor(), f.hbm_scratch, f.bytes_accessed, f.compile_s))
    cols = ["direction", "blocks", "pass", "path", "dispatches", "programs", "transfers", "steps", "waits",
            "hbm_scratch_mib", "accessed_per_moved", "compile_s"]
    dpx = f" = attention DP {args.attn_dp}" if dp else ""
    title = (f"{args.model} on {args.topology} (TP {args.tp}{dpx}), {args.num_blocks} blocks of {args.block_size} tokens, "
             f"per device, per pass; ours: {len(programs.slab_rows)} host slabs of {programs.slab_rows[0]} rows, "
             f"step budget {cfg.step_budget_bytes / 1e6:.0f} MB per device = {ours_count.step_blocks} blocks")
    print_table(rows, cols, title=title)
    total = sum(f.compile_s for f in staging.values()) + sum(f.compile_s for f in direct_figs.values())
    print(f"ours: every program compiled in {total:.1f} s; budget failures: {aot.budget_failures(programs, staging) or 'none'}")
    name = "tpu_aot" if not dp else f"tpu_aot_dp{args.attn_dp}"
    write_json(name, {"topology": args.topology, "tp": args.tp, "attn_dp": args.attn_dp, "model": args.model,
                      "num_blocks": args.num_blocks, "block_size": args.block_size, "path": path,
                      "step_budget_bytes": cfg.step_budget_bytes, "step_blocks": ours_count.step_blocks,
                      "piece_bytes": cfg.transfer_piece_bytes, "slab_rows": list(programs.slab_rows),
                      "rows": rows, "ours_compile_s_total": total,
                      "ours_programs": {k: v.to_dict() for k, v in {**staging, **direct_figs}.items()}})
    _plot(rows, title, name)


def _plot(rows, title, name):
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if "error" not in r and r["pass"] == "scattered"]
    paths = list(dict.fromkeys(r["path"] for r in ok))
    groups = sorted({(r["direction"], r["blocks"]) for r in ok})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(paths))
    for i, p in enumerate(paths):
        vals = [next((r["dispatches"] for r in ok if (r["direction"], r["blocks"]) == g and r["path"] == p), 0)
                for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=p)
    ax.set_xticks([x + width for x in range(len(groups))], [f"{d}\n{b} blocks" for d, b in groups])
    ax.set_yscale("log")
    ax.set_ylabel("dispatches per pass (scattered)")
    ax.set_title(title, fontsize=7)
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
