"""One benchmark cell: a server up, the KV-event listener on, inference-perf, probes, checks.

Engine-neutral: the engine scripts pass the server command; this module measures and
checks. ``run_cell`` returns one JSON-able record; ``compare`` builds the guides' table.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.serving import perf, prom
from benchmarks.serving.events import KVEventListener
from benchmarks.serving.server import Server

OUR_HIT = "tpu_offload_hit_tokens_total"
EXTERNAL_HIT = "vllm:external_prefix_cache_hits_total"  # any connector's hits, as vLLM counts them
# Logged at ERROR level by the engine itself on a machine without the accelerator.
BENIGN_ERRORS = ("Failed to detect number of TPUs", "Unable to poll the TPU GCE Metadata")


@dataclasses.dataclass
class Cell:
    engine: str
    config: str  # "none" or a connector configuration name
    scenario: str  # "high" or "low"
    repeat: int
    server: Server
    events_endpoint: str | None
    model: str
    block_tokens: int
    chunk_blocks: int  # engine blocks per chunk of our tier (events carry one hash per block)
    connector: bool


def completion(url: str, model: str, ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    if ch.get("token_ids") is None:
        raise RuntimeError("the server returned no token_ids (needs return_token_ids support)")
    return list(ch["token_ids"])


def probe_prompts(n: int, length: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def probes(cell: Cell, prompts: list[list[int]], filler: list[list[int]], max_tokens: int = 16) -> dict:
    """Send each probe, push it out of the device cache with ``filler`` prompts, send it again.

    The second visit must come from our tier (when there is one) and must give exactly the
    tokens of the first visit; the engine script also compares them across configurations.
    """
    url, model = cell.server.url, cell.model
    first = [completion(url, model, p, max_tokens) for p in prompts]
    for f in filler:
        completion(url, model, f, 1)
    time.sleep(1.0)  # stores are submitted at the next engine step; let the last ones land
    before = prom.parse(cell.server.metrics())
    again = [completion(url, model, p, max_tokens) for p in prompts]
    time.sleep(1.5)  # stats reach /metrics with the engine's next stats push
    after = prom.parse(cell.server.metrics())
    return {
        "tokens_first": first, "tokens_revisit": again, "stable": first == again,
        "revisit_device_hit_tokens": prom.delta(before, after, "vllm:prefix_cache_hits_total"),
        "revisit_tier_hit_tokens": prom.delta(before, after, OUR_HIT),
        "revisit_external_hit_tokens": prom.delta(before, after, EXTERNAL_HIT),
    }


class Sampler:
    """RSS of the server tree and our host-tier gauges, every ``period`` seconds, in a thread."""

    def __init__(self, server: Server, period: float = 5.0):
        self.server, self.period = server, period
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.period):
            try:
                s = prom.parse(self.server.metrics())
                self.rows.append({
                    "t": time.monotonic() - t0, "rss": self.server.rss_bytes(),
                    "requests_done": prom.total(s, "vllm:request_success_total"),
                    "used_bytes": prom.total(s, "tpu_offload_tier_used_bytes", None, tier="cpu"),
                    "capacity_bytes": prom.total(s, "tpu_offload_tier_capacity_bytes", None, tier="cpu"),
                })
            except Exception:  # noqa: BLE001 - a missed sample is visible as a gap in t
                pass

    def stop(self) -> list[dict]:
        self._stop.set()
        self._t.join(timeout=30)
        return self.rows


def run_cell(cell: Cell, w: perf.Workload, workdir: Path, *, probe: tuple | None = None, sample: bool = False,
             background: perf.Background | None = None) -> dict:
    """``background``: other traffic sent by a second inference-perf run started with ``w``'s; the
    record's ``figures`` stay ``w``'s own, ``background`` holds the other run's, and the hit
    accounting checks the server's counters against both runs together."""
    label = f"{cell.engine}/{cell.config}/{cell.scenario}/r{cell.repeat}"
    listener = KVEventListener(cell.events_endpoint) if cell.events_endpoint else None
    try:
        time.sleep(1.0)  # ZMQ subscriptions take a moment; nothing has been sent yet
        before = prom.parse(cell.server.metrics())
        sampler = Sampler(cell.server) if sample else None
        other = Concurrent(background, cell, workdir / "perf-background", label) if background else None
        summary = perf.run(w, cell.server.url, cell.model, workdir / "perf", label)
        bg_summary = other.wait() if other else None
        samples = sampler.stop() if sampler else []
        time.sleep(2.0)
        after = prom.parse(cell.server.metrics())
        rec = {"engine": cell.engine, "config": cell.config, "scenario": cell.scenario, "repeat": cell.repeat,
               "startup_seconds": getattr(cell.server, "startup_seconds", None),
               "figures": perf.figures(summary), "hits": hit_accounting(before, after, summary, w, cell, bg_summary)}
        rec["scheduling"] = scheduling(before, after)
        if bg_summary is not None:
            rec["background"] = {**perf.figures(bg_summary), "wall_seconds": bg_summary["wall_seconds"],
                                 "agents_wall_seconds": summary["wall_seconds"]}
        if probe is not None:
            rec["probes"] = probes(cell, *probe)
        time.sleep(1.0)
        final = prom.parse(cell.server.metrics())
        rec["tier"] = tier_state(final)
        rec["rss_bytes_end"] = cell.server.rss_bytes()
        rec["log"] = log_findings(cell.server.tail(1 << 30))
        if samples:
            rec["samples"] = samples
        if listener is not None:
            time.sleep(1.0)
            rec["events"] = event_checks(listener, final, cell)
        return rec
    finally:
        if listener is not None:
            listener.close()


class Concurrent:
    """A second inference-perf run (other traffic) in a thread, beside the measured one."""

    def __init__(self, w: perf.Background, cell: Cell, workdir: Path, label: str):
        self._result: dict = {}
        self._t = threading.Thread(target=self._run, args=(w, cell, workdir, label + "/background"), daemon=True)
        self._t.start()

    def _run(self, w, cell: Cell, workdir: Path, label: str) -> None:
        try:
            self._result["summary"] = perf.run(w, cell.server.url, cell.model, workdir, label, progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by wait()
            self._result["error"] = e

    def wait(self, timeout_s: float = 1900) -> dict:
        self._t.join(timeout_s)  # perf.run kills its inference-perf past its own timeout first
        if "error" in self._result:
            raise RuntimeError(f"the other traffic's inference-perf run failed: {self._result['error']}")
        if "summary" not in self._result:
            raise TimeoutError("the other traffic's inference-perf run did not finish")
        return self._result["summary"]


def log_findings(text: str) -> dict:
    """Errors and recomputed loads the server logged (a failed load is recomputed, not an
    HTTP error, so inference-perf alone would not see it)."""
    lines = text.splitlines()
    errors = [ln for ln in lines if (" ERROR " in ln or ln.startswith("Traceback"))
              and not any(b in ln for b in BENIGN_ERRORS)]
    recomputed = [ln for ln in lines if "will be recomputed" in ln or "failed to load" in ln]
    return {"errors": len(errors), "recompute_warnings": len(recomputed), "first_error": errors[0][:300] if errors else None}


def hit_accounting(before: dict, after: dict, summary: dict, w: perf.Workload, cell: Cell,
                   other: dict | None = None) -> dict:
    """The server's hit counters by tier over a run, checked against inference-perf's counts
    (of both runs together when ``other`` traffic ran beside ``w``)."""
    d = lambda name, **kw: prom.delta(before, after, name, **kw)  # noqa: E731
    figs = [perf.figures(x) for x in (summary, other) if x is not None]
    device = d("vllm:prefix_cache_hits_total")
    external = d("vllm:external_prefix_cache_hits_total")
    ours_cpu, ours_fs = d(OUR_HIT, tier="cpu"), d(OUR_HIT, tier="fs")
    allowed = w.reusable_tokens(cell.block_tokens) if other is None else None
    cached = sum(f["cached_prompt_tokens"] or 0.0 for f in figs)
    prompt = sum(f["prompt_tokens"] or 0.0 for f in figs) if all(f["prompt_tokens"] is not None for f in figs) else None
    return {
        "server_prompt_tokens": d("vllm:prompt_tokens_total"), "perf_prompt_tokens": prompt,
        "device_hit_tokens": device, "external_hit_tokens": external,
        "tier_hit_tokens_cpu": ours_cpu, "tier_hit_tokens_fs": ours_fs,
        "perf_cached_tokens": cached, "reusable_tokens": allowed,
        "served_fraction_of_reusable": (device + external) / allowed if allowed else None,
        # vLLM's per-request cached tokens = device + connector hits of its first scheduling
        "server_vs_perf_cached_diff": device + external - cached,
        "ours_vs_external_diff": (ours_cpu + ours_fs - external
                                  if cell.connector and prom.total(after, OUR_HIT, None) is not None else None),
        "loaded_bytes": d("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU"),
        "stored_bytes": d("vllm:kv_offload_store_bytes_total"),
    }


def scheduling(before: dict, after: dict) -> dict:
    """What the engine's scheduler did over a run (every request, every stream): preemptions and
    the mean time requests waited in the queue and spent in prefill, from vLLM's own series (None
    where the engine does not export one)."""
    def mean(name: str) -> float | None:
        n = prom.delta(before, after, f"{name}_count")
        return prom.delta(before, after, f"{name}_sum") / n if n else None

    present = prom.total(after, "vllm:num_preemptions_total", None) is not None
    return {"preemptions": prom.delta(before, after, "vllm:num_preemptions_total") if present else None,
            "queue_s_mean": mean("vllm:request_queue_time_seconds"),
            "prefill_s_mean": mean("vllm:request_prefill_time_seconds")}


def tier_state(s: dict) -> dict:
    g = lambda name, **kw: prom.total(s, name, None, **kw)  # noqa: E731
    return {
        "capacity_bytes": g("tpu_offload_tier_capacity_bytes", tier="cpu"),
        "used_bytes": g("tpu_offload_tier_used_bytes", tier="cpu"),
        "capacity_chunks": g("tpu_offload_tier_capacity_chunks", tier="cpu"),
        "used_chunks": g("tpu_offload_tier_used_chunks", tier="cpu"),
        "stored_chunks": g("tpu_offload_stored_chunks_total", tier="cpu"),
        "evicted_chunks": g("tpu_offload_evicted_chunks_total", tier="cpu"),
        "pinned_or_pending_fraction": g("vllm:kv_offload_cpu_cache_usage_perc"),
        "pinned_chunks": g("tpu_offload_tier_pinned_chunks", tier="cpu"),
        "pending_chunks": g("tpu_offload_tier_pending_chunks", tier="cpu"),
        "fs_files": g("tpu_offload_fs_files"),  # chunk files the file tier knows (None: no file tier)
        "fs_reads": g("tpu_offload_fs_ops_total", op="read"),  # file -> host promotions, every outcome
        "leased_bytes": g("tpu_offload_tier_leased_bytes", tier="cpu"),
        "lease_honoured_chunks": g("tpu_offload_lease_honoured_chunks_total", tier="cpu"),
        "leases_expired": g("tpu_offload_leases_expired_total", tier="cpu"),
    }


def event_checks(listener: KVEventListener, final: dict, cell: Cell) -> dict:
    """Does the router's view (events) agree with the tier's own gauges?"""
    out = listener.summary()
    if not cell.connector:
        return out
    t = tier_state(final)
    if t["capacity_chunks"] is None:  # the tier's gauges are not on this server's /metrics
        out["checks"] = None
        out["missing_gauges"] = True
        return out
    cpu = out["by_medium"].get("CPU", {})
    bpc = cell.chunk_blocks
    stored, evicted, used = t["stored_chunks"] or 0, t["evicted_chunks"] or 0, t["used_chunks"] or 0
    promoted = t["fs_reads"] or 0  # a chunk promoted from its file enters the host tier too (one read: TP 1 here)
    out["checks"] = {
        "stored_chunks_metric": stored, "promoted_chunks_metric": promoted,
        "stored_chunk_events_cpu": cpu.get("stored_events", 0),
        "evicted_chunks_metric": evicted, "removed_blocks_cpu": cpu.get("removed_blocks", 0),
        "resident_blocks_events": cpu.get("resident_blocks", 0), "resident_blocks_tier": used * bpc,
        # >=: on vLLM a file-tier-hit run announced 8 host entries per run that neither the store
        # nor the file-read counters count; the entries still balance exits + residents (resident_match).
        "every_store_announced": cpu.get("stored_events", 0) >= stored + promoted if promoted
        else cpu.get("stored_events", 0) == stored,
        "unmetered_host_entries": cpu.get("stored_events", 0) - stored - promoted,
        "every_eviction_announced": cpu.get("removed_blocks", 0) == evicted * bpc,
        "resident_match": cpu.get("resident_blocks", 0) == used * bpc,
        "storage_medium_events": out["by_medium"].get("STORAGE", {}).get("stored_events", 0),
    }
    if t["fs_files"] is not None:  # the file tier: what the router believes is on the volume
        st = out["by_medium"].get("STORAGE", {})
        out["checks"].update({
            "resident_blocks_storage_events": st.get("resident_blocks", 0), "fs_files_metric": t["fs_files"],
            "storage_resident_match": st.get("resident_blocks", 0) == t["fs_files"] * bpc,
            "storage_payloads_complete": st.get("tokenless_stored_events", 0) == 0,
        })
    return out


def compare(records: list[dict]) -> list[dict]:
    """The guides' table: per (engine, scenario, config), medians over repeats and the change
    against the no-connector run of the same scenario; spread = (max-min)/median."""
    keys = ("ttft_mean", "ttft_p50", "ttft_p90", "e2e_mean", "e2e_p90", "input_tps", "output_tps", "total_tps")
    runs: dict = {}  # (engine, scenario, config) -> its records, one per repeat
    for r in records:
        runs.setdefault((r["engine"], r["scenario"], r["config"]), []).append(r)
    med = {k: {m: statistics.median([r["figures"][m] for r in rs if r["figures"].get(m) is not None]
                                    or [float("nan")]) for m in keys}
           for k, rs in runs.items()}
    rows = []
    for (engine, scenario, config), m in sorted(med.items(), key=lambda kv: (kv[0][0], kv[0][1] != "high", kv[0][2] != "none", kv[0][2])):
        base = med.get((engine, scenario, "none"))
        rs = runs[(engine, scenario, config)]
        fs = [r["figures"] for r in rs]
        row = {"engine": engine, "scenario": scenario, "config": config, "n": len(fs),
               "TTFT mean ms": m["ttft_mean"] * 1e3, "TTFT p50 ms": m["ttft_p50"] * 1e3, "TTFT p90 ms": m["ttft_p90"] * 1e3,
               "E2E mean s": m["e2e_mean"], "E2E p90 s": m["e2e_p90"],
               "in tok/s": m["input_tps"], "out tok/s": m["output_tps"], "total tok/s": m["total_tps"]}
        has_base = base is not None and config != "none"
        row["TTFT mean vs none %"] = 100 * (m["ttft_mean"] / base["ttft_mean"] - 1) if has_base else None
        row["TTFT p50 vs none %"] = 100 * (m["ttft_p50"] / base["ttft_p50"] - 1) if has_base else None
        hs = [r["hits"] for r in rs]
        for col, key in (("hit device", "device_hit_tokens"), ("hit host", "tier_hit_tokens_cpu"),
                         ("hit file", "tier_hit_tokens_fs"), ("hit other", None)):
            vals = [(h["external_hit_tokens"] - h["tier_hit_tokens_cpu"] - h["tier_hit_tokens_fs"]) if key is None
                    else h[key] for h in hs]
            row[col] = statistics.median(vals) if vals else None  # tokens per run (median over repeats)
        for col, key in (("preemptions", "preemptions"), ("queue s mean", "queue_s_mean"),
                         ("prefill s mean", "prefill_s_mean")):
            vals = [(r.get("scheduling") or {}).get(key) for r in rs]
            if any(v is not None for v in vals):
                row[col] = statistics.median(v for v in vals if v is not None)
        if any(r.get("background") for r in rs):  # other traffic ran beside: each run's own cached tokens
            row["cached: workload"] = statistics.median(r["figures"]["cached_prompt_tokens"] or 0 for r in rs)
            row["cached: other"] = statistics.median((r.get("background") or {}).get("cached_prompt_tokens") or 0
                                                     for r in rs)
        row["total tok/s vs none %"] = 100 * (m["total_tps"] / base["total_tps"] - 1) if has_base else None
        tps = [f["total_tps"] for f in fs if f["total_tps"]]
        row["tok/s spread %"] = 100 * (max(tps) - min(tps)) / statistics.median(tps) if len(tps) > 1 else None
        rows.append(row)
    return rows


def save(records: list[dict], path: Path) -> None:
    path.write_text(json.dumps(records, indent=1) + "\n")
