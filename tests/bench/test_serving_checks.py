"""The serving benchmarks' verdict (benchmarks/serving/matrix.py ``check``): what fails a run and
what it only notes. No engine, no server: records shaped as ``harness.run_cell`` writes them."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from benchmarks.serving import matrix  # noqa: E402


def record(config="host", ours=1024.0, external=1024.0, preemptions=0.0, revisit=512.0, capacity=270.0):
    return {"engine": "vllm", "config": config, "scenario": "high", "repeat": 0, "device_blocks": 45,
            "figures": {"requests_failed": 0},
            "hits": {"perf_prompt_tokens": 10, "server_prompt_tokens": 10, "server_vs_perf_cached_diff": 0,
                     "tier_hit_tokens_cpu": ours, "tier_hit_tokens_fs": 0.0, "external_hit_tokens": external,
                     "ours_vs_external_diff": ours - external},
            "probes": {"stable": True, "tokens_first": [[1]] * 4, "tokens_revisit": [[1]] * 4,
                       "revisit_tier_hit_tokens": revisit, "revisit_external_hit_tokens": revisit},
            "router": {"chunk_tokens": 128, "capacity_chunks_gauge": capacity, "capacity_chunks_expected": capacity},
            "tier": {"capacity_chunks": capacity, "used_bytes": 0, "capacity_bytes": 1},
            "scheduling": {"preemptions": preemptions}}


def verdict(*recs):
    return matrix.check(list(recs), probe_len=640, block=128)


def test_clean_run_passes():
    assert verdict(record())["ok"]


def test_counts_apart_fail_unless_a_preemption_explains_them():
    """vLLM counts a request's hits at its first scheduling only: after a preemption our tier may
    count more than its external-hit counter, never fewer."""
    assert not verdict(record(ours=1280.0))["ok"]
    v = verdict(record(ours=1280.0, preemptions=1.0))
    assert v["ok"] and any("preempted" in ln for ln in v["lines"])
    assert not verdict(record(ours=768.0, preemptions=1.0))["ok"]  # ours counting fewer is never explained


def test_missed_probe_revisits_fail_unless_the_tier_cannot_hold_them():
    """4 probes + 14 filler prompts of 640 tokens need 90 chunks of 128 tokens."""
    assert not verdict(record(revisit=0.0, capacity=90.0))["ok"]
    v = verdict(record(revisit=0.0, capacity=89.0))
    assert v["ok"] and any("smaller than the probes" in ln for ln in v["lines"])
    assert matrix.filler_count(45, 128, 640) == 14  # 1.5 x the device cache, in prompts


def test_a_config_that_loads_nothing_may_miss_its_probes():
    """``host-never`` stores every chunk and loads none (load_decision never): its revisits miss by design."""
    assert verdict(record(config="host-never", revisit=0.0, external=0.0, ours=0.0))["ok"]
    assert not verdict(record(config="host", revisit=0.0, external=0.0, ours=0.0))["ok"]


def test_changed_probe_tokens_always_fail():
    r = record(capacity=60.0, revisit=0.0)
    r["probes"]["stable"] = False
    assert not verdict(r)["ok"]


def test_other_traffic_that_ends_first_is_noted_and_its_failures_fail():
    r = record()
    r["background"] = {"requests_failed": 0, "wall_seconds": 80.0, "agents_wall_seconds": 95.0}
    v = verdict(r)
    assert v["ok"] and any("ended 15 s before" in ln for ln in v["lines"])
    r["background"] = {"requests_failed": 2, "wall_seconds": 120.0, "agents_wall_seconds": 95.0}
    v = verdict(r)
    assert not v["ok"] and not any("ended" in ln for ln in v["lines"])
