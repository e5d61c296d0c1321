"""A second engine process: runs workloads on engines the parent describes.

``python engine_child.py JOB.json`` where the job is a list of runs
``{"shape": {...}, "model_dir": ..., "kv": {...}, "workload": name,
"env": {...}, "engine_kw": {...}, "round_trip": bool, "passes": int,
"count_compiles": bool, "control": bool, "zero_device": bool}`` (``engine_kw``: more ``vllm.LLM``
arguments); prints one JSON line per run. A plain
run reports the tokens and our connector's counters (none without one); a
round trip (any connector) runs the workload, lets finished saves be reported, resets vLLM's
prefix cache, runs it again and reports both passes' tokens and the prefix
tokens vLLM took from the connector. ``env`` is set before the engine starts
(tpu-inference's own connector is configured only by environment).
``count_compiles`` runs a served engine instead (see ``counted_run``).
The process's emulated device count and the engine's own precompile come
from ``run_jobs``' env (``engine_run.DEVICES_ENV``, ``PRECOMPILE_ENV``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from tpu_offload.testing import engine_run

engine_run.prepare_process()

NUDGE = [[5, 6, 7, 8, 9]]  # a tiny unrelated request: steps the engine so finished saves are reported


def round_trip(eng, w, passes: int = 2, zero_device: bool = False) -> dict:
    """``w`` on a cold cache, then ``passes - 1`` times more, each after vLLM's
    prefix cache was reset (and, with ``zero_device``, the device KV cache zeroed
    in place): every later pass must come from the connector."""
    from tpu_offload.testing.offload_helpers import ExternalHits, settle, zero_device_kv

    first = w.run(eng)
    later, hits = [], []
    for _ in range(passes - 1):
        time.sleep(0.5)
        for _ in range(2):
            eng.generate(NUDGE, 2)
        if type(eng.scheduler_connector).__module__.startswith("tpu_offload.connector"):  # ours: every store completed
            settle(eng)
        eng.reset_prefix_cache()
        if zero_device:
            zero_device_kv(eng)
        with ExternalHits(eng) as took:
            later.append(w.run(eng))
        hits.append(took.tokens)
    return {"first": first, "second": later[0] if later else None, "external_hits": hits[0] if hits else 0,
            "passes": [first, *later], "hits": hits}


def warm_up(eng) -> None:
    """What a served engine's warm-up does: one step in each of the engine's
    token buckets, with prompts shorter than a page (nothing is stored, nothing
    can hit). tpu-inference's precompile covers its jitted step functions, but
    it unpacks each step's inputs with an eager ``jnp.split``
    (``DeviceBuffer.unpack_arrays``), compiled on first use of each bucket."""
    from tpu_offload.testing.workloads import prompt

    for i, padded in enumerate(eng.runner.num_tokens_paddings):
        left, lens = padded // 2 + 1, []  # more than the bucket below holds
        while left > 0:
            lens.append(min(left, eng.shape.block_size - 1))
            left -= lens[-1]
        assert len(lens) <= eng.shape.max_num_seqs and padded // 2 + 1 <= eng.shape.max_num_batched_tokens
        eng.generate([prompt(90_000 + 100 * i + j, n) for j, n in enumerate(lens)], 2)


def _slab_bytes(max_slab_bytes: int) -> None:
    """Our worker's host slabs at most this many bytes each (this host's share;
    the one size no config sets), so a tiny tier spans several slabs as a
    720 GiB one does."""
    from tpu_offload.connector import worker

    init = worker.OffloadWorker.__init__

    def init_with_slab_bytes(self, *a, **kw):
        init(self, *a, **{**kw, "max_slab_bytes": max_slab_bytes})

    worker.OffloadWorker.__init__ = init_with_slab_bytes


def _timed_precompile() -> list[float]:
    """Seconds our connector's precompile takes at engine start (appended per call)."""
    from tpu_offload.jax_backend.engine import TransferEngine

    seconds: list[float] = []
    real = getattr(TransferEngine.precompile, "__wrapped__", TransferEngine.precompile)

    def precompile(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            seconds.append(time.perf_counter() - t0)

    precompile.__wrapped__ = real
    TransferEngine.precompile = precompile
    return seconds


def _record_batches(engine) -> dict[str, list[int]]:
    """Chunks per store and per load call of our transfer engine (a call larger
    than staging runs in several passes)."""
    seen: dict[str, list[int]] = {"store": [], "load": []}
    for kind in seen:
        real = getattr(engine, kind)

        def call(caches, chunks, *a, _real=real, _kind=kind, **kw):
            seen[_kind].append(len(chunks))
            return _real(caches, chunks, *a, **kw)

        setattr(engine, kind, call)
    return seen


def counted_run(job: dict) -> dict:
    """A served engine: it starts (precompiling, as this process's env says),
    warms up (``warm_up``), then runs the round trip; every XLA compile after
    the warm-up is reported by name. With ``control``, our connector's
    compiled programs are then dropped and the workload loaded once more:
    the counter must see those programs compile again."""
    from tpu_offload.testing.offload_helpers import CompileCounter, ExternalHits, totals, wrk
    from tpu_offload.testing.workloads import Workload

    w = Workload.registry[job["workload"]]
    if job.get("max_slab_bytes"):
        _slab_bytes(job["max_slab_bytes"])
    compiles = CompileCounter.install()
    ours_precompile = _timed_precompile()
    m0 = compiles.mark()
    t0 = time.perf_counter()
    eng = engine_run.EngineRun(job["model_dir"], engine_run.Shape(**job["shape"]), job["kv"],
                               **job.get("engine_kw", {}))
    try:
        out = {"start_s": time.perf_counter() - t0, "start_compiles": len(compiles.since(m0)),
               "ours_precompile_s": sum(ours_precompile)}
        ours = wrk(eng).engine.programs if job["kv"] else None
        out["ours_compiled_at_start"] = ours.compiles if ours else 0
        out["precompile_s"] = eng.runner.vllm_config.compilation_config.compilation_time  # 0: skipped
        m1 = compiles.mark()
        warm_up(eng)
        out["warmup_compiles"] = compiles.since(m1)
        batches = _record_batches(wrk(eng).engine) if ours else {}
        m2 = compiles.mark()
        t1 = time.perf_counter()
        out.update(round_trip(eng, w, job.get("passes", 2)))
        out["batches"] = batches
        out["served_s"] = time.perf_counter() - t1
        out["compiles_after_warmup"] = compiles.since(m2)
        out["totals"] = totals(eng) if job["kv"] else {}
        out["ours_compiled_at_end"] = ours.compiles if ours else 0
        out["cache_shape"] = list(eng.runner.kv_caches[0].shape)
        out["cache_dtype"] = str(eng.runner.kv_caches[0].dtype)
        out["devices"] = int(eng.runner.mesh.devices.size)
        out["slab_rows"] = list(ours.slab_rows) if ours else []
        if job.get("control") and ours:
            ours._cache.clear()
            m3 = compiles.mark()
            eng.reset_prefix_cache()
            with ExternalHits(eng) as took:
                out["control_tokens"] = w.run(eng)
            out["control_hits"] = took.tokens
            out["control_compiles"] = compiles.since(m3)
    finally:
        eng.close()
    return out


def main(path: str) -> None:
    from tpu_offload.testing.offload_helpers import totals
    from tpu_offload.testing.workloads import Workload

    from tpu_offload.testing.offload_helpers import wrk
    from tpu_offload.core.fs import fileio

    for job in json.load(open(path)):
        os.environ.update(job.get("env", {}))
        fault = job.get("fault")  # {"op": "read", "hang_s": s}: a hung mount, at the file tier's syscall wrapper
        if fault:
            fileio.fault = lambda op, f=fault: time.sleep(f["hang_s"]) if op == f["op"] else None
        try:
            if job.get("count_compiles"):
                result = counted_run(job)
            else:
                eng = engine_run.EngineRun(job["model_dir"], engine_run.Shape(**job["shape"]), job["kv"],
                               **job.get("engine_kw", {}))
                w = Workload.registry[job["workload"]]
                try:
                    if job.get("round_trip"):
                        result = round_trip(eng, w, job.get("passes", 2), job.get("zero_device", False))
                    else:
                        t0 = time.perf_counter()
                        result = {"tokens": w.run(eng), "totals": totals(eng) if job["kv"] else {}}
                        result["run_s"] = time.perf_counter() - t0
                        fs = getattr(wrk(eng), "fs", None) if job["kv"] else None
                        result["tier_counters"] = fs.tier.counters() if fs is not None else {}
                finally:
                    eng.close()
        finally:
            fileio.fault = None
            for k in job.get("env", {}):
                os.environ.pop(k, None)
        print("RESULT " + json.dumps(result), flush=True)


def run_jobs(jobs: list[dict], work_dir, timeout_s: int = 1200, env: dict | None = None) -> list[dict]:
    """Run ``jobs`` in one child process (``env`` added to its environment); its results in order.
    The child imports ``tpu_offload`` from this checkout (on its PYTHONPATH), as this process does."""
    import subprocess

    path = os.path.join(str(work_dir), "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    pythonpath = os.pathsep.join(p for p in (str(engine_run.REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), path], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})})
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(jobs):
        raise AssertionError(f"engine child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
