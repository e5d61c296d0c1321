"""MLA under DP attention: restored TTFT of the tiny DeepSeek-V3, ours next to tpu-inference's connector.

    .venv-tpu/bin/python benchmarks/bench_dp_mla.py [--reps 3] [--batch 4] [--prompt-len 400]

The real tpu-inference 0.32 engine on JAX's CPU backend (tpu_offload/testing),
the tiny DeepSeek-V3 (MLA, fp8 latent cache, 32-token pages) at TP 2 with DP
attention, so 2 attention-DP ranks under tpu-inference's DPScheduler, each
kind in its own process: no connector (recompute), ours, tpu-inference's own
connector. vLLM's prefix caching stays on (under DPScheduler, vLLM's
EngineCore hashes request blocks only then) and is reset before the restores,
so a restored prompt comes from the connector's host tier or is recomputed. Requests are routed round-robin
(``DP_SCHED_ROUTING``): a repetition sends ``--batch`` fresh prompts
(stored), then each prompt plus a few new tokens alone, so consecutive
restores alternate ranks and half of them land on the rank that did not
store the prompt. Figures: vLLM's ``first_token_latency`` of the restores
(the first repetition warms up and is not counted) and the bytes loaded
(ours: the worker's counters; theirs: its ``record_h2d_bytes``). Results:
table, ``results/dp_mla.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import print_table, restore_ttfts_ms, store_prompts, write_json  # noqa: E402

THEIR_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "1024", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64",
             "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}
KINDS = ("none", "ours", "theirs")


def measure(kind: str, reps: int, batch: int, prompt_len: int) -> dict:
    from tpu_offload.testing import engine_run

    engine_run.prepare_process()
    from tpu_offload.testing import cpu_support
    from tpu_offload.testing.tiny_families import FAMILIES
    from tpu_offload.testing.workloads import prompt

    cpu_support.apply()
    fam = FAMILIES["deepseek-v3"]
    os.environ.update(dict(fam.engine_env))
    os.environ["DP_SCHED_ROUTING"] = "round_robin"
    loaded = {"bytes": 0}
    kv = None
    if kind == "theirs":
        os.environ.update(THEIR_ENV)
        from tpu_inference.offload.metrics import TPUKVCacheMetrics

        h2d = TPUKVCacheMetrics.record_h2d_bytes

        def count_h2d(self, n):
            loaded["bytes"] += int(n)
            return h2d(self, n)

        TPUKVCacheMetrics.record_h2d_bytes = count_h2d
        kv = engine_run.their_kv_transfer_config()
    elif kind == "ours":
        kv = engine_run.kv_transfer_config("offload.json", cpu_bytes="256MiB", staging_blocks=64)
    dtype = "bfloat16"
    model_dir = fam.write(os.path.join(tempfile.gettempdir(), f"tpu_offload_bench_deepseek_{dtype}"), dtype)
    shape = engine_run.Shape("deepseek-v3", dtype, tp=2, block_size=32, num_blocks=256, max_model_len=1024)
    eng = engine_run.EngineRun(model_dir, shape, kv, **dict(fam.engine_kwargs))
    assert type(eng.core.scheduler).__name__ == "DPScheduler" and eng.core.scheduler.dp_size == 2
    ttft, per_rep = [], []
    try:
        wrk = eng.worker_connector.worker if kind == "ours" else None

        def load_bytes():
            return wrk.totals.get("load_bytes", 0) if wrk is not None else loaded["bytes"]

        for r in range(reps + 1):
            prompts = [prompt(7000 + 100 * r + i, prompt_len) for i in range(batch)]
            store_prompts(eng, prompts)
            eng.reset_prefix_cache()
            before = load_bytes()
            lat = restore_ttfts_ms(eng, [p + prompt(9000 + i, 8) for i, p in enumerate(prompts)])
            if r:
                ttft += lat
                per_rep.append(load_bytes() - before)
        foreign = eng.worker_connector._dp.foreign if kind == "ours" else None
    finally:
        eng.close()
    return {"ttft_ms": ttft, "loaded_bytes": per_rep, "cross_rank_chunks": foreign}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        res = measure(args.one, args.reps, args.batch, args.prompt_len)
        print("RESULT " + json.dumps(res), flush=True)
        return
    measured = {}
    for kind in KINDS:
        proc = subprocess.run([sys.executable, __file__, "--one", kind, "--reps", str(args.reps), "--batch",
                               str(args.batch), "--prompt-len", str(args.prompt_len)],
                              capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:  # recorded: tpu-inference's connector can take the engine down here
            errors = [x for x in (proc.stdout + proc.stderr).splitlines() if "Error" in x or "assert" in x]
            measured[kind] = {"failed": errors[-6:]}
            print(f"{kind} failed (rc {proc.returncode}):", *errors[-6:], sep="\n  ")
            continue
        measured[kind] = json.loads(lines[-1][7:])
    rows = []
    for kind, m in measured.items():
        if "failed" in m:
            continue
        reps = len(m["loaded_bytes"])
        rows.append({"offload": {"none": "none (recompute)", "ours": "ours",
                                 "theirs": "tpu-inference's connector"}[kind],
                     "loaded KiB / prompt": sum(m["loaded_bytes"]) / reps / args.batch / 1024,
                     "restored TTFT ms (median)": statistics.median(m["ttft_ms"]), "min": min(m["ttft_ms"]),
                     "chunks from the other rank": m["cross_rank_chunks"]})
    print_table(rows, title=f"tiny DeepSeek-V3 in tpu-inference on CPU, TP 2 = 2 attention-DP ranks, fp8 latent "
                            f"cache, 32-token pages, {args.batch} x {args.prompt_len}-token "
                            f"prompts per repetition, {args.reps} reps")
    path = write_json("dp_mla", {"args": vars(args), "measured_rows": rows, "measured": measured})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
