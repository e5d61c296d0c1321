"""What the connector costs an engine whose working set fits its KV cache (the Low Cache shape).

    python benchmarks/bench_connector_time.py [--sessions 8] [--turns 6] [--rounds 2]
    python benchmarks/bench_connector_time.py --lease-ttl-s 120 --cpu-bytes 16777216 --out connector_time_lease

Wall-clock comparisons of whole servers on a shared 2-core machine move by more than the 1% the
Low Cache shape must stay within, so this measures the part that is ours directly: real vLLM (CPU
backend, in this process) serves multi-turn sessions whose contexts grow every turn and all fit
the device cache (nothing is ever evicted, every turn's prefix is a device hit; only new full
blocks are stored), and every method of the KV connector vLLM calls (scheduler side and worker
side: vLLM's ``OffloadingConnector`` with our spec, manager and handlers under it) is timed as it
runs. The figure is the connector's time per engine step and its share of the engine's wall time:
on the engine's critical path either way, and nearly independent of other load on the machine
(both grow alike). Results: table and ``results/connector_time.json``.

``--lease-ttl-s``: every request carries its session's lease hint (docs/leases.md), so the lease
bookkeeping's cost is in the figure; ``--cpu-bytes``: a host tier small enough to evict, so
evictions pass over leased chunks.
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

from _common import MethodClock, print_table, write_json  # noqa: E402

# The KVConnectorBase_V1 methods vLLM calls on a connector (both roles).
METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "take_events", "get_kv_connector_stats",
    "bind_connector_metadata", "clear_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta",
    "handle_preemptions", "get_external_cache_hit_sources", "on_new_request", "has_pending_block_frees",
    "has_pending_push_work", "get_loaded_kv_cache_group_ids",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="the sessions' turns this many times over (fresh sessions)")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--turn-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lease-ttl-s", type=float, default=0.0, help="each request carries its session's lease hint")
    ap.add_argument("--cpu-bytes", type=int, default=1 << 30, help="host tier bytes")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="connector_time")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from gpu_offload.demo import DEMO_MODEL, kv_transfer_config

    model = DEMO_MODEL
    rng = np.random.default_rng(0)
    max_len = args.system_len + args.turns * (args.turn_len + args.output_len) + 64
    with tempfile.TemporaryDirectory(prefix="bench_connector_time_") as tmp:
        path = model.write(os.path.join(tmp, "model"), dtype=args.dtype)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=max_len, enforce_eager=True,
                  max_num_seqs=args.sessions, kv_transfer_config=kv_transfer_config(args.cpu_bytes))
        core = llm.llm_engine.engine_core.engine_core
        clock = MethodClock()
        sched_conn, worker_conn = core.scheduler.connector, get_kv_transfer_group()
        for name in METHODS:
            clock.wrap(sched_conn, name, f"scheduler.{name}")
            if worker_conn is not sched_conn:
                clock.wrap(worker_conn, name, f"worker.{name}")
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

        def round_params(rnd: int) -> list:
            """Each session's sampling params; with --lease-ttl-s its hint (fresh sessions each round)."""
            if not args.lease_ttl_s:
                return [sp] * args.sessions
            return [SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, extra_args={
                "kv_transfer_params": {"tpu_offload_lease": {"session": f"r{rnd}-s{i}", "ttl_s": args.lease_ttl_s}}})
                for i in range(args.sessions)]

        system = rng.integers(1, model.vocab_size, args.system_len).tolist()
        llm.generate([{"prompt_token_ids": system + [1]}], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
        clock.seconds.clear()
        clock.calls.clear()
        turn_walls = []
        t_all = time.perf_counter()
        for rnd in range(args.rounds):
            sps = round_params(rnd)
            contexts = [system + rng.integers(1, model.vocab_size, 64).tolist() for _ in range(args.sessions)]
            for _ in range(args.turns):
                prompts = [c + rng.integers(1, model.vocab_size, args.turn_len).tolist() for c in contexts]
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
                turn_walls.append(time.perf_counter() - t0)
                contexts = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        wall = time.perf_counter() - t_all
        stats = core.scheduler.make_stats()
        prefix = getattr(stats, "prefix_cache_stats", None)
        steps = {"n": clock.calls["scheduler.build_connector_meta"]}  # once per scheduled step
        n = max(steps["n"], 1)
        ours = sum(clock.seconds.values())
        rows = [{"method": k, "calls": clock.calls[k], "total ms": v * 1e3, "us per step": v / n * 1e6,
                 "% of wall": 100 * v / wall} for k, v in clock.seconds.most_common()]
        rows.append({"method": "ALL connector methods", "calls": sum(clock.calls.values()), "total ms": ours * 1e3,
                     "us per step": ours / n * 1e6, "% of wall": 100 * ours / wall})
        title = (f"vLLM (CPU backend) with our host tier, Low Cache: {args.sessions} sessions x {args.turns} turns x "
                 f"{args.rounds} rounds, {steps['n']} engine steps, {wall:.1f} s wall, "
                 f"{1e3 * wall / n:.1f} ms per step")
        print_table(rows, title=title)
        summary = {"steps": steps["n"], "wall_s": wall, "ms_per_step": 1e3 * wall / n,
                   "connector_ms_per_step": 1e3 * ours / n, "connector_share_of_wall": ours / wall,
                   "turn_wall_s_median": statistics.median(turn_walls),
                   "prefix_cache_queries": getattr(prefix, "queries", None), "prefix_cache_hits": getattr(prefix, "hits", None)}
        print(f"connector: {summary['connector_ms_per_step']:.3f} ms per step, "
              f"{100 * summary['connector_share_of_wall']:.2f}% of the engine's wall time")
    shape = (f"Llama hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads / "
             f"{model.num_kv_heads} KV heads x {model.head_dim}, {args.dtype}")
    out = write_json(args.out, {"label": args.label, "model": shape, "args": vars(args), "summary": summary,
                                        "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
