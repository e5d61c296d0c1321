"""The agentic serving workload: inference-perf 0.7.0 (its own venv, ``.venv-bench``) must accept
the config the harness writes, and the lease middleware must put the hint where docs/leases.md
says. No engine, no server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from benchmarks.serving import lease_middleware, perf  # noqa: E402

BENCH_PY = ROOT / ".venv-bench/bin/python"  # made by `make bench-serving`; absent from a fresh clone
BENCH_PY = BENCH_PY if BENCH_PY.exists() else None

VALIDATE = r"""
import sys, json
from inference_perf.config import read_config
c = read_config(sys.argv[1])
a = c.data.synthetic_agentic
print(json.dumps({"data": c.data.type.value, "load": c.load.type.value, "api": c.api.type.value,
                  "header": c.api.session_id_header_key, "sessions": a.num_sessions,
                  "themes": sorted(a.theme_weights()), "tool_choice_mode": a.tool_choice_mode.value,
                  "gap": a.tool_call_latency_sec.mean, "depth": a.tool_loop_depth.mean,
                  "concurrent_sessions": c.load.stages[0].concurrent_sessions}))
"""


@pytest.mark.skipif(BENCH_PY is None, reason="no .venv-bench (inference-perf) here")
def test_inference_perf_accepts_agentic_config(tmp_path):
    w = perf.Agentic(sessions=5, concurrency=2, tool_gap_s=3.0, tool_loop_depth=2)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(perf.config(w, "http://127.0.0.1:1", str(tmp_path), tmp_path / "r"),
                                  sort_keys=False))
    out = subprocess.run([str(BENCH_PY), "-c", VALIDATE, str(cfg)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"data": "synthetic_agentic", "load": "trace_session_replay", "api": "chat",
                   "header": perf.SESSION_HEADER, "sessions": 5, "themes": sorted(w.themes),
                   "tool_choice_mode": "as_recorded", "gap": 3.0, "depth": 2, "concurrent_sessions": 2}


@pytest.mark.skipif(BENCH_PY is None, reason="no .venv-bench (inference-perf) here")
def test_inference_perf_rejects_a_context_past_max_model_len(tmp_path):
    """The check above is not vacuous: inference-perf does validate what we send."""
    w = perf.Agentic()
    c = perf.config(w, "http://127.0.0.1:1", str(tmp_path), tmp_path / "r")
    c["data"]["synthetic_agentic"]["max_model_len"] = 64
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(c, sort_keys=False))
    out = subprocess.run([str(BENCH_PY), "-c", VALIDATE, str(cfg)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "max_model_len" in out.stderr


def test_agentic_counts():
    w = perf.Agentic(sessions=8, turns=3, tool_loop_depth=1)
    assert w.requests == 48
    assert w.working_set_blocks(128) == 8 * -(-w.final_context_tokens // 128)
    assert w.max_model_len > w.final_context_tokens


def _through(mw_env: dict, body: dict, headers: list, monkeypatch) -> dict:
    for k in ("BENCH_LEASE_TTL_S",):
        monkeypatch.delenv(k, raising=False)
    for k, v in mw_env.items():
        monkeypatch.setenv(k, v)
    seen = {}

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            msg = await receive()
            parts.append(msg["body"])
            more = msg.get("more_body", False)
        seen["body"] = json.loads(b"".join(parts))
        seen["length"] = dict(scope["headers"]).get(b"content-length")

    raw = json.dumps(body).encode()
    msgs = [{"type": "http.request", "body": raw[:5], "more_body": True},
            {"type": "http.request", "body": raw[5:], "more_body": False}]

    async def receive():
        return msgs.pop(0)

    scope = {"type": "http", "path": "/v1/chat/completions",
             "headers": [(b"content-length", str(len(raw)).encode()), *headers]}
    asyncio.run(lease_middleware.SessionLease(app)(scope, receive, None))
    return seen


def test_middleware_adds_lease_from_session_header(monkeypatch):
    seen = _through({"BENCH_LEASE_TTL_S": "120"}, {"model": "m", "kv_transfer_params": {"other": 1}},
                    [(b"x-agent-session", b"s-3")], monkeypatch)
    assert seen["body"]["kv_transfer_params"] == {"other": 1, "tpu_offload_lease": {"session": "s-3", "ttl_s": 120.0}}
    assert seen["length"] == str(len(json.dumps(seen["body"]).encode())).encode()


def test_middleware_passes_through_without_ttl_or_header(monkeypatch):
    assert "kv_transfer_params" not in _through({}, {"model": "m"}, [(b"x-agent-session", b"s")], monkeypatch)["body"]
    assert "kv_transfer_params" not in _through({"BENCH_LEASE_TTL_S": "120"}, {"model": "m"}, [], monkeypatch)["body"]


VALIDATE_BACKGROUND = r"""
import sys, json
from inference_perf.config import read_config
c = read_config(sys.argv[1])
s = c.data.shared_prefix
print(json.dumps({"data": c.data.type.value, "load": c.load.type.value, "api": c.api.type.value,
                  "header": c.api.session_id_header_key, "groups": s.num_groups,
                  "per_group": s.num_prompts_per_group, "len": s.system_prompt_len,
                  "rate": c.load.stages[0].rate, "duration": c.load.stages[0].duration}))
"""


@pytest.mark.skipif(BENCH_PY is None, reason="no .venv-bench (inference-perf) here")
def test_inference_perf_accepts_background_config(tmp_path):
    """The other traffic: unique prompts (one per group) at a constant rate, no session header,
    so the lease middleware leaves it unleased."""
    bg = perf.Background(rate=0.5, duration_s=40, prompt_len=768)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(perf.config(bg, "http://127.0.0.1:1", str(tmp_path), tmp_path / "r"),
                                  sort_keys=False))
    out = subprocess.run([str(BENCH_PY), "-c", VALIDATE_BACKGROUND, str(cfg)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"data": "shared_prefix", "load": "constant", "api": "completion", "header": None,
                   "groups": 20, "per_group": 1, "len": 768, "rate": 0.5, "duration": 40}


def _summary(prompt: float, cached: float, ttft: float = 1.0) -> dict:
    return {"successes": {"count": 4, "latency": {"time_to_first_token": {"mean": ttft, "median": ttft, "p90": ttft}},
                          "throughput": {"total_tokens_per_sec": 100.0},
                          "prompt_tokens": {"total": prompt, "cached": cached}}, "wall_seconds": 10.0}


def test_accounting_counts_both_runs_and_the_table_splits_them():
    """With other traffic beside the agents the server's counters cover both runs: the check
    compares them with both inference-perf runs' sums, and the table keeps each run's own
    cached tokens apart (what a lease moves from one to the other)."""
    from benchmarks.serving import harness, prom

    def samples(prompt, device):
        return prom.parse(f"vllm:prompt_tokens_total {prompt}\nvllm:prefix_cache_hits_total {device}\n"
                          "vllm:external_prefix_cache_hits_total 0\n")

    cell = harness.Cell("vllm", "host", "high", 0, None, None, "m", 128, 1, False)
    h = harness.hit_accounting(samples(0, 0), samples(1500, 700), _summary(1000, 600), perf.Agentic(), cell,
                               _summary(500, 100))
    assert (h["perf_prompt_tokens"], h["server_prompt_tokens"]) == (1500, 1500)
    assert h["server_vs_perf_cached_diff"] == 0 and h["reusable_tokens"] is None
    alone = harness.hit_accounting(samples(0, 0), samples(1500, 700), _summary(1000, 600), perf.Agentic(), cell)
    assert alone["perf_prompt_tokens"] == 1000 and alone["server_vs_perf_cached_diff"] == 100

    recs = []
    for config, agents, other in (("none", 100, 0), ("host", 600, 100), ("host", 800, 300)):
        fig = perf.figures(_summary(1000, agents))
        recs.append({"engine": "vllm", "scenario": "high", "config": config, "figures": fig,
                     "hits": {"device_hit_tokens": 0, "tier_hit_tokens_cpu": 0, "tier_hit_tokens_fs": 0,
                              "external_hit_tokens": 0},
                     "background": perf.figures(_summary(500, other))})
    rows = {r["config"]: r for r in harness.compare(recs)}
    assert (rows["host"]["cached: workload"], rows["host"]["cached: other"]) == (700, 200)
    assert (rows["none"]["cached: workload"], rows["none"]["cached: other"]) == (100, 0)


def test_scheduling_figures_from_the_engines_series():
    from benchmarks.serving import harness, prom

    before = prom.parse("vllm:num_preemptions_total 2\nvllm:request_queue_time_seconds_sum 1.0\n"
                        "vllm:request_queue_time_seconds_count 1\n")
    after = prom.parse("vllm:num_preemptions_total 5\nvllm:request_queue_time_seconds_sum 7.0\n"
                       "vllm:request_queue_time_seconds_count 4\n")
    assert harness.scheduling(before, after) == {"preemptions": 3, "queue_s_mean": 2.0, "prefill_s_mean": None}
    assert harness.scheduling({}, {})["preemptions"] is None  # not exported: unknown, not zero
