"""The engine step thread's time inside each KV connector, per save pass and per restore pass.

    .venv-tpu/bin/python benchmarks/bench_step_thread_tpu.py [--repeats 3] [--prompts 4] [--prompt-len 1152]

tpu-inference 0.32 on JAX's CPU backend (tpu_offload/testing/cpu_support.py), TP 1, bf16, each
connector's engine in its own process (tpu-inference's connectors and ours export the same
``tpu_inference:prefix_cache_*`` metric names): ours (``configs/tpu-inference/offload.json``),
tpu-inference's ``TPUOffloadConnector``, and tpu-inference's ``RaidenOffloadConnector`` through
tpu_offload/testing/raiden_adapter.py, as shipped and with the ordering fix (a step's saves wait for
its forward). Every connector method the engine calls on its step thread is timed as it runs
(vLLM's ``KVConnectorModelRunnerMixin``, which tpu-inference's runner uses: bind and clear the
metadata, ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``/``get_finished``, load
errors, stats, events, worker metadata; ``wait_for_layer_load`` and ``save_kv_layer`` too, which
tpu-inference's JAX models never call), nested calls counted once, summed per pass:

* save pass: the prompts on a cold cache, then the steps that report the stores complete
  (ours: until none is pending; every connector: two one-token requests after it);
* restore pass: the same prompts after vLLM's prefix cache is reset and the device KV cache is
  zeroed in place, so every token comes from what the connector restored.

One untimed repeat first (new shapes compile), then ``--repeats`` timed ones, each on new
prompts; medians. "identical" says whether every restore pass gave the cold pass's tokens.
Results: table and ``results/step_thread_tpu.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from tpu_offload.testing import engine_run  # noqa: E402  (imports neither JAX nor vLLM)

engine_run.prepare_process()

from tpu_offload.testing import raiden_adapter  # noqa: E402  (imports neither JAX nor vLLM until the engine asks)
from _common import MethodClock, print_table, write_json  # noqa: E402

# What the engine calls on the worker-side connector, on its step thread (vLLM's mixin).
STEP_METHODS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                "wait_for_save", "get_transfer_results", "get_finished", "get_block_ids_with_load_errors",
                "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
                "clear_connector_metadata", "handle_preemptions")
CONNECTORS = ("ours", "theirs", "raiden-shipped", "raiden-ordered")
HOST_BLOCKS = 2048  # tpu-inference's connectors: host blocks (every repeat's blocks fit, nothing evicted)
ENVS = {"theirs": {"TPU_OFFLOAD_NUM_CPU_CHUNKS": str(HOST_BLOCKS), "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64",
                   "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"},
        "raiden-shipped": {"TPU_OFFLOAD_NUM_CPU_CHUNKS": str(HOST_BLOCKS)},
        "raiden-ordered": {"TPU_OFFLOAD_NUM_CPU_CHUNKS": str(HOST_BLOCKS)}}
NUDGE = [[5, 6, 7, 8, 9]]


def kv_config(which: str) -> dict:
    if which == "ours":
        return engine_run.kv_transfer_config("offload.json", cpu_bytes="512MiB", staging_blocks=64)
    if which == "theirs":
        return engine_run.their_kv_transfer_config()
    return raiden_adapter.kv_transfer_config(ordered=which == "raiden-ordered")


def step_clock(conn) -> MethodClock:
    """Seconds and calls inside the worker connector's step-thread methods (``take``: since the last one)."""
    clock = MethodClock()
    for name in STEP_METHODS:
        clock.wrap(conn, name)
    return clock


def copy_calls(eng, which: str) -> collections.Counter:
    """Counts each transfer call the worker issues (ours: one store/load per batch; Raiden: one
    ``d2h_auto_allocate`` per saving request, one ``h2d`` per loading request)."""
    seen = collections.Counter()
    if which == "ours":
        target, names = eng.worker_connector.worker.engine, ("store", "load")
    elif which.startswith("raiden"):
        target, names = eng.worker_connector.connector_worker.raiden_manager, ("d2h_auto_allocate", "h2d")
    else:
        return seen
    for name in names:
        real = getattr(target, name)

        def call(*a, _real=real, _name=name, **kw):
            seen[_name] += 1
            return _real(*a, **kw)

        setattr(target, name, call)
    return seen


def forward_wait_ms(eng) -> float:
    """The ordering fix's wait for the forward since the last call (part of ``wait_for_save``'s time)."""
    conn = eng.worker_connector
    ms = getattr(conn, "forward_wait_s", 0.0) * 1e3
    if hasattr(conn, "forward_wait_s"):
        conn.forward_wait_s = 0.0
    return ms


def measure(which: str, model_dir: str, shape, repeats: int, prompts: int, prompt_len: int) -> dict:
    from tpu_offload.testing.offload_helpers import ExternalHits, settle, zero_device_kv
    from tpu_offload.testing.workloads import prompt

    os.environ.update(ENVS.get(which, {}))
    eng = engine_run.EngineRun(model_dir, shape, kv_config(which))
    try:
        clock = step_clock(eng.worker_connector)
        copies = copy_calls(eng, which)
        rows = []
        for r in range(repeats + 1):
            batch = [prompt(7000 + 100 * r + i, prompt_len) for i in range(prompts)]
            clock.take()
            copies.clear()
            cold = eng.generate(batch, 8)
            if which == "ours":
                settle(eng)
            for _ in range(2):
                eng.generate(NUDGE, 2)
            save_ms, save_calls = clock.take()
            save_copies = dict(copies)
            save_wait_ms = forward_wait_ms(eng)
            eng.reset_prefix_cache()
            zero_device_kv(eng)
            copies.clear()
            with ExternalHits(eng) as took:
                restored = eng.generate(batch, 8)
            restore_ms, restore_calls = clock.take()
            restore_wait_ms = forward_wait_ms(eng)
            rows.append({"save_ms": save_ms, "restore_ms": restore_ms, "identical": restored == cold,
                         "save_forward_wait_ms": save_wait_ms, "restore_forward_wait_ms": restore_wait_ms,
                         "hit_tokens": took.tokens, "save_calls": save_calls, "restore_calls": restore_calls,
                         "save_copies": save_copies, "restore_copies": dict(copies), "warm_up": r == 0})
    finally:
        eng.close()
    return {"repeats": rows}


def one(args) -> None:
    """Child mode: one engine, one measurement, printed as JSON."""
    from tpu_offload.testing import cpu_support
    from tpu_offload.testing.tiny_models import KV4

    cpu_support.apply()
    blocks = args.prompts * (args.prompt_len // 16 + 2) + 16
    shape = engine_run.Shape("kv4", "bfloat16", tp=1, block_size=16, num_blocks=blocks,
                             max_model_len=args.prompt_len + 64, max_num_batched_tokens=512)
    model_dir = KV4.write(os.path.join(tempfile.gettempdir(), "tpu_offload_bench_kv4_bf16"), "bfloat16")
    res = measure(args.one, model_dir, shape, args.repeats, args.prompts, args.prompt_len)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1152)
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--one", choices=CONNECTORS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)

    common = ["--repeats", str(args.repeats), "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
    results, rows = {}, []
    for which in args.connectors.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", which, *common],
                              capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
        results[which] = json.loads(lines[-1][7:])["repeats"]
        timed = [x for x in results[which] if not x["warm_up"]]
        last = timed[-1]
        rows.append({
            "connector": which,
            "save pass ms": statistics.median(x["save_ms"] for x in timed),
            "restore pass ms": statistics.median(x["restore_ms"] for x in timed),
            "of which forward wait save/restore": f"{statistics.median(x['save_forward_wait_ms'] for x in timed):,.0f}/"
                                                  f"{statistics.median(x['restore_forward_wait_ms'] for x in timed):,.0f}",
            "identical": all(x["identical"] for x in results[which]),
            "hit tokens": statistics.median(x["hit_tokens"] for x in timed),
            "copy calls save/restore": (f"{sum(last['save_copies'].values())}/{sum(last['restore_copies'].values())}"
                                        if last["save_copies"] or last["restore_copies"] else "-"),
            "steps save/restore": f"{last['save_calls'].get('wait_for_save', 0)}/"
                                  f"{last['restore_calls'].get('wait_for_save', 0)}",
        })
    print_table(rows, title=f"step-thread time in the connector per pass, tpu-inference on CPU, TP 1, bf16, "
                            f"{args.prompts} x {args.prompt_len}-token prompts, median of {args.repeats}")
    path = write_json("step_thread_tpu", {"args": vars(args), "rows": rows, "repeats": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
