"""The load decision on a throttled FUSE mount: the rows both engines' benchmarks print.

``bench_load_decision.py`` (vLLM) and ``bench_load_decision_tpu.py`` (tpu-inference) put their file tier's
directory on ``tpu_offload/testing/throttled_mount.py`` (a FUSE passthrough with ``direct_io``, a latency
per read request and a bandwidth cap shared by all reads) and hand this module three callables:
``fresh()`` (a new prompt computed and stored: ``(prompt, ttft_s)``), ``file_hit(prompt, mode)`` (its TTFT
with the hit only in files, in that load-decision mode: ``(ttft_s, chunks loaded from files)``) and
``fit()`` (what the decision believes). Speeds are the whole hit's read time as a multiple of its recompute
time (0: unthrottled), the recompute time being the median TTFT of three cold prompts after a first one.
Each speed starts as an engine started on that mount would: what the decision learned of the file tier at
other speeds is forgotten and the probe prices the mount before the first request (``as_started``).
Nothing is learned untimed: every file hit is a sample, the first one after that start included (the
rotation starts with ``auto``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

MODES = ("always", "never", "auto")
ROTATION = ("auto", "always", "never")  # rep r starts at ROTATION[r % 3]: the first file hit is auto's
PROBE_WAIT_S = 300.0  # the most a speed change waits for the probe to price the mount (3 whole-file reads)


def as_started(cost_model, probe, timeout_s: float = PROBE_WAIT_S) -> bool:
    """The file tier's cost as an engine just started on this mount knows it: what was learned at other
    speeds forgotten, then the probe's timed reads (its idle interval shortened until it has run)."""
    from tpu_offload.core import costs

    fresh = costs.CostModel().tiers[costs.FILE]
    cost_model.tiers[costs.FILE] = probe.cost = fresh
    n, interval = probe.probes, probe.interval_s
    probe.interval_s = 0.5
    try:
        deadline = time.monotonic() + timeout_s
        while probe.probes < n + 2 and time.monotonic() < deadline:  # two sizes: header, whole file
            time.sleep(0.1)
        return probe.probes >= n + 2
    finally:
        probe.interval_s = interval


def rotated(reps: int, fresh: Callable, file_hit: Callable, order=ROTATION):
    """Per repetition a fresh prompt, sent once per mode in an order rotated per repetition."""
    samples = {m: [] for m in MODES}
    loaded = {m: [] for m in MODES}
    for r in range(reps):
        p, _ = fresh()
        for m in order[r % 3:] + order[: r % 3]:  # each mode in each position: no order bias
            t, n = file_hit(p, m)
            samples[m].append(t)
            loaded[m].append(n)
    return samples, loaded


def speed_rows(args, mount, *, fresh: Callable, file_hit: Callable, fit: Callable, cost_model, probe,
               ns_dir: str, hit_chunks: int):
    """``args``: ``speeds``, ``latency_ms``, ``reps``. Returns (rows, samples by speed, calibration)."""
    colds = [fresh()[1] for _ in range(4)]  # the engine's warm-up; the first pays one-off costs
    recompute_s = statistics.median(colds[1:])
    chunk_file = max(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ns_dir)
                     for f in fs if not f.startswith("."))
    hit_bytes = hit_chunks * chunk_file
    rows, raw, speeds = [], {}, {}
    for speed in args.speeds:
        mbps = hit_bytes / (speed * recompute_s) / 1e6 if speed else 0.0
        mount.set(args.latency_ms if speed else 0.0, mbps)
        probed = as_started(cost_model, probe)
        samples, loaded = rotated(args.reps, fresh, file_hit)
        med = {m: statistics.median(v) for m, v in samples.items()}
        best = min(med["always"], med["never"])
        name = "fast" if not speed else f"{speed:g}x recompute"
        rows.append({"mount": name, "latency ms": args.latency_ms if speed else 0.0, "cap MB/s": mbps,
                     "always s": med["always"], "never s": med["never"], "auto s": med["auto"],
                     "auto vs best": med["auto"] / best,
                     "auto worst x recompute": max(samples["auto"]) / med["never"],
                     "auto loads": f"{sum(1 for n in loaded['auto'] if n)} of {args.reps}", **fit()})
        raw[name] = {"ttft_s": samples, "chunks_loaded": loaded}
        speeds[name] = {"speed": speed, "latency_ms": args.latency_ms if speed else 0.0, "mbps": mbps,
                        "probed": probed}
    return rows, raw, {"calibration": {"cold_ttft_s": colds, "recompute_s": recompute_s, "hit_chunks": hit_chunks,
                                       "chunk_file_bytes": chunk_file, "hit_bytes": hit_bytes},
                       "speeds": speeds}
