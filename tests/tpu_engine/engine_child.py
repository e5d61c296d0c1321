"""A second engine process: runs workloads on engines the parent describes.

``python engine_child.py JOB.json`` where the job is a list of runs
``{"shape": {...}, "model_dir": ..., "kv": {...}, "workload": name,
"env": {...}, "round_trip": bool}``; prints one JSON line per run. A plain
run reports the tokens and our connector's counters (none without one); a
round trip (any connector) runs the workload, lets finished saves be reported, resets vLLM's
prefix cache, runs it again and reports both passes' tokens and the prefix
tokens vLLM took from the connector. ``env`` is set before the engine starts
(tpu-inference's own connector is configured only by environment).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_run  # noqa: E402

engine_run.prepare_process()

NUDGE = [[5, 6, 7, 8, 9]]  # a tiny unrelated request: steps the engine so finished saves are reported


def round_trip(eng, w) -> dict:
    from offload_helpers import ExternalHits

    first = w.run(eng)
    time.sleep(0.5)
    for _ in range(2):
        eng.generate(NUDGE, 2)
    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:
        second = w.run(eng)
    return {"first": first, "second": second, "external_hits": took.tokens}


def main(path: str) -> None:
    from offload_helpers import totals
    from workloads import Workload

    for job in json.load(open(path)):
        os.environ.update(job.get("env", {}))
        eng = engine_run.EngineRun(job["model_dir"], engine_run.Shape(**job["shape"]), job["kv"])
        w = Workload.registry[job["workload"]]
        try:
            if job.get("round_trip"):
                result = round_trip(eng, w)
            else:
                result = {"tokens": w.run(eng), "totals": totals(eng) if job["kv"] else {}}
        finally:
            eng.close()
            for k in job.get("env", {}):
                os.environ.pop(k, None)
        print("RESULT " + json.dumps(result), flush=True)


def run_jobs(jobs: list[dict], work_dir, timeout_s: int = 1200, env: dict | None = None) -> list[dict]:
    """Run ``jobs`` in one child process (``env`` added to its environment); its results in order."""
    import subprocess

    path = os.path.join(str(work_dir), "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), path], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(jobs):
        raise AssertionError(f"engine child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
