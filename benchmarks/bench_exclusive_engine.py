"""Exclusive vs write-through host tier in the real tpu-inference engine (JAX CPU): hits, TTFT, cost.

    .venv-tpu/bin/python benchmarks/bench_exclusive_engine.py [--passes 3] [--prompts 6]

A tiny model; the device KV cache (``num_gpu_blocks_override``) and the host
tier hold the same number of blocks (the deployment's ~1:1 ratio); the
working set (``--prompts`` prompts of ``--blocks`` blocks) lies between the
host tier alone and host + device. Requests arrive one at a time in a
seeded random order, each prompt ``--passes`` times. Each mode runs in its
own process: no connector, ours write-through, ours exclusive, and
tpu-inference's own TPUOffloadConnector (same host chunks, by its env).

Per mode: hit rate (prompt tokens the engine did not compute: HBM's prefix
cache plus the connector), median TTFT (``max_tokens=1``: one generate call
per request), whether the first tokens equal the no-connector run's, XLA
compiles after the warm-up pass, and for exclusive the cost: steps that
gathered an eviction copy before their forward and the time to dispatch
those copies (the forward queues behind them), chunks copied, chunks lost.
``--precompile``: tpu-inference precompiles its programs as a served engine
does; the late compiles left are then the engine's own (an input-unpacking
``jnp.split`` for a token count its precompile does not cover), none ours.
Results: table and ``results/exclusive_engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from tpu_offload.testing import engine_run  # noqa: E402

engine_run.prepare_process()

from _common import print_table, write_json  # noqa: E402

MODES = ("none", "write_through", "exclusive", "theirs")


def kv_config(mode: str, host_chunks: int):
    if mode == "none":
        return None
    if mode == "theirs":
        return engine_run.their_kv_transfer_config()
    cfg = engine_run.kv_transfer_config("offload.json", num_cpu_chunks=host_chunks, staging_blocks=64,
                                        store_policy=mode)
    del cfg["kv_connector_extra_config"]["cpu_bytes"]
    return cfg


def one(args) -> None:
    """Child mode: one engine, one run, printed as JSON."""
    from tpu_offload.testing import cpu_support
    from tpu_offload.testing.offload_helpers import CompileCounter
    from tpu_offload.testing.tiny_models import KV4
    from tpu_offload.testing.workloads import prompt

    cpu_support.apply()
    compiles = CompileCounter.install()
    if args.one == "theirs":
        os.environ.update({"TPU_OFFLOAD_NUM_CPU_CHUNKS": str(args.device_blocks),
                           "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64"})
    shape = engine_run.Shape("kv4", "bfloat16", tp=1, block_size=16, num_blocks=args.device_blocks,
                             max_model_len=args.blocks * 16 + 16, max_num_batched_tokens=512)
    model_dir = KV4.write(os.path.join(tempfile.gettempdir(), "tpu_offload_bench_kv4_bf16"), "bfloat16")
    eng = engine_run.EngineRun(model_dir, shape, kv_config(args.one, args.device_blocks))
    sched = eng.core.scheduler
    real = sched.schedule
    scheduled: list[int] = []

    def counting(*a, **k):
        out = real(*a, **k)
        scheduled.append(out.total_num_scheduled_tokens)
        return out

    sched.schedule = counting
    prompts = [prompt(args.seed * 100 + i, args.blocks * 16) for i in range(args.prompts)]
    order = [i for _ in range(args.passes) for i in random.Random(args.seed).sample(range(args.prompts), args.prompts)]
    rows = []
    mark = None
    try:
        for n, i in enumerate(order):
            if n == args.prompts:  # after the warm-up pass (compulsory misses, first compiles)
                mark = compiles.mark()
            scheduled.clear()
            t0 = time.perf_counter()
            tok = eng.generate([prompts[i]], max_tokens=1)[0]
            rows.append({"prompt": i, "ttft_s": time.perf_counter() - t0, "computed": sum(scheduled), "token": tok})
        totals = {}
        if args.one in ("write_through", "exclusive"):
            from tpu_offload.testing.offload_helpers import settle, totals as tot

            settle(eng)
            totals = tot(eng)
        late = compiles.since(mark) if mark is not None else []
    finally:
        eng.close()
    print("RESULT " + json.dumps({"rows": rows, "totals": totals, "late_compiles": late}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-blocks", type=int, default=64, help="device KV blocks; the host tier gets as many")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per prompt (16 tokens each)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--precompile", action="store_true",
                    help="tpu-inference precompiles its step programs, as a served engine does (slower start)")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    common = ["--device-blocks", str(args.device_blocks), "--blocks", str(args.blocks), "--prompts",
              str(args.prompts), "--passes", str(args.passes), "--seed", str(args.seed)]
    res = {}
    for mode in MODES:
        env = {**os.environ, engine_run.PRECOMPILE_ENV: "1" if args.precompile else "0"}
        proc = subprocess.run([sys.executable, __file__, "--one", mode, *common], capture_output=True, text=True,
                              timeout=1800, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        res[mode] = json.loads(lines[-1][7:])
    base_tokens = [r["token"] for r in res["none"]["rows"]]
    prompt_tokens = args.blocks * 16
    out = []
    for mode, r in res.items():
        timed = r["rows"][args.prompts:]  # after the warm-up pass
        hit = sum(prompt_tokens - x["computed"] for x in timed) / (prompt_tokens * len(timed))
        t = r["totals"]
        steps = sum(1 for _ in timed)
        out.append({
            "mode": mode, "hit_rate_pct": 100 * hit,
            "median_ttft_ms": 1e3 * statistics.median(x["ttft_s"] for x in timed),
            "tokens_equal": [x["token"] for x in r["rows"]] == base_tokens,
            "late_compiles": len(r["late_compiles"]),
            "stored_chunks": int(t.get("stored_chunks", 0)), "loaded_chunks": int(t.get("loaded_chunks", 0)),
            "evict_copy_steps": int(t.get("evict_copy_steps", 0)),
            "evict_copy_ms": 1e3 * t.get("evict_copy_dispatch_seconds", 0.0),
            "lost_chunks": int(t.get("exclusive_lost_chunks", 0)),
            "requests": steps,
        })
    ws = args.prompts * args.blocks
    print_table(out, title=f"tpu-inference on CPU, TP 1, bf16: device {args.device_blocks} blocks, host "
                           f"{args.device_blocks} chunks, working set {ws} blocks, {args.passes} passes "
                           "(first is warm-up)")
    path = write_json("exclusive_engine", {"args": vars(args), "rows": out,
                                           "late_compile_names": {m: r["late_compiles"] for m, r in res.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
