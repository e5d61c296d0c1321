"""TTFT of a file-tier hit in real vLLM as the tier slows: the load decision vs always load vs never load.

    python benchmarks/bench_load_decision.py [--tokens 1024] [--reps 3] [--delays 0 0.05 0.3]
    python benchmarks/bench_load_decision.py --mount fuse [--speeds 7 1 0] [--latency-ms 2] [--out PATH]

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

``--mount fuse``: the slow mount is made at the OS level instead (``tpu_offload/testing/
throttled_mount.py``: a FUSE passthrough with ``direct_io``, ``--latency-ms`` per read request and a
bandwidth cap shared by all reads), the file tier's directory on it, no fault hook. Speeds are the
whole hit's read time as a multiple of its recompute time (0: unthrottled), the recompute time being
the median TTFT of three cold prompts after a first one; each cap is set from it and the hit's bytes.
Each speed starts as an engine started on that mount would: what the decision learned of the file
tier at other speeds is forgotten and the probe prices the mount (its idle interval shortened until
it has) before the first request. Nothing is learned untimed: every file hit is in the table, the
first one after that start included (the rotation starts with ``auto``). ``recompute`` of a row is the median of its ``never``
samples; ``auto worst x recompute`` is the slowest ``auto`` request over it. Results: table and
``results/load_decision_fuse.json`` (or ``--out``), every sample with the chunks it loaded.
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

import _fuse_speeds  # noqa: E402
from _common import print_table, write_json  # noqa: E402
from gpu_offload.demo import DEMO_MODEL, kv_transfer_config  # noqa: E402

MODES = ("always", "never", "auto")


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return out.metrics.first_token_latency


class Bench:
    """One engine with the file tier written through to ``kv_dir``; a prompt's hit sent per mode."""

    def __init__(self, args, kv_dir: str, model_dir: str):
        from vllm import LLM

        from gpu_offload import testing

        ktc = kv_transfer_config(2 << 30)
        ktc["kv_connector_extra_config"].update(
            shared_storage_path=kv_dir, fs_write_mode="write_through",
            fs_allow_unauthenticated=True, load_decision="auto", fs_io_timeout_s=600)
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=args.dtype,
                       max_model_len=args.tokens + 16, enforce_eager=True, max_num_seqs=1,
                       disable_log_stats=False, kv_transfer_config=ktc)
        self.worker, self.manager = testing.live_workers()[-1], testing.live_managers()[-1]
        self.fs = self.worker.fs
        self.tokens = args.tokens
        self.rng = np.random.default_rng(0)

    def quiet(self) -> None:
        ttft(self.llm, {"prompt_token_ids": [1] * 8})  # runs the deferred store of the request before
        assert self.fs.flush(600), "file writes did not finish"

    def fresh(self) -> tuple[dict, float]:
        """A new prompt, computed (its TTFT: a recompute) and stored."""
        p = {"prompt_token_ids": self.rng.integers(1, DEMO_MODEL.vocab_size, self.tokens).tolist()}
        t = ttft(self.llm, p)
        self.quiet()
        return p, t

    def file_hit(self, p, mode) -> tuple[float, int]:
        """TTFT of ``p`` in ``mode`` with its hit only in files; the chunks loaded from them."""
        self.manager.costs.mode = mode
        self.llm.reset_prefix_cache()
        self.manager._lru = self.manager._new_index()  # the host tier forgets; the files stay
        hits = self.manager.fs_hit_chunks
        t = ttft(self.llm, p)
        self.quiet()  # a recompute stores its chunks again: its writes end before the next mode's reads
        return t, self.manager.fs_hit_chunks - hits

    def rotated(self, reps: int, order=MODES):
        return _fuse_speeds.rotated(reps, self.fresh, self.file_hit, order)

    def fit(self) -> dict:
        return {"file tier est. MB/s": self.manager.costs.tiers["fs"].bytes_per_s / 1e6,
                "prefill us/token": self.manager.costs.prefill.s_per_token * 1e6}


def hook_rows(args, bench: Bench):
    """Slow mount simulated by delaying each read syscall of the tier (``fileio.fault``)."""
    from tpu_offload.core.fs import fileio

    rows, raw = [], {}
    bench.fresh()  # warm-up
    try:
        for delay in args.delays:
            fileio.fault = (lambda op, d=delay: time.sleep(d) if op == "read" else None) if delay else None
            for _ in range(2):  # the decision learns this tier
                bench.file_hit(bench.fresh()[0], "auto")
            samples, loaded = bench.rotated(args.reps)
            med = {m: statistics.median(v) * 1e3 for m, v in samples.items()}
            best = min(med["always"], med["never"])
            rows.append({"read delay ms": delay * 1e3, "always load ms": med["always"],
                         "never load ms": med["never"], "auto ms": med["auto"],
                         "auto vs best": med["auto"] / best,
                         "auto chunks loaded": statistics.median(loaded["auto"]), **bench.fit()})
            raw[str(delay)] = {"ttft_s": samples, "chunks_loaded": loaded}
    finally:
        fileio.fault = None
    return rows, raw, {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.3], help="hook: seconds per read")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mount", choices=("hook", "fuse"), default="hook",
                    help="hook: delay the tier's read syscalls in-process; fuse: a throttled FUSE mount")
    ap.add_argument("--speeds", type=float, nargs="+", default=[7.0, 1.0, 0.0],
                    help="fuse: the hit's read time in recompute times, in this order (0: unthrottled)")
    ap.add_argument("--latency-ms", type=float, default=2.0, help="fuse: per read request on a throttled mount")
    ap.add_argument("--out", help="write the results here instead of benchmarks/results/")
    args = ap.parse_args()

    model = DEMO_MODEL
    with tempfile.TemporaryDirectory(prefix="bench_load_decision_", dir="/var/tmp") as tmp:
        path = model.write(os.path.join(tmp, "model"), dtype=args.dtype)
        kv = os.path.join(tmp, "kv-files")
        if args.mount == "fuse":
            from tpu_offload.testing.throttled_mount import ThrottledMount, skip_reason

            why = skip_reason()
            if why:
                print(f"no throttled mount: {why}")
                return 3
            src = os.path.join(tmp, "kv-src")
            os.mkdir(src)
            with ThrottledMount(src, kv) as mount:
                bench = Bench(args, kv, path)
                try:
                    rows, raw, extra = _fuse_speeds.speed_rows(
                        args, mount, fresh=bench.fresh, file_hit=bench.file_hit, fit=bench.fit,
                        cost_model=bench.manager.costs, probe=bench.manager.probe, ns_dir=bench.fs.tier.ns_dir,
                        hit_chunks=args.tokens // bench.manager.tokens_per_chunk)
                finally:  # the file tier's files closed before the mount goes (both shut down once)
                    mount.set(0, 0)
                    bench.manager.shutdown()
                    bench.worker.shutdown()
        else:
            bench = Bench(args, kv, path)
            rows, raw, extra = hook_rows(args, bench)
        chunks = args.tokens // bench.manager.tokens_per_chunk

    shape = (f"Llama hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads / "
             f"{model.num_kv_heads} KV heads x {model.head_dim}, {args.dtype}")
    what = "a throttled FUSE mount" if args.mount == "fuse" else "read syscalls delayed in-process"
    print_table(rows, title=f"TTFT of a {args.tokens}-token file-tier hit, {what}, median of {args.reps} "
                            f"({shape}, cpu)")
    payload = {"model": shape, "device": "cpu", "mount": args.mount, "tokens": args.tokens,
               "chunks": chunks, "reps": args.reps, "rows": rows, "samples": raw, **extra}
    name = "load_decision_fuse" if args.mount == "fuse" else "load_decision"
    out = write_json(name, payload, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s")
    raise SystemExit(rc)
