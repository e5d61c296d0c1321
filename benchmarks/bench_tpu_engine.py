"""Step-time overhead of a KV connector with no hits, in the real tpu-inference engine.

    .venv-tpu/bin/python benchmarks/bench_tpu_engine.py [--tp 1] [--rounds 4] [--cycles 2]

tpu-inference 0.32 on JAX's CPU backend (tpu_offload/testing/cpu_support.py),
each engine in its own process (both connectors export the same
``tpu_inference:prefix_cache_*`` metric names), three ways: no connector, our
``TPUOffloadConnector`` (configs/tpu-inference/offload.json, sizes for the
tiny model) and tpu-inference's own. Every round sends a batch of prompts
never seen before (so nothing hits and every full block is stored) after one
untimed warm-up round (new shapes compile). The figure is wall time per
engine step, over the timed rounds; ``--cycles`` repeats the three engines
in turn so drifting machine load hits each alike. CPU numbers: compute is
slow relative to copies here, so the relative overhead is smaller than on a
TPU; the point is the comparison at equal work. Results: table and
``results/tpu_engine_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
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

THEIR_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "1024", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64",
             "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}


def kv_config(which: str):
    if which == "none":
        return None
    if which == "ours":
        return engine_run.kv_transfer_config("offload.json", cpu_bytes="256MiB", staging_blocks=64)
    return engine_run.their_kv_transfer_config()


def measure(which: str, model_dir: str, shape, rounds: int, batch: int, prompt_len: int, seed: int) -> dict:
    from tpu_offload.testing.workloads import prompt

    if which == "theirs":
        os.environ.update(THEIR_ENV)
    eng = engine_run.EngineRun(model_dir, shape, kv_config(which))
    steps = []
    sched = eng.core.scheduler
    real = sched.schedule

    def counting(*a, **k):
        out = real(*a, **k)
        if out.total_num_scheduled_tokens:
            steps.append(1)
        return out

    sched.schedule = counting
    try:
        times, counts = [], []
        for r in range(rounds + 1):
            prompts = [prompt(seed + 1000 * r + i, prompt_len) for i in range(batch)]
            steps.clear()
            t0 = time.perf_counter()
            eng.generate(prompts, max_tokens=16)
            dt = time.perf_counter() - t0
            if r:  # round 0 compiles
                times.append(dt)
                counts.append(len(steps))
    finally:
        eng.close()
        for k in THEIR_ENV:
            os.environ.pop(k, None)
    per_step = [t / n * 1e3 for t, n in zip(times, counts)]
    return {"ms_per_step": per_step, "steps_per_round": counts}


def one(args) -> None:
    """Child mode: one engine, one measurement, printed as JSON."""
    from tpu_offload.testing import cpu_support
    from tpu_offload.testing.tiny_models import KV4

    cpu_support.apply()
    shape = engine_run.Shape("kv4", "bfloat16", tp=args.tp, block_size=16, num_blocks=256, max_model_len=1024)
    model_dir = KV4.write(os.path.join(tempfile.gettempdir(), "tpu_offload_bench_kv4_bf16"), "bfloat16")
    res = measure(args.one, model_dir, shape, args.rounds, args.batch, args.prompt_len, args.seed)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--one", choices=("none", "ours", "theirs"), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)

    samples: dict[str, list[float]] = {"none": [], "ours": [], "theirs": []}
    common = ["--tp", str(args.tp), "--rounds", str(args.rounds), "--batch", str(args.batch),
              "--prompt-len", str(args.prompt_len)]
    for c in range(args.cycles):
        for which in samples:
            proc = subprocess.run([sys.executable, __file__, "--one", which, "--seed", str(100 * c), *common],
                                  capture_output=True, text=True, timeout=1200)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
            samples[which] += json.loads(lines[-1][7:])["ms_per_step"]
    none = statistics.median(samples["none"])
    rows = [{"connector": k, "median ms/step": statistics.median(v), "min ms/step": min(v),
             "overhead vs none %": 100 * (statistics.median(v) / none - 1), "samples": len(v)}
            for k, v in samples.items()]
    print_table(rows, title=f"tpu-inference on CPU, TP {args.tp}, bf16, {args.batch} x {args.prompt_len}-token "
                            "prompts never seen before, 16 tokens each (no hits)")
    path = write_json("tpu_engine_overhead", {"args": vars(args), "rows": rows, "samples_ms_per_step": samples})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
