"""Sliding-window layers: bytes moved and restored TTFT, window-only vs every block vs tpu-inference's connector.

    .venv-tpu/bin/python benchmarks/bench_sliding_window.py [--family gpt-oss] [--reps 3]

Two parts.

* Real shapes, computed from the rule the scheduler applies
  (``connector/windows.py``): bytes one prompt stores (and a hit on it loads)
  for gpt-oss-120b, gpt-oss-20b and Gemma 4 (transformers' default
  ``Gemma4TextConfig``), at the TPU page tpu-inference uses (128 tokens), with
  sliding layers stored whole ("all") or by their window ("window").
* Measured in the real tpu-inference 0.32 engine on JAX's CPU backend
  (tpu_offload/testing/cpu_support.py), a tiny random model of the family
  (tpu_offload/testing/tiny_families.py), each engine in its own process, with
  vLLM's prefix caching off (what "window" needs where the engine has one
  block table for all layers, as on tpu-inference's JAX path; see windows.py):
  ours with ``sliding_window: window`` (gpt-oss on tpu-inference's vLLM-model
  path keeps vLLM's hybrid KV-cache manager: a sliding-window group of its
  own), ours with ``all`` and the hybrid manager off, and tpu-inference's own
  connector (which turns the hybrid manager off). Every repetition sends ``--batch`` fresh
  prompts (stored), then the same prompts plus a few new tokens one at a time
  (each restored from the host tier); the figures are bytes stored and
  loaded (ours: the worker's counters; theirs: its ``record_d2h_bytes`` /
  ``record_h2d_bytes``) and vLLM's ``first_token_latency`` of the restored
  requests. The first repetition warms up (new shapes compile) and is not
  counted. Results: table, ``results/sliding_window_<family>.json``.
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

PAGE = 128  # tokens per TPU page for these models in tpu-inference
THEIR_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "1024", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64",
             "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}
KINDS = ("window", "all", "theirs")


# ---- part 1: real shapes ---------------------------------------------------------
def real_shapes() -> list[dict]:
    """(name, per-token bytes of each layer, sliding layers, window) for the shapes users serve."""
    from transformers import Gemma4TextConfig

    def hd64(kv_heads):  # tpu-inference's head_dim-64 layout: K|V share one 128-lane row per head, bf16
        return kv_heads * 128 * 2

    out = []
    for name, layers, kv in (("gpt-oss-120b", 36, 8), ("gpt-oss-20b", 24, 8)):
        out.append({"model": name, "per_layer": [hd64(kv)] * layers,
                    "sliding": [i % 2 == 0 for i in range(layers)], "window": 128})
    g = Gemma4TextConfig()
    per_layer, sliding = [], []
    for i, t in enumerate(g.layer_types):  # transformers 5.19: head_dim and KV heads are per layer
        layer = g.per_layer_config[i]
        full = t != "sliding_attention"
        dim, heads = -(-layer.head_dim // 128) * 128, layer.num_key_value_heads
        per_layer.append(2 * heads * dim * 2)  # K and V, bf16, head_dim padded to 128 lanes
        sliding.append(not full)
    out.append({"model": "Gemma 4 (transformers default config)", "per_layer": per_layer, "sliding": sliding,
                "window": g.sliding_window})
    return out


def stored_bytes(shape: dict, tokens: int, window: bool) -> int:
    stored = tokens // PAGE * PAGE
    tail = min(stored, -(-shape["window"] // PAGE) * PAGE)
    return sum(b * (tail if (s and window) else stored) for b, s in zip(shape["per_layer"], shape["sliding"]))


def real_rows(lengths: list[int]) -> list[dict]:
    rows = []
    for shape in real_shapes():
        for n in lengths:
            every, win = stored_bytes(shape, n, False), stored_bytes(shape, n, True)
            rows.append({"model": shape["model"], "prompt tokens": n,
                         "sliding layers": f"{sum(shape['sliding'])}/{len(shape['sliding'])}",
                         "window": shape["window"], "all MiB": every / 2**20, "window MiB": win / 2**20,
                         "saved %": 100 * (1 - win / every)})
    return rows


# ---- part 2: the real engine -------------------------------------------------------
def measure(kind: str, family: str, reps: int, batch: int, prompt_len: int) -> dict:
    from tpu_offload.testing import engine_run

    engine_run.prepare_process()
    from tpu_offload.testing import cpu_support
    from tpu_offload.testing.tiny_families import FAMILIES
    from tpu_offload.testing.workloads import prompt

    cpu_support.apply()
    fam = FAMILIES[family]
    os.environ.update(dict(fam.engine_env))
    moved = {"store": 0, "load": 0}
    if kind == "theirs":
        os.environ.update(THEIR_ENV)
        from tpu_inference.offload.metrics import TPUKVCacheMetrics

        d2h, h2d = TPUKVCacheMetrics.record_d2h_bytes, TPUKVCacheMetrics.record_h2d_bytes

        def count_d2h(self, n):
            moved["store"] += int(n)
            return d2h(self, n)

        def count_h2d(self, n):
            moved["load"] += int(n)
            return h2d(self, n)

        TPUKVCacheMetrics.record_d2h_bytes, TPUKVCacheMetrics.record_h2d_bytes = count_d2h, count_h2d
        kv = engine_run.their_kv_transfer_config()
    else:
        kv = engine_run.kv_transfer_config("offload.json", cpu_bytes="256MiB", staging_blocks=64,
                                           sliding_window=kind)
    dtype = "bfloat16"
    model_dir = fam.write(os.path.join(tempfile.gettempdir(), f"tpu_offload_bench_{family}_{dtype}"), dtype)
    shape = engine_run.Shape(family, dtype, tp=1, block_size=16, num_blocks=256, max_model_len=1024)
    # "all": vLLM's hybrid KV-cache manager off too (with it on, it frees sliding-window blocks outside the
    # window, so there is nothing more to store); tpu-inference's connector turns it off itself.
    extra = {"disable_hybrid_kv_cache_manager": True} if kind == "all" else {}
    eng = engine_run.EngineRun(model_dir, shape, kv, enable_prefix_caching=False, **extra)
    groups = len(eng.core.scheduler.kv_cache_config.kv_cache_groups)
    ttft, per_rep = [], []
    try:
        wrk = None if kind == "theirs" else eng.worker_connector.worker
        for r in range(reps + 1):
            before = dict(moved) if wrk is None else {"store": wrk.totals.get("store_bytes", 0),
                                                       "load": wrk.totals.get("load_bytes", 0)}
            prompts = [prompt(7000 + 100 * r + i, prompt_len) for i in range(batch)]
            store_prompts(eng, prompts)
            lat = restore_ttfts_ms(eng, [p + prompt(9000 + i, 8) for i, p in enumerate(prompts)])
            after = dict(moved) if wrk is None else {"store": wrk.totals.get("store_bytes", 0),
                                                      "load": wrk.totals.get("load_bytes", 0)}
            if r:
                ttft += lat
                per_rep.append({k: after[k] - before[k] for k in after})
        hits = None if wrk is None else eng.scheduler_connector.scheduler.totals.get("hit_tokens", 0)
    finally:
        eng.close()
    return {"ttft_ms": ttft, "bytes": per_rep, "hit_tokens": hits, "kv_cache_groups": groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gpt-oss")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        res = measure(args.one, args.family, args.reps, args.batch, args.prompt_len)
        print("RESULT " + json.dumps(res), flush=True)
        return

    shapes = real_rows(args.lengths)
    print_table(shapes, title=f"Bytes one prompt stores (a hit loads the same), {PAGE}-token pages, bf16")
    measured = {}
    for kind in KINDS:
        proc = subprocess.run([sys.executable, __file__, "--one", kind, "--family", args.family, "--reps",
                               str(args.reps), "--batch", str(args.batch), "--prompt-len", str(args.prompt_len)],
                              capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
        measured[kind] = json.loads(lines[-1][7:])
    rows = []
    for kind, m in measured.items():
        reps = len(m["bytes"])
        rows.append({"offload": {"window": "ours, window", "all": "ours, every block",
                                 "theirs": "tpu-inference's connector"}[kind],
                     "stored KiB / prompt": sum(b["store"] for b in m["bytes"]) / reps / args.batch / 1024,
                     "loaded KiB / prompt": sum(b["load"] for b in m["bytes"]) / reps / args.batch / 1024,
                     "restored TTFT ms (median)": statistics.median(m["ttft_ms"]),
                     "min": min(m["ttft_ms"]), "KV-cache groups": m["kv_cache_groups"]})
    print_table(rows, title=f"tiny {args.family} in tpu-inference on CPU, TP 1, bf16, 16-token blocks, prefix caching "
                            f"off, {args.batch} x {args.prompt_len}-token prompts per repetition, {args.reps} reps")
    path = write_json(f"sliding_window_{args.family}", {"args": vars(args), "real_shapes": shapes, "measured_rows": rows,
                                         "measured": measured})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
