"""Demo: our TPU connector restores a shared prompt prefix inside the real tpu-inference engine.

    .venv-tpu/bin/python demos/tpu_inference_demo.py      (``make demo`` runs it)

tpu-inference 0.32 (vLLM's scheduler, ``TpuPlatform``, ``TPUWorker``,
``TPUModelRunner``, flax model, sampler) on JAX's CPU backend, through the
test suite's CPU support (``tpu_offload/testing/cpu_support.py``: it replaces
only the TPU-only calls). A random Llama is written to a temp dir (no
download). Several prompts share a long prefix; pass 1 computes them and the
connector stores their KV, ``reset_prefix_cache()`` empties the engine's own
cache, pass 2 gets the prefix back from the connector's host tier. Shown
for our ``TPUOffloadConnector`` (``configs/tpu-inference/offload.json``,
sizes overridden for the tiny model) and, on the same prompts, for
tpu-inference's own ``TPUOffloadConnector`` (configured by ``TPU_OFFLOAD_*``
environment), with the same host bytes and staging blocks, and for
tpu-inference's ``RaidenOffloadConnector`` (no staging: each block copied
between the cache and host memory by the tpu-sync wheel, through
``tpu_offload/testing/raiden_adapter.py``), as shipped and with the ordering fix
(a step's saves wait for its forward). All are checked against a
no-connector engine's tokens; the Raiden rows are shown, not gated on.

Processes: one for the no-connector baseline and ours, one for each of
tpu-inference's connectors: they and ours export the same ``tpu_inference:prefix_cache_*`` metric names, so
they cannot share a Prometheus registry. Each connector engine first does
one untimed round trip on other prompts with the same shapes (JAX compiles
every new shape; a compile must not land in a timed TTFT).

Measures, the same way for both connectors: TTFT is vLLM's per-request
``first_token_latency``; "tokens served" are the prefix tokens vLLM took
from the connector (``update_state_after_alloc``); load errors are the block
ids the worker reported to vLLM (``get_block_ids_with_load_errors``). Bytes
and load time are each connector's own figures: ours from its counters,
theirs from its ``TPUKVCacheMetrics`` records (per-request load time,
scatter included), Raiden's from the blocks its copy calls name (it does not
wait for its loads, so it has no load time). On CPU every memory kind is the same RAM: the figures
show the engines' step structure, not a TPU's DMA speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tpu_offload.testing import engine_run  # noqa: E402  (imports neither JAX nor vLLM)
from tpu_offload.testing.tiny_models import TinyLlama  # noqa: E402

# head_dim 128: the RPA v3 cache layout a TPU deployment uses. Big enough that
# prefill dominates a step, small enough for the whole demo in a few minutes
# on 2 CPU cores.
MODEL = TinyLlama(name="demo", num_heads=4, num_kv_heads=2, hidden_size=512, num_layers=6, head_dim=128,
                  intermediate_size=1408, max_position=8192)
DTYPE = "float32"
BLOCK = 128  # tokens per KV block (the tpu-v7 overlay's block size); one host chunk = one block
STAGING_BLOCKS = 64  # both connectors
THEIR_CONNECTOR = "tpu_inference.offload.tpu_offload_connector"
NUDGE = [5, 6, 7, 8, 9]  # a tiny unrelated request: steps the engine so finished stores are reported


def prompts_for(seed: int, n: int, prefix: int, suffix: int) -> list[list[int]]:
    from tpu_offload.testing.workloads import shared_prefix

    return shared_prefix(seed, prefix, n, suffix)


def host_bytes(args) -> int:
    """Room for every chunk of both rounds (warm-up and timed), with margin."""
    blocks = 2 * (args.prefix + args.prompts * (args.suffix + BLOCK)) // BLOCK + 16
    return blocks * BLOCK * MODEL.kv_bytes_per_token(4 if DTYPE == "float32" else 2)


def shape(args) -> engine_run.Shape:
    n_tok = args.prefix + args.suffix
    max_len = (n_tok + args.max_tokens + BLOCK - 1) // BLOCK * BLOCK + BLOCK
    blocks = args.prompts * (max_len // BLOCK) + 4  # every prompt's own copy fits: no device pressure
    return engine_run.Shape(MODEL.name, DTYPE, tp=args.tp, block_size=BLOCK, num_blocks=blocks,
                            max_num_seqs=args.prompts, max_num_batched_tokens=args.batched_tokens,
                            max_model_len=max_len)


# ---- child process: one or two engines --------------------------------------------------------
def say(msg: str) -> None:
    print("DEMO " + msg, flush=True)


def generate(eng, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs], [o.metrics.first_token_latency for o in outs],
            [o.num_cached_tokens or 0 for o in outs])


class Probe:
    """Counts what one connector did, installed on the live engine's instances."""

    def __init__(self, eng, which: str):
        self.eng, self.which = eng, which
        self.hit_tokens = 0
        self.error_blocks = 0
        self.theirs = {"d2h_bytes": 0, "h2d_bytes": 0, "h2d_seconds": 0.0}
        sched, worker = eng.scheduler_connector, eng.worker_connector
        took, errors = sched.update_state_after_alloc, worker.get_block_ids_with_load_errors

        def update_state_after_alloc(request, blocks, num_external_tokens):
            self.hit_tokens += num_external_tokens
            return took(request, blocks, num_external_tokens)

        def get_block_ids_with_load_errors():
            bad = errors()
            self.error_blocks += len(bad)
            return bad

        sched.update_state_after_alloc = update_state_after_alloc
        worker.get_block_ids_with_load_errors = get_block_ids_with_load_errors
        if which in RAIDEN:  # bytes named by its copy calls (one block, all layers, per id)
            manager, block = worker.connector_worker.raiden_manager, BLOCK * MODEL.kv_bytes_per_token(
                4 if DTYPE == "float32" else 2)
            d2h, h2d = manager.d2h_auto_allocate, manager.h2d

            def d2h_auto_allocate(src, *a, **kw):
                self.theirs["d2h_bytes"] += len(src) * block
                return d2h(src, *a, **kw)

            def h2d_counted(src, *a, **kw):
                self.theirs["h2d_bytes"] += len(src) * block
                return h2d(src, *a, **kw)

            manager.d2h_auto_allocate, manager.h2d = d2h_auto_allocate, h2d_counted
            self.theirs["h2d_seconds"] = float("nan")
        if which == "theirs":  # its metrics logger thread clears the lists: count at the source
            from tpu_inference.offload.metrics import TPUKVCacheMetrics

            m = TPUKVCacheMetrics.get_or_create()
            for name, key in (("record_d2h_bytes", "d2h_bytes"), ("record_h2d_bytes", "h2d_bytes"),
                              ("record_h2d_transfer_latency", "h2d_seconds")):
                setattr(m, name, self._counting(getattr(m, name), key))

    def _counting(self, real, key):
        def record(value):
            self.theirs[key] += value
            return real(value)

        return record

    def counters(self) -> dict:
        """Bytes stored, bytes loaded, load seconds, hit tokens, load-error blocks since start."""
        if self.which == "ours":
            t = self.eng.worker_connector.worker.totals
            moved = {"stored": t.get("store_bytes", 0), "loaded": t.get("load_bytes", 0),
                     "load_s": t.get("load_seconds", 0.0)}
        else:
            moved = {"stored": self.theirs["d2h_bytes"], "loaded": self.theirs["h2d_bytes"],
                     "load_s": self.theirs["h2d_seconds"]}
        return {**moved, "hits": self.hit_tokens, "errors": self.error_blocks}

    def stores_pending(self) -> bool:
        if self.which == "ours":
            return self.eng.scheduler_connector.scheduler.has_pending_work()
        if self.which in RAIDEN:
            return bool(self.eng.scheduler_connector.connector_scheduler._pending_save_hashes)
        return bool(self.eng.scheduler_connector.connector_scheduler._reqs_being_saved)

    def settle(self, timeout_s: float = 120.0) -> None:
        """Step the engine until every store has landed, so the reset cannot race one."""
        deadline = time.monotonic() + timeout_s
        while True:
            generate(self.eng, [NUDGE], 1)
            if not self.stores_pending():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.which}: stores still pending after {timeout_s:.0f} s")
            time.sleep(0.05)


def round_trip(eng, probe: Probe, prompts, max_tokens: int) -> dict:
    """Pass 1 (compute, store), reset the engine's prefix cache, pass 2 (restore)."""
    c0 = probe.counters()
    out_a, ttft_a, cached_a = generate(eng, prompts, max_tokens)
    probe.settle()
    c1 = probe.counters()
    eng.reset_prefix_cache()
    out_b, ttft_b, cached_b = generate(eng, prompts, max_tokens)
    probe.settle()
    c2 = probe.counters()
    eng.reset_prefix_cache()
    return {"first": out_a, "second": out_b, "ttft_first": ttft_a, "ttft_second": ttft_b,
            "cached_first": cached_a, "cached_second": cached_b,
            "stored": c1["stored"] - c0["stored"], "loaded": c2["loaded"] - c1["loaded"],
            "load_s": c2["load_s"] - c1["load_s"], "hits": c2["hits"] - c1["hits"],
            "errors": c2["errors"] - c0["errors"]}


RAIDEN = ("raiden-shipped", "raiden-ordered")
WHO = {"ours": "our connector", "theirs": "tpu-inference's connector",
       "raiden-shipped": "Raiden as shipped", "raiden-ordered": "Raiden with the ordering fix"}


def kv_config(which: str, args) -> dict:
    if which == "ours":
        return engine_run.kv_transfer_config("offload.json", cpu_bytes=host_bytes(args), staging_blocks=STAGING_BLOCKS)
    if which in RAIDEN:
        from tpu_offload.testing import raiden_adapter

        return raiden_adapter.kv_transfer_config(ordered=which == "raiden-ordered")
    return engine_run.their_kv_transfer_config()


def their_env(args) -> dict[str, str]:
    chunk = BLOCK * MODEL.kv_bytes_per_token(4 if DTYPE == "float32" else 2)
    return {"TPU_OFFLOAD_NUM_CPU_CHUNKS": str(host_bytes(args) // chunk),
            "TPU_OFFLOAD_NUM_STAGING_BLOCKS": str(STAGING_BLOCKS), "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}


def child(args) -> None:
    engine_run.prepare_process()  # before JAX is imported; clears TPU_OFFLOAD_* (ours reads them too)
    from tpu_offload.testing import cpu_support

    cpu_support.apply()
    result: dict = {}
    prompts = prompts_for(1, args.prompts, args.prefix, args.suffix)
    warm = prompts_for(99, args.prompts, args.prefix, args.suffix)
    if args.child == "ours":
        say("no-connector baseline: starting the engine")
        eng = engine_run.EngineRun(args.model_dir, shape(args))
        try:
            result["baseline"] = generate(eng, prompts, args.max_tokens)[0]
        finally:
            eng.close()
    else:
        os.environ.update(their_env(args))
    who = WHO[args.child]
    say(f"{who}: starting the engine")
    t0 = time.perf_counter()
    eng = engine_run.EngineRun(args.model_dir, shape(args), kv_config(args.child, args))
    result["start_s"] = time.perf_counter() - t0
    try:
        probe = Probe(eng, args.child)
        say(f"{who}: warm-up round trip (compiles every shape the timed one uses)")
        round_trip(eng, probe, warm, args.max_tokens)
        say(f"{who}: timed round trip")
        result.update(round_trip(eng, probe, prompts, args.max_tokens))
    finally:
        eng.close()
    Path(args.out).write_text(json.dumps(result))


# ---- parent: build the model, run the children, print the tables --------------------------------
def run_child(which: str, model_dir: str, work: Path, args) -> dict:
    out, log = work / f"{which}.json", work / f"{which}.log"
    cmd = [sys.executable, __file__, "--child", which, "--model-dir", model_dir, "--out", str(out),
           "--prompts", str(args.prompts), "--prefix", str(args.prefix), "--suffix", str(args.suffix),
           "--max-tokens", str(args.max_tokens), "--batched-tokens", str(args.batched_tokens), "--tp", str(args.tp)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if line.startswith("DEMO "):
                print("  " + line[5:], end="", flush=True)
            f.write(line)
        rc = proc.wait()
    if rc or not out.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-60:])
        raise SystemExit(f"the {which} engine process failed (rc {rc}); the end of its log:\n{tail}")
    return json.loads(out.read_text())


def table(title: str, r: dict, baseline: list[list[int]]) -> bool:
    print(title)
    print(f"{'request':>8} {'TTFT recompute':>15} {'TTFT restored':>14} {'speedup':>8} {'cached tokens':>14}")
    for i, (a, b, c) in enumerate(zip(r["ttft_first"], r["ttft_second"], r["cached_second"])):
        print(f"{i:>8} {a * 1e3:>12.1f} ms {b * 1e3:>11.1f} ms {a / b:>7.1f}x {c:>14}")
    a, b = max(r["ttft_first"]), max(r["ttft_second"])
    print(f"{'all':>8} {a * 1e3:>12.1f} ms {b * 1e3:>11.1f} ms {a / b:>7.1f}x   (until the last first token)")
    print()
    same = r["first"] == baseline and r["second"] == baseline
    print(f"tokens served from the host tier : {r['hits']}")
    print(f"bytes stored  (device -> host)   : {r['stored'] / 2**20:.1f} MiB")
    took = "(its loads are not waited for)" if r["load_s"] != r["load_s"] else f"in {r['load_s'] * 1e3:.1f} ms"
    print(f"bytes loaded  (host -> device)   : {r['loaded'] / 2**20:.1f} MiB {took}")
    print(f"load errors                      : {r['errors']}")
    print(f"outputs identical                : {'yes' if same else 'NO'} (both passes vs no connector)")
    print()
    return same and r["hits"] > 0 and r["errors"] == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (whole blocks of 128 hit)")
    ap.add_argument("--suffix", type=int, default=128, help="unique tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batched-tokens", type=int, default=1024, help="the engine's max_num_batched_tokens")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2, 4),
                    help="tensor parallel size over emulated CPU devices (the model has 2 KV heads: 4 replicates them)")
    ap.add_argument("--child", choices=tuple(WHO), help=argparse.SUPPRESS)
    ap.add_argument("--no-raiden", action="store_true", help="skip tpu-inference's RaidenOffloadConnector")
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0

    t_start = time.perf_counter()
    m = MODEL
    with tempfile.TemporaryDirectory(prefix="tpu_offload_tpu_demo_") as tmp:
        print(f"building random Llama: hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads / "
              f"{m.num_kv_heads} KV heads x {m.head_dim}, {DTYPE} ...", flush=True)
        model_dir = m.write(os.path.join(tmp, "model"), DTYPE)
        ours = run_child("ours", model_dir, Path(tmp), args)
        theirs = run_child("theirs", model_dir, Path(tmp), args)
        raiden = {} if args.no_raiden else {w: run_child(w, model_dir, Path(tmp), args) for w in RAIDEN}
    base = ours["baseline"]

    n_tok = args.prefix + args.suffix
    print()
    print(f"{args.prompts} prompts x {n_tok} tokens ({args.prefix} shared + {args.suffix} unique), sent together, "
          f"{args.max_tokens} new tokens each, tpu-inference 0.32 on JAX CPU "
          f"(TP {args.tp}, {DTYPE}, {BLOCK}-token blocks)")
    print()
    ok_ours = table("ours: tpu_offload.connector.TPUOffloadConnector (configs/tpu-inference/offload.json)", ours, base)
    ok_theirs = table(f"theirs: {THEIR_CONNECTOR}.TPUOffloadConnector (TPU_OFFLOAD_* env)", theirs, base)
    a, b = max(ours["ttft_second"]), max(theirs["ttft_second"])
    reload = [r["loaded"] / r["stored"] if r["stored"] else float("nan") for r in (ours, theirs)]
    print(f"ours vs tpu-inference's, restored pass: last first token {a * 1e3:.1f} vs {b * 1e3:.1f} ms "
          f"({b / a:.2f}x); host->device bytes per byte stored {reload[0]:.1f} vs {reload[1]:.1f}")
    if raiden:
        table("Raiden as shipped: tpu_inference.offload.raiden_offload_connector.RaidenOffloadConnector "
              "(tpu-sync wheel through tpu_offload/testing/raiden_adapter.py)", raiden["raiden-shipped"], base)
        table("Raiden with the ordering fix (not in tpu-inference): a step's saves wait for its forward",
              raiden["raiden-ordered"], base)
    print(f"total tpu-inference demo time    : {time.perf_counter() - t_start:.0f} s")
    return 0 if ok_ours and ok_theirs else 1


if __name__ == "__main__":
    raise SystemExit(main())
