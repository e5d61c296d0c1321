"""TTFT of a file-tier hit in real vLLM as the tier slows: the load decision vs always load vs never load.

    python benchmarks/bench_load_decision.py [--tokens 1024] [--reps 3] [--delays 0 0.05 0.3]

One engine (vLLM's CPU backend; ``HostOffloadSpec`` with the file tier written through to a temp
directory). Every file-tier read syscall of this process is delayed by ``delay`` seconds (the file
tier's fault hook, ``fileio.fault``: a slow mount). For each delay, the decision first learns the tier
(two untimed file hits in ``auto``); then, per repetition, a fresh prompt is computed and stored, and
sent once per mode (in an order rotated per repetition, each send's stores and file writes finished
before the next) after vLLM's prefix cache and our host tier's index are emptied, so the hit can only
come from files, or be recomputed (``reset_connector=True`` would also move the file tier to a new
namespace, so the host index is replaced directly: its slots are simply reused):

* ``always``: load every hit (the connector without the decision);
* ``never``: recompute every hit;
* ``auto``: ``load_decision: auto`` (core/costs.py), the same engine and learned costs.

The mode is switched on the live manager (one offloading engine per process). TTFT is vLLM's
``first_token_latency``, ``max_tokens=1``, one request at a time. Results: table and
``results/load_decision.json``.
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
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from _common import machine, print_table, write_json  # noqa: E402
from gpu_offload.demo import DEMO_MODEL, kv_transfer_config  # noqa: E402

MODES = ("always", "never", "auto")


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return out.metrics.first_token_latency


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.3])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm import LLM

    from gpu_offload import testing
    from tpu_offload.core.fs import fileio

    model = DEMO_MODEL
    rng = np.random.default_rng(0)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_load_decision_") as tmp:
        path = model.write(os.path.join(tmp, "model"), dtype=args.dtype)
        ktc = kv_transfer_config(2 << 30)
        ktc["kv_connector_extra_config"].update(
            shared_storage_path=os.path.join(tmp, "kv-files"), fs_write_mode="write_through",
            fs_allow_unauthenticated=True, load_decision="auto", fs_io_timeout_s=60)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.tokens + 16,
                  enforce_eager=True, max_num_seqs=1, disable_log_stats=False, kv_transfer_config=ktc)
        worker, manager = testing.live_workers()[-1], testing.live_managers()[-1]
        fs = worker.fs

        def quiet():
            ttft(llm, {"prompt_token_ids": [1] * 8})  # runs the deferred store of the request before
            assert fs.flush(120), "file writes did not finish"

        def fresh():
            p = {"prompt_token_ids": rng.integers(1, model.vocab_size, args.tokens).tolist()}
            ttft(llm, p)  # computed and stored
            quiet()
            return p

        def file_hit(p, mode):
            manager.costs.mode = mode
            llm.reset_prefix_cache()
            manager._lru = manager._new_index()  # the host tier forgets; the files stay
            hits = manager.fs_hit_chunks
            t = ttft(llm, p)
            quiet()  # a recompute stores its chunks again: its writes end before the next mode's reads
            return t, manager.fs_hit_chunks - hits

        fresh()  # warm-up
        try:
            for delay in args.delays:
                fileio.fault = (lambda op, d=delay: time.sleep(d) if op == "read" else None) if delay else None
                for _ in range(2):  # the decision learns this tier
                    file_hit(fresh(), "auto")
                samples = {m: [] for m in MODES}
                loaded = {m: [] for m in MODES}
                for r in range(args.reps):
                    p = fresh()
                    for m in MODES[r % 3:] + MODES[: r % 3]:  # each mode in each position: no order bias
                        t, n = file_hit(p, m)
                        samples[m].append(t)
                        loaded[m].append(n)
                med = {m: statistics.median(v) * 1e3 for m, v in samples.items()}
                best = min(med["always"], med["never"])
                rows.append({"read delay ms": delay * 1e3, "always load ms": med["always"],
                             "never load ms": med["never"], "auto ms": med["auto"],
                             "auto vs best": med["auto"] / best,
                             "auto chunks loaded": statistics.median(loaded["auto"]),
                             "file tier est. MB/s": manager.costs.tiers["fs"].bytes_per_s / 1e6,
                             "prefill us/token": manager.costs.prefill.s_per_token * 1e6})
                raw[str(delay)] = {"ttft_s": samples, "chunks_loaded": loaded}
        finally:
            fileio.fault = None
        chunks = args.tokens // manager.tokens_per_chunk

    shape = (f"Llama hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads / "
             f"{model.num_kv_heads} KV heads x {model.head_dim}, {args.dtype}")
    print_table(rows, title=f"TTFT of a {args.tokens}-token file-tier hit ({chunks} chunks), median of {args.reps} "
                            f"({shape}, {worker.device})")
    path = write_json("load_decision", {"model": shape, "device": str(worker.device), "tokens": args.tokens,
                                        "chunks": chunks, "reps": args.reps, "rows": rows, "samples": raw,
                                        "machine": machine()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    raise SystemExit(rc)
