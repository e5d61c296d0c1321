"""HBM <-> host transfer bandwidth: our path vs raw device_put vs tpu-inference's.

One run, same bytes per step for every path, swept over engine block sizes:

* ours      gather into the HBM staging buffer + one jitted batched D2H into
            the preallocated host slab (store); one batched H2D into staging
            + one scatter (load). 2 dispatches per step each way.
* ours, device_put path  the same gather/scatter, but each chunk is sliced out
            of staging and sent by a runtime ``device_put`` to its own host array
            (the TPU default: the DMA overlaps the next forward there).
* raw       one ``jax.device_put`` of the step's bytes, already contiguous
            (the ceiling any batched path can reach; it does no gather).
* one program, new host array  a single jitted gather whose output lives in
            host memory (and its reverse): what one program per direction
            reaches when it need not write a preallocated slab in place.
* tpu-inf   tpu-inference 0.32's own functions (``tpu_inference.offload.utils``):
            its bucketed cross-layer gather, then one ``device_put`` to host
            per block (store); one ``device_put`` per block, then its scatter
            (load). The pure-JAX scatter is used: the Pallas one needs a TPU.

Runs unchanged on CPU (emulated devices) and JAX-CUDA/TPU (``pinned_host``).
CPU numbers measure host memcpy, not PCIe/ICI; they show dispatch overhead,
not accelerator bandwidth.

    python benchmarks/bench_jax_transfer.py [--quick] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Emulated devices for the CPU backend (ignored by GPU/TPU); must be set before jax is imported.
_n = sys.argv[sys.argv.index("--cpu-devices") + 1] if "--cpu-devices" in sys.argv else "8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine  # noqa: E402

TPU_INF_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # TPU_OFFLOAD_BLOCK_SIZE_BUCKETS default


def timed(fn, reps: int) -> list[float]:
    fn()  # warm-up (compiles)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def decompose(n: int) -> list[int]:
    """tpu-inference's greedy split of a block count into its buckets."""
    out = []
    while n:
        b = max(x for x in TPU_INF_BUCKETS if x <= n)
        out.append(b)
        n -= b
    return out


class Case:
    def __init__(self, mesh, memory_kind, dtype, layers, kv_heads, head_dim, block_tokens, step_bytes, blocks=None):
        self.mesh, self.kind = mesh, memory_kind
        heads = 2 * kv_heads
        self.block_bytes = layers * block_tokens * heads * head_dim * jnp.dtype(dtype).itemsize
        self.n = blocks or max(1, step_bytes // self.block_bytes)  # blocks per step
        self.nbytes = self.n * self.block_bytes
        nb = 2 * self.n + 8
        self.cache_sh = NamedSharding(mesh, P(None, None, "model", None))
        key = jax.random.key(block_tokens)
        self.kv = [jax.device_put(jax.random.normal(k, (nb, block_tokens, heads, head_dim)).astype(dtype), self.cache_sh)
                   for k in jax.random.split(key, layers)]
        rng = np.random.default_rng(block_tokens)
        self.src = rng.permutation(nb // 2)[: self.n].tolist()
        self.dst = (nb // 2 + rng.permutation(nb // 2 - 4)[: self.n]).tolist()
        self.layers, self.heads, self.dim, self.bt, self.dtype = layers, heads, head_dim, block_tokens, dtype
        self.kernel = None  # the platform's default (programs.default_kernel)

    # ---- ours -------------------------------------------------------------
    def ours(self, reps, path="program"):
        eng = TransferEngine(KVLayout.from_caches(self.kv), num_slots=self.n, blocks_per_chunk=1,
                             staging_blocks=self.n, memory_kind=self.kind, path=path, kernel=self.kernel)
        eng.precompile()
        store = [StoreChunk(i, [b]) for i, b in enumerate(self.src)]
        load = [LoadChunk(i, [b]) for i, b in enumerate(self.dst)]
        st = timed(lambda: jax.block_until_ready(eng.store(self.kv, store)), reps)
        eng.complete_store(range(self.n), True)

        def do_load():
            self.kv, done = eng.load(self.kv, load)
            done.block_until_ready()

        ld = timed(do_load, reps)
        ok = all(np.array_equal(np.asarray(c)[self.dst].view(np.uint8), np.asarray(c)[self.src].view(np.uint8))
                 for c in self.kv)
        if path == "program":  # the batched host-copy programs alone: the part that crosses PCIe on an accelerator
            every = [np.arange(self.n)] * len(eng.layout.groups)  # slots 0..n-1 from staging chunks 0..n-1
            args = eng.programs.store_args(0, every, every)
            store_prog, load_prog = eng.programs.store(), eng.programs.load()

            def xfer_store():
                new, done = store_prog(tuple(g[0] for g in eng.slabs), eng.staging, *args)
                eng._set_slab(0, new)
                done.block_until_ready()

            def xfer_load():
                eng.staging, done = load_prog(eng.staging, tuple(g[0] for g in eng.slabs), *args)
                done.block_until_ready()

            self.xfer = (timed(xfer_store, reps), timed(xfer_load, reps), 1, 1, True)
            # ... and the gather and scatter alone: the part that stays on the device
            groups = len(eng.layout.groups)
            gather, scatter = eng.programs.gather(), eng.programs.scatter()
            gargs = eng.programs.block_args([(np.asarray(self.src), np.arange(self.n))] * groups, "gather")
            sargs = eng.programs.block_args([(np.asarray(self.dst), np.arange(self.n))] * groups, "scatter")

            def dev_store():
                eng.staging = gather(tuple(self.kv), eng.staging, *gargs)
                jax.block_until_ready(eng.staging)

            def dev_load():
                caches, done = scatter(tuple(self.kv), eng.staging, *sargs)
                self.kv = list(caches)
                done.block_until_ready()

            self.dev_stage = (timed(dev_store, reps), timed(dev_load, reps), 1, 1, True)
        del eng
        return (st, ld, 2, 2, ok) if path == "program" else (st, ld, 1 + 2 * self.n, 2 * self.n + 1, ok)

    # ---- raw device_put ---------------------------------------------------
    def raw(self, reps):
        sh = NamedSharding(self.mesh, P(None, None, None, "model", None))
        staged = jax.device_put(jnp.zeros((self.n, self.layers, self.bt, self.heads, self.dim), self.dtype), sh)
        host_sh = sh.with_memory_kind(self.kind)
        st = timed(lambda: jax.device_put(staged, host_sh).block_until_ready(), reps)
        on_host = jax.device_put(staged, host_sh)
        ld = timed(lambda: jax.device_put(on_host, sh).block_until_ready(), reps)
        return st, ld, 1, 1, True

    # ---- one program per direction, output not in place ----------------------------
    def one_program(self, reps):
        sh = NamedSharding(self.mesh, P(None, None, None, "model", None))
        host_sh, src = sh.with_memory_kind(self.kind), jnp.asarray(self.src)
        gather = jax.jit(lambda kv, ids: jnp.stack([c[ids] for c in kv], axis=1), out_shardings=host_sh)
        to_dev = jax.jit(lambda x: x, out_shardings=sh)
        st = timed(lambda: gather(self.kv, src).block_until_ready(), reps)
        on_host = gather(self.kv, src)
        ld = timed(lambda: to_dev(on_host).block_until_ready(), reps)
        ok = np.array_equal(np.asarray(on_host)[:, 0].view(np.uint8), np.asarray(self.kv[0])[self.src].view(np.uint8))
        return st, ld, 1, 1, ok

    # ---- tpu-inference ----------------------------------------------------
    def tpu_inference(self, reps, utils):
        spec = self.cache_sh.spec
        exp = P(None, None, *spec[1:])
        host_sh = NamedSharding(self.mesh, exp, memory_kind=self.kind)
        dev_sh = NamedSharding(self.mesh, exp, memory_kind="device")
        idx_sh = NamedSharding(self.mesh, P(), memory_kind="device")
        parts = decompose(self.n)
        box = {"kv": self.kv, "host": None}

        def store():
            out, off = [], 0
            kv = box["kv"]
            for b in parts:  # its bucketed gather (one call per bucket), then one device_put per block
                kv, blocks = utils.stack_kv_cache_cross_layers(kv, jnp.array(self.src[off:off + b]), b)
                out.extend(jax.device_put(x, host_sh) for x in blocks)
                off += b
            box["kv"] = kv
            jax.block_until_ready(out)
            box["host"] = out

        st = timed(store, reps)

        def load():
            on_dev = [jax.device_put(x, dev_sh) for x in box["host"]]
            jax.block_until_ready(on_dev)
            kv, off = box["kv"], 0
            for b in parts:
                kv = utils.pure_jax_update_kv_caches_one(kv, on_dev[off:off + b], self.dst[off:off + b], self.mesh,
                                                         spec, idx_sh)
                off += b
            jax.block_until_ready(kv)
            box["kv"] = kv

        ld = timed(load, reps)
        self.kv = box["kv"]
        ok = all(np.array_equal(np.asarray(c)[self.dst].view(np.uint8), np.asarray(c)[self.src].view(np.uint8))
                 for c in self.kv)
        return st, ld, len(parts) + self.n, self.n + 2 * len(parts), ok


def load_tpu_inference():
    try:
        from tpu_inference.offload import utils  # imports vLLM; needs tpu-inference's sources only
        return utils
    except Exception as e:  # not installed (e.g. a CUDA box): the column is left out
        print(f"tpu-inference path unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--step-mib", type=int, default=64, help="bytes moved per step and direction")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU (XLA:CPU widens bf16 scatters), else bfloat16")
    ap.add_argument("--memory-kind", default="pinned_host")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-devices", type=int, default=8, help="emulated devices when running on CPU")
    ap.add_argument("--quick", action="store_true", help="2 block sizes, 16 MiB steps, 3 reps")
    ap.add_argument("--pass-blocks", type=int, nargs="*", default=[],
                    help="passes of exactly these many blocks (scattered), instead of --step-mib")
    ap.add_argument("--skip-device-put-path", action="store_true", help="leave out the per-chunk device_put path")
    ap.add_argument("--out", default="jax_transfer", help="result name under benchmarks/results")
    ap.add_argument("--kernel", default=None, choices=["dma", "loop", "xla"], help="default: the platform's")
    args = ap.parse_args()
    if args.quick:
        args.block_tokens, args.step_mib, args.reps = [16, 128], 16, 3
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    devices = jax.devices()
    mesh = jax.make_mesh((1, len(devices)), ("data", "model"))
    utils = load_tpu_inference()
    rows, records = [], []
    for bt, blocks in [(bt, b) for bt in args.block_tokens for b in (args.pass_blocks or [None])]:
        case = Case(mesh, args.memory_kind, dtype, args.layers, args.kv_heads, args.head_dim, bt, args.step_mib << 20,
                    blocks)
        case.kernel = args.kernel
        results = {"raw": case.raw(args.reps), "ours": case.ours(args.reps)}
        results["ours (copy stage)"] = case.xfer
        results["ours (device stage)"] = case.dev_stage
        if not args.skip_device_put_path:
            results["ours, device_put path"] = case.ours(args.reps, path="device_put")
        results["one program, new host array"] = case.one_program(args.reps)
        if utils is not None:
            results["tpu-inference"] = case.tpu_inference(args.reps, utils)
        med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in results.items()}
        for k, (st, ld) in med.items():
            row = {"block tokens": bt, "blocks/step": case.n, "path": k,
                   "D2H GB/s": case.nbytes / st / 1e9, "H2D GB/s": case.nbytes / ld / 1e9,
                   "dispatch D2H": results[k][2], "dispatch H2D": results[k][3],
                   "x raw D2H": med["raw"][0] / st, "x raw H2D": med["raw"][1] / ld}
            if "tpu-inference" in med:
                row["x tpu-inf D2H"] = med["tpu-inference"][0] / st
                row["x tpu-inf H2D"] = med["tpu-inference"][1] / ld
            rows.append(row)
        records.append({
            "block_tokens": bt, "blocks_per_step": case.n, "pass_blocks": blocks, "bytes_per_step": case.nbytes,
            "paths": {k: {"store_s": v[0], "load_s": v[1], "dispatches_store": v[2], "dispatches_load": v[3],
                          "bit_exact": v[4],
                          "d2h_gbps_median": case.nbytes / statistics.median(v[0]) / 1e9,
                          "h2d_gbps_median": case.nbytes / statistics.median(v[1]) / 1e9}
                      for k, v in results.items()},
        })
        assert all(v[4] for v in results.values()), f"a path moved wrong bytes at {bt}-token blocks"
        del case
    title = (f"{backend}, {len(devices)} devices, {dtype.name}, {args.layers} layers x {2 * args.kv_heads} heads x "
             f"{args.head_dim}, {args.memory_kind}, median of {args.reps}")
    print_table(rows, title=title + f"; {args.step_mib} MiB per step and direction")
    path = write_json(args.out, {
        "backend": backend, "devices": len(devices), "device_kind": devices[0].device_kind,
        "jax": jax.__version__, "kernel": args.kernel or "the platform's default", "dtype": dtype.name, "memory_kind": args.memory_kind,
        "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "reps": args.reps,
        "targets": {"ours_over_raw": 0.9, "ours_over_tpu_inference_at_16": 3.0}, "results": records,
    })
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, d, key in ((axes[0], "D2H (store)", "d2h_gbps_median"), (axes[1], "H2D (load)", "h2d_gbps_median")):
            recs = [r for r in records if r["pass_blocks"] is None] or records
            for name in recs[0]["paths"]:
                ax.plot([r["block_tokens"] for r in recs], [r["paths"][name][key] for r in recs], marker="o",
                        label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block size (tokens)")
            ax.set_title(d)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s (median)")
        axes[0].legend()
        fig.suptitle(title, fontsize=9)
        print(f"wrote {save_figure(fig, args.out)}")


if __name__ == "__main__":
    main()
