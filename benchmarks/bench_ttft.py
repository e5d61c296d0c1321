"""TTFT in real vLLM: recompute vs restored from files / our host tier / vLLM's prefix cache.

    python benchmarks/bench_ttft.py [--lengths 1024 4096] [--reps 3] [--fs-dir DIR]

One engine (vLLM's CPU backend here; a CUDA vLLM works the same) with
``HostOffloadSpec`` and the file tier (``write_through`` into a temp
directory on local disk, or ``--fs-dir``). For every prompt length and
repetition, a fresh random prompt is sent five times, one request at a time,
``max_tokens=1``:

* recompute: first sight, nothing cached (its KV is stored to the host tier
  and written through to files);
* file hit (page cache): after ``reset_prefix_cache(reset_connector=True)``,
  which empties vLLM's prefix cache *and* our host tier, so every chunk must
  be promoted from its file; the files were just written, so the kernel's
  page cache still holds them;
* file hit (cold): the same after also dropping the files from the page cache
  (``posix_fadvise(DONTNEED)`` on each chunk file), so they come from disk;
* host hit: after ``llm.reset_prefix_cache()`` only, so the KV comes from our
  host tier (where the promotion left it);
* device hit: sent again without a reset, served by vLLM's own prefix cache
  (the floor a host hit can approach).

TTFT is vLLM's per-request ``first_token_latency`` (arrival to first token);
each length first runs one untimed round (new shapes warm up).
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
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same core binding with and without a connector
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from gpu_offload.demo import DEMO_MODEL, kv_transfer_config  # noqa: E402

SERIES = [("recompute", "recompute"), ("file_cold", "file hit (cold)"), ("file_warm", "file hit (page cache)"),
          ("host_hit", "host-tier hit"), ("device_hit", "device prefix-cache hit")]


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return out.metrics.first_token_latency


def drop_page_cache(ns_dir: str) -> None:
    """Evict our chunk files (only ours) from the kernel's page cache."""
    for d, _, names in os.walk(ns_dir):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fs-dir", default=None, help="file tier directory (default: a temp dir on local disk)")
    args = ap.parse_args()

    from vllm import LLM

    from gpu_offload import testing

    model = DEMO_MODEL
    with tempfile.TemporaryDirectory(prefix="bench_ttft_") as tmp:  # on tmpfs, "cold" is not cold: use --fs-dir
        path = model.write(os.path.join(tmp, "model"), dtype=args.dtype)
        ktc = kv_transfer_config(2 << 30)
        ktc["kv_connector_extra_config"].update(
            shared_storage_path=args.fs_dir or os.path.join(tmp, "kv-files"), fs_write_mode="write_through",
            fs_allow_unauthenticated=True)  # a private scratch directory
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=max(args.lengths) + 16,
                  enforce_eager=True, max_num_seqs=1, disable_log_stats=False, kv_transfer_config=ktc)
        worker, manager = testing.live_workers()[-1], testing.live_managers()[-1]
        fs = worker.fs
        rng = np.random.default_rng(0)
        ttft(llm, {"prompt_token_ids": rng.integers(1, model.vocab_size, 256).tolist()})  # warm-up

        rows, raw = [], {}
        for n in args.lengths:
            chunks = n // manager.tokens_per_chunk
            samples = {k: [] for k, _ in SERIES}
            samples.update(load_ms=[], load_mib=[], read_ms_warm=[], read_ms_cold=[])
            for _ in range(args.reps + 1):  # the first round warms this length up and is dropped
                p = {"prompt_token_ids": rng.integers(1, model.vocab_size, n).tolist()}
                samples["recompute"].append(ttft(llm, p))
                ttft(llm, {"prompt_token_ids": [1] * 8})  # runs the deferred store of p
                assert fs.flush(120), "file writes did not finish"
                for kind in ("warm", "cold"):
                    llm.reset_prefix_cache(reset_connector=True)  # vLLM's cache and our host tier
                    if kind == "cold":
                        drop_page_cache(fs.tier.ns_dir)
                    hits, r0 = manager.fs_hit_chunks, fs.stats.promotion_seconds
                    samples[f"file_{kind}"].append(ttft(llm, p))
                    assert manager.fs_hit_chunks - hits == chunks, "not served from files"
                    samples[f"read_ms_{kind}"].append((fs.stats.promotion_seconds - r0) * 1e3)
                llm.reset_prefix_cache()  # vLLM's cache only: the chunks are in the host tier now
                hits, s0, b0 = manager.hit_chunks, worker.stats.load_seconds, worker.stats.loaded_bytes
                samples["host_hit"].append(ttft(llm, p))
                assert manager.hit_chunks - hits == chunks, "not served by the host tier"
                samples["load_ms"].append((worker.stats.load_seconds - s0) * 1e3)
                samples["load_mib"].append((worker.stats.loaded_bytes - b0) / 2**20)
                samples["device_hit"].append(ttft(llm, p))
            samples = {k: v[1:] for k, v in samples.items()}
            med = {k: statistics.median(v) for k, v in samples.items()}
            raw[n] = samples
            rows.append({
                "prompt tokens": n,
                "recompute ms": med["recompute"] * 1e3,
                "file hit cold ms": med["file_cold"] * 1e3,
                "file hit warm ms": med["file_warm"] * 1e3,
                "host hit ms": med["host_hit"] * 1e3,
                "device hit ms": med["device_hit"] * 1e3,
                "speedup (file cold)": med["recompute"] / med["file_cold"],
                "speedup (host)": med["recompute"] / med["host_hit"],
                "KV loaded MiB": med["load_mib"],
                "file read ms cold": med["read_ms_cold"],
                "file read ms warm": med["read_ms_warm"],
                "load copy ms": med["load_ms"],
            })
        errors = worker.stats.load_error_blocks + fs.stats.promotion_failures
        fs_counters = fs.tier.counters()

    shape = (f"Llama hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads / "
             f"{model.num_kv_heads} KV heads x {model.head_dim}, {args.dtype}")
    print_table(rows, title=f"TTFT, median of {args.reps}, one request at a time ({shape}, {worker.device})")
    print(f"load errors: {errors}; file tier: {fs_counters}")
    path = write_json("ttft", {
        "model": shape, "device": str(worker.device), "reps": args.reps, "rows": rows,
        "file_tier": {"write_mode": "write_through", "filesystem": "local ext4 (temp dir)" if not args.fs_dir
                      else args.fs_dir, "chunk_tokens": manager.tokens_per_chunk, "counters": fs_counters},
        "samples_s": {str(k): v for k, v in raw.items()},
    })
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7.5, 4))
        x = np.arange(len(rows))
        w = 0.8 / len(SERIES)
        for i, (key, label) in enumerate(SERIES):
            med = [statistics.median(raw[r["prompt tokens"]][key]) * 1e3 for r in rows]
            ax.bar(x + (i - (len(SERIES) - 1) / 2) * w, med, w, label=label)
        ax.set_xticks(x, [f"{r['prompt tokens']} tokens" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms, log)")
        ax.set_title(f"vLLM TTFT: file tier and host tier ({worker.device})")
        ax.legend(fontsize="small")
        save_figure(fig, "ttft")
    print(f"wrote {path}")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    raise SystemExit(rc)
