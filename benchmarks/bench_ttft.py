"""TTFT in real vLLM: recompute vs restored from our host tier (vs vLLM's own prefix cache).

    python benchmarks/bench_ttft.py [--lengths 1024 4096] [--reps 3]

One engine (vLLM's CPU backend here; a CUDA vLLM works the same) with
``HostOffloadSpec``. For every prompt length and repetition, a fresh random
prompt is sent three times, one request at a time, ``max_tokens=1``:

* recompute: first sight, nothing cached (its KV is stored to the host tier);
* host hit: after ``llm.reset_prefix_cache()``, so the KV comes from our tier;
* device hit: sent again without a reset, served by vLLM's own prefix cache
  (the floor a host hit can approach).

TTFT is vLLM's per-request ``first_token_latency`` (arrival to first token).
Prompts are whole blocks, so a full hit still recomputes the last token, as
vLLM always does. Results: table, ``results/ttft.json``, ``results/ttft.png``.
On CPU, compute is slow relative to memcpy, so these ratios are larger than
on a GPU, where a hit is bounded by PCIe bandwidth instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from gpu_offload.demo import DEMO_MODEL, kv_transfer_config  # noqa: E402


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return out.metrics.first_token_latency


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm import LLM

    from gpu_offload import testing

    model = DEMO_MODEL
    with tempfile.TemporaryDirectory(prefix="bench_ttft_") as tmp:
        path = model.write(os.path.join(tmp, "model"), dtype=args.dtype)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=max(args.lengths) + 16,
                  enforce_eager=True, max_num_seqs=1, disable_log_stats=False,
                  kv_transfer_config=kv_transfer_config(2 << 30))
        worker, manager = testing.live_workers()[-1], testing.live_managers()[-1]
        rng = np.random.default_rng(0)
        ttft(llm, {"prompt_token_ids": rng.integers(1, model.vocab_size, 256).tolist()})  # warm-up

        rows, raw = [], {}
        for n in args.lengths:
            samples = {"recompute": [], "host_hit": [], "device_hit": [], "load_ms": [], "load_mib": []}
            for _ in range(args.reps):
                p = {"prompt_token_ids": rng.integers(1, model.vocab_size, n).tolist()}
                samples["recompute"].append(ttft(llm, p))
                ttft(llm, {"prompt_token_ids": [1] * 8})  # flushes the deferred store of p
                llm.reset_prefix_cache()
                hits, s0, b0 = manager.hit_chunks, worker.stats.load_seconds, worker.stats.loaded_bytes
                samples["host_hit"].append(ttft(llm, p))
                assert manager.hit_chunks - hits == n // manager.tokens_per_chunk, "not served by the host tier"
                samples["load_ms"].append((worker.stats.load_seconds - s0) * 1e3)
                samples["load_mib"].append((worker.stats.loaded_bytes - b0) / 2**20)
                samples["device_hit"].append(ttft(llm, p))
            med = {k: statistics.median(v) for k, v in samples.items()}
            raw[n] = samples
            rows.append({
                "prompt tokens": n,
                "recompute ms": med["recompute"] * 1e3,
                "host hit ms": med["host_hit"] * 1e3,
                "device hit ms": med["device_hit"] * 1e3,
                "speedup (host)": med["recompute"] / med["host_hit"],
                "KV loaded MiB": med["load_mib"],
                "load copy ms": med["load_ms"],
            })
        errors = worker.stats.load_error_blocks

    shape = (f"Llama hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads / "
             f"{model.num_kv_heads} KV heads x {model.head_dim}, {args.dtype}")
    print_table(rows, title=f"TTFT, median of {args.reps}, one request at a time ({shape}, {worker.device})")
    print(f"load errors: {errors}")
    path = write_json("ttft", {
        "model": shape, "device": str(worker.device), "reps": args.reps, "rows": rows,
        "samples_s": {str(k): v for k, v in raw.items()},
    })
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = np.arange(len(rows))
        for i, (key, label) in enumerate([("recompute ms", "recompute"), ("host hit ms", "host-tier hit"),
                                          ("device hit ms", "device prefix-cache hit")]):
            ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
        ax.set_xticks(x, [f"{r['prompt tokens']} tokens" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms, log)")
        ax.set_title(f"vLLM TTFT with the host tier ({worker.device})")
        ax.legend()
        save_figure(fig, "ttft")
    print(f"wrote {path}")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    raise SystemExit(rc)
