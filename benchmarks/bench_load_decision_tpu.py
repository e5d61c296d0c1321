"""TTFT of a file-tier hit in the real tpu-inference engine as the tier slows: the load decision vs always
load vs never load.

    .venv-tpu/bin/python benchmarks/bench_load_decision_tpu.py [--tokens 256] [--reps 3] [--delays 0 1 5] [--bias 1.0]
    .venv-tpu/bin/python benchmarks/bench_load_decision_tpu.py --mount fuse [--speeds 7 1 0] [--latency-ms 2]

tpu-inference 0.32 on JAX's CPU backend (tpu_offload/testing/cpu_support.py), the tiny KV4 Llama in bf16,
one engine in this process with our ``TPUOffloadConnector`` (configs/tpu-inference/offload-fs.json,
sizes for the tiny model) and its file tier written through to a temp directory, signed with a secret
file. Every file-tier read syscall of this process is delayed by ``delay`` seconds (the file tier's
fault hook, ``fileio.fault``: a slow mount). For each delay the decision first learns the tier (two
untimed file hits in ``auto``); then, per repetition, a fresh prompt is computed and stored (its files
flushed), and sent once per mode (in an order rotated per repetition, each send's stores and file writes
finished before the next) after vLLM's prefix cache and our host tier's index are emptied, so the hit
can only come from files, or be recomputed. The host index is dropped directly
(``manager.reset()``: slots are reused); ``reset_prefix_cache(reset_connector=True)`` would also move
the file tier to a namespace salted for that reset, and the files would no longer be found.

* ``always``: load every hit (the connector without the decision);
* ``never``: recompute every hit;
* ``auto``: ``load_decision: auto`` (core/costs.py), the same engine and learned costs.

The mode is switched on the live scheduler's cost model. TTFT is vLLM's ``first_token_latency``,
``max_tokens=1``, one request at a time; the chunks a hit loads from files are counted from the
scheduler's load plans. ``--bias`` is ``load_decision_bias`` (above 1 favours recomputing, below 1
loading). Beside what the decision learned (file tier MB/s, prefill us/token) the table shows what a
recompute took (``never`` TTFT per token). A delay list that ends where it started (``0 1 5 0``) shows
whether ``auto`` goes back to loading once the tier is fast again. Results: table and ``results/load_decision_tpu[_bias<b>].json``
(the default bias 1.0 writes ``load_decision_tpu.json``).

``--mount fuse``: the file tier's directory on a throttled FUSE mount instead of the fault hook, at
speeds given as the hit's read time in recompute times (``benchmarks/_fuse_speeds.py``, shared with
``bench_load_decision.py``); results in ``results/load_decision_tpu_fuse.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from tpu_offload.testing import engine_run  # noqa: E402

engine_run.prepare_process()

import _fuse_speeds  # noqa: E402
from _common import print_table, write_json  # noqa: E402

MODES = ("always", "never", "auto")
NUDGE = [5, 6, 7, 8, 9]  # a request shorter than a block: steps the engine, stores nothing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    ap.add_argument("--bias", type=float, default=1.0, help="load_decision_bias")
    ap.add_argument("--name", help="results/<name>.json (default: load_decision_tpu[_bias<b>], "
                                   "load_decision_tpu_fuse with --mount fuse)")
    ap.add_argument("--mount", choices=("hook", "fuse"), default="hook",
                    help="hook: delay the tier's read syscalls in-process; fuse: a throttled FUSE mount")
    ap.add_argument("--speeds", type=float, nargs="+", default=[7.0, 1.0, 0.0],
                    help="fuse: the hit's read time in recompute times, in this order (0: unthrottled)")
    ap.add_argument("--latency-ms", type=float, default=2.0, help="fuse: per read request on a throttled mount")
    ap.add_argument("--out", help="write the results here instead of benchmarks/results/")
    args = ap.parse_args()
    if args.mount == "fuse":
        from tpu_offload.testing.throttled_mount import skip_reason

        why = skip_reason()
        if why:
            print(f"no throttled mount: {why}")
            return 3

    from tpu_offload.testing import cpu_support

    cpu_support.apply()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tpu_offload.testing.offload_helpers import OURS, sch, settle, wrk
    from tpu_offload.testing.tiny_models import KV4
    from tpu_offload.core.fs import fileio
    from tpu_offload.core.fs.auth import make_secret_file
    from tpu_offload.testing.workloads import prompt

    block = 16
    blocks = -(-args.tokens // block)
    shape = engine_run.Shape("kv4", "bfloat16", tp=1, block_size=block, num_blocks=2 * blocks + 8,
                             max_num_seqs=1, max_num_batched_tokens=max(256, blocks * block),
                             max_model_len=(blocks + 2) * block)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows, raw, extra = [], [], {}
    with tempfile.TemporaryDirectory(prefix="bench_load_decision_tpu_", dir="/var/tmp") as tmp, \
            contextlib.ExitStack() as stack:
        model_dir = KV4.write(os.path.join(tmp, "model"), shape.dtype)
        secret = os.path.join(tmp, "fs-secret")
        make_secret_file(secret)
        kv_dir = os.path.join(tmp, "kv-files")
        mount = None
        if args.mount == "fuse":
            from tpu_offload.testing.throttled_mount import ThrottledMount

            os.mkdir(os.path.join(tmp, "kv-src"))
            mount = stack.enter_context(ThrottledMount(os.path.join(tmp, "kv-src"), kv_dir))
        kv = engine_run.kv_transfer_config(
            "offload-fs.json", **{**OURS, "fs_capacity_bytes": "256MiB",
                                  "shared_storage_path": kv_dir, "fs_secret_file": secret,
                                  "fs_write_mode": "write_through", "load_decision": "auto",
                                  "load_decision_bias": args.bias,
                                  "fs_io_timeout_s": 600 if mount is not None else 60})
        eng = engine_run.EngineRun(model_dir, shape, kv)
        try:
            s, w = sch(eng), wrk(eng)
            cost = s.costs
            plans: list = []  # every load the scheduler plans: (chunks, of them from files)
            real_add = s.loads.add

            def add(plan, _real=real_add):
                plans.append((len(plan.keys), len(plan.to_promote)))
                return _real(plan)

            s.loads.add = add

            def ttft(p) -> float:
                (out,) = eng.llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
                return out.metrics.first_token_latency

            seed = iter(range(10_000, 20_000))

            def quiet() -> None:
                """Every store completed and its file written: nothing in flight when the next request starts."""
                settle(eng)
                deadline = time.monotonic() + 120
                while w.fs.pending_writes() and time.monotonic() < deadline:
                    ttft(NUDGE)  # queued writes are copied out as the steps free buffers
                assert not w.fs.pending_writes() and w.fs.tier.flush(120), "file writes did not finish"

            def fresh() -> list[int]:
                p = prompt(next(seed), args.tokens)
                ttft(p)  # computed and stored
                quiet()
                return p

            def file_hit(p, mode) -> tuple[float, int, int]:
                """TTFT, chunks loaded from files, chunks of the hit recomputed."""
                cost.mode = mode
                eng.reset_prefix_cache()  # vLLM's HBM cache only: the file namespace stays
                s.manager.reset()  # the host tier forgets; the files stay
                del plans[:]
                rec = s.totals.get("recomputed_hit_tokens", 0)
                t = ttft(p)
                quiet()  # a recompute stores its chunks again
                files = sum(f for _, f in plans)
                return t, files, (s.totals.get("recomputed_hit_tokens", 0) - rec) // s.chunk_tokens

            for n in eng.runner.num_tokens_paddings:  # a step in each token bucket: a partial recompute compiles nothing
                if n // 2 + 1 < shape.max_model_len:
                    ttft(prompt(90_000 + n, n // 2 + 1))
            p = fresh()
            for m in MODES:
                file_hit(p, m)
            if s.totals.get("load_errors", 0) or w.totals.get("load_errors", 0):
                raise SystemExit("load errors in the warm-up")
            chunks = args.tokens // s.chunk_tokens
            if mount is not None:
                def fresh_timed():
                    p = prompt(next(seed), args.tokens)
                    t = ttft(p)  # computed and stored: a recompute
                    quiet()
                    return p, t

                def fit() -> dict:
                    return {"file tier est. MB/s": cost.tiers["fs"].bytes_per_s / 1e6,
                            "prefill us/token": cost.prefill.s_per_token * 1e6}

                try:
                    rows, samples, extra = _fuse_speeds.speed_rows(
                        args, mount, fresh=fresh_timed, file_hit=lambda p, m: file_hit(p, m)[:2], fit=fit,
                        cost_model=cost, probe=s.probe, ns_dir=w.fs.tier.ns_dir, hit_chunks=chunks)
                    raw = [{"mount": k, **v} for k, v in samples.items()]
                finally:
                    mount.set(0, 0)  # the engine's file reads at its close are not throttled
            delays = args.delays if mount is None else []
            try:
                for delay in delays:
                    fileio.fault = (lambda op, d=delay: time.sleep(d) if op == "read" else None) if delay else None
                    for _ in range(2):  # the decision learns this tier
                        file_hit(fresh(), "auto")
                    samples = {m: [] for m in MODES}
                    loaded = {m: [] for m in MODES}
                    recomputed = {m: [] for m in MODES}
                    for r in range(args.reps):
                        p = fresh()
                        for m in MODES[r % 3:] + MODES[: r % 3]:  # each mode in each position: no order bias
                            t, n, r = file_hit(p, m)
                            samples[m].append(t)
                            loaded[m].append(n)
                            recomputed[m].append(r)
                    med = {m: statistics.median(v) * 1e3 for m, v in samples.items()}
                    best = min(med["always"], med["never"])
                    rows.append({"read delay ms": delay * 1e3, "always load ms": med["always"],
                                 "never load ms": med["never"], "auto ms": med["auto"],
                                 "auto vs best": med["auto"] / best,
                                 "auto chunks loaded": statistics.median(loaded["auto"]),
                                 "file tier est. MB/s": cost.tiers["fs"].bytes_per_s / 1e6,
                                 "prefill us/token": cost.prefill.s_per_token * 1e6,
                                 "never us/token": med["never"] * 1e3 / args.tokens})
                    raw.append({"read delay s": delay, "ttft_s": samples, "chunks_loaded": loaded,
                                "chunks_recomputed": recomputed})
                    print(f"samples: {raw[-1]}", flush=True)
            finally:
                fileio.fault = None
            errors = s.totals.get("load_errors", 0) + w.totals.get("load_errors", 0)
            chunk_bytes = s.s.chunk_bytes
        finally:
            eng.close()

    model = (f"tiny Llama (KV4) hidden {KV4.hidden_size}, {KV4.num_layers} layers, {KV4.num_heads} heads / "
             f"{KV4.num_kv_heads} KV heads x {KV4.head_dim}, {shape.dtype}")
    what = "a throttled FUSE mount" if mount is not None else "read syscalls delayed in-process"
    print_table(rows, title=f"tpu-inference on CPU: TTFT of a {args.tokens}-token file-tier hit ({chunks} chunks of "
                            f"{chunk_bytes // 1024} KiB), {what}, median of {args.reps}, load_decision_bias "
                            f"{args.bias:g} ({model})")
    name = args.name or ("load_decision_tpu_fuse" if mount is not None else "load_decision_tpu" if args.bias == 1.0
                         else f"load_decision_tpu_bias{args.bias:g}")
    payload = {"engine": "tpu-inference 0.32", "device": "JAX CPU", "model": model, "tokens": args.tokens,
               "mount": args.mount, "chunks": chunks, "chunk_bytes": chunk_bytes, "bias": args.bias,
               "reps": args.reps, "load_errors": errors, "rows": rows, "samples": raw, **extra}
    path = write_json(name, payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    raise SystemExit(rc)
