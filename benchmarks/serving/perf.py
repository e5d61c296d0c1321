"""The workloads, driven by inference-perf (run from its own venv, ``.venv-bench``).

* ``Workload``: llm-d's tiered-prefix-cache benchmark, inference-perf with ``load.type:
  concurrent`` over ``data.type: shared_prefix``: ``num_groups`` long system prompts, each
  followed by ``num_prompts_per_group`` short questions, sent in a shuffled order.
* ``Conversations``: inference-perf's own ``conversation_replay`` generator (its workload
  catalog, shipped in the package, nothing downloaded): multi-turn sessions whose context
  grows every turn (a shared system prompt, a per-session one, then each turn's prompt and
  the model's answer), dispatched round-robin over the sessions, so a session comes back
  after every other session had a turn.
* ``Agentic``: inference-perf's ``synthetic_agentic`` generator (chat API, ``load.type:
  trace_session_replay``): agent sessions drawn from its themes (a code change, an incident,
  research over retrieved documents), each a system head and a tool catalog, then turns that
  each run a tool loop; a tool's run is a gap in which the session sends nothing while other
  sessions run, and every call resends the whole transcript so far.
* ``Background``: other traffic run beside any of them (a second inference-perf run): unique
  prompts at a steady rate, the churn a tier sees from other users while agents wait on tools.

Every size is a parameter so the same shapes fit a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BENCH_VENV = ROOT / ".venv-bench"


def fixed(n) -> dict:
    """inference-perf's distribution of one value (every sample ``n``)."""
    return {"type": "fixed", "mean": n, "min": n, "max": n, "std_dev": 0}


@dataclasses.dataclass(frozen=True)
class Workload:
    kind = "shared_prefix"
    groups: int = 24
    system_prompt_len: int = 1024
    question_len: int = 64
    output_len: int = 16
    prompts_per_group: int = 6
    requests: int = 144
    concurrency: int = 4
    seed: int = 7

    @property
    def working_set_tokens(self) -> int:
        """Tokens whose KV the run keeps reusing: the system prompts."""
        return self.groups * self.system_prompt_len

    def reusable_tokens(self, block: int) -> int:
        """Prompt tokens a perfect cache could serve: every visit to a group after its first
        reuses the group's system prompt (whole blocks only)."""
        visits = self.requests
        firsts = min(self.groups, visits)
        return (visits - firsts) * (self.system_prompt_len // block) * block

    def working_set_blocks(self, block: int) -> int:
        return self.groups * -(-self.system_prompt_len // block)

    def request_blocks(self, block: int) -> int:
        """Blocks of the longest request (prompt and output)."""
        return -(-(self.system_prompt_len + self.question_len + self.output_len) // block)

    @property
    def max_model_len(self) -> int:
        return self.system_prompt_len + self.question_len + self.output_len + 256

    @property
    def probe_len(self) -> int:
        return self.system_prompt_len + self.question_len

    def describe(self) -> str:
        return (f"{self.groups} groups x {self.system_prompt_len}-token system prompt, {self.question_len}-token "
                f"questions, {self.output_len} output tokens, concurrency {self.concurrency}")

    def data(self) -> dict:
        return {"type": "shared_prefix", "shared_prefix": {
            "num_groups": self.groups, "num_prompts_per_group": self.prompts_per_group,
            "system_prompt_len": self.system_prompt_len, "question_len": self.question_len,
            "output_len": self.output_len, "seed": self.seed}}


@dataclasses.dataclass(frozen=True)
class Conversations:
    """inference-perf's ``conversation_replay``: ``conversations`` sessions of ``turns`` turns,
    ``rounds`` times over (a session that ends starts again with the same system prompts)."""

    kind = "conversations"
    conversations: int = 12
    shared_system_len: int = 512
    dynamic_system_len: int = 256
    turns: int = 4
    turn_input_len: int = 96
    output_len: int = 32
    rounds: int = 2
    concurrency: int = 4
    seed: int = 7

    @property
    def requests(self) -> int:
        return self.conversations * self.turns * self.rounds

    @property
    def final_context_tokens(self) -> int:
        """A session's context before its last answer (text round trips may add a few tokens)."""
        return self.shared_system_len + self.dynamic_system_len + self.turns * (self.turn_input_len + self.output_len)

    @property
    def working_set_tokens(self) -> int:
        return self.conversations * self.final_context_tokens

    def working_set_blocks(self, block: int) -> int:
        return self.conversations * -(-self.final_context_tokens // block)

    def request_blocks(self, block: int) -> int:
        return -(-self.final_context_tokens // block)

    def reusable_tokens(self, block: int) -> int:
        """Prompt tokens a perfect cache could serve (whole blocks): a turn reuses its session's
        context so far; a session's first turn reuses the shared system prompt (the whole system
        prompt from the second round on), except the very first request."""
        sys_len = self.shared_system_len + self.dynamic_system_len
        total = 0
        for rnd in range(self.rounds):
            for conv in range(self.conversations):
                first = self.shared_system_len if rnd == 0 else sys_len
                if rnd == 0 and conv == 0:
                    first = 0
                total += first // block * block
                for t in range(1, self.turns):
                    total += (sys_len + t * (self.turn_input_len + self.output_len)) // block * block
        return total

    @property
    def max_model_len(self) -> int:
        return 2 * self.final_context_tokens + self.output_len + 256  # random-token text re-tokenizes longer

    @property
    def probe_len(self) -> int:
        return self.shared_system_len + self.dynamic_system_len + self.turn_input_len

    def describe(self) -> str:
        return (f"{self.conversations} conversations x {self.turns} turns x {self.rounds} rounds "
                f"({self.shared_system_len}+{self.dynamic_system_len}-token system prompts, "
                f"{self.turn_input_len}-token turns, {self.output_len} output tokens), concurrency {self.concurrency}")

    def data(self) -> dict:
        return {"type": "conversation_replay", "conversation_replay": {
            "seed": self.seed, "num_conversations": self.conversations,
            "shared_system_prompt_len": self.shared_system_len,
            "dynamic_system_prompt_len": fixed(self.dynamic_system_len),
            "turns_per_conversation": fixed(self.turns), "input_tokens_per_turn": fixed(self.turn_input_len),
            "output_tokens_per_turn": fixed(self.output_len), "max_model_len": self.max_model_len}}


SESSION_HEADER = "x-agent-session"  # inference-perf's session_id_header_key; lease_middleware reads it
# Tokens of one advertised tool's schema as the serving tokenizer counts them (the byte-level BPE
# the agentic bench trains: measured 430-560 over the three themes' tools; inference-perf's own
# estimate for real tokenizers is 380). Only the sizing uses it.
CATALOG_TOKENS_PER_TOOL = 560


@dataclasses.dataclass(frozen=True)
class Agentic:
    """inference-perf's ``synthetic_agentic``: ``sessions`` agent sessions, ``concurrency`` at a
    time, each ``turns`` user turns; each turn is ``tool_loop_depth`` tool calls (a model call
    that emits the call, then a ``tool_gap_s`` pause while the tool runs) and one answer.
    No sub-agents (fanout 0), so every call of a session extends one transcript."""

    kind = "agentic"
    sessions: int = 8
    turns: int = 3
    tool_loop_depth: int = 1
    system_len: int = 512
    turn_input_len: int = 128
    output_len: int = 32
    tools_per_agent: int = 1
    tool_gap_s: float = 2.0
    think_s: float = 4.0
    concurrency: int = 8
    # Requests the device cache is sized to run at once: a session spends most of its time in
    # tool gaps and think time, so far fewer than ``concurrency`` run together.
    running_requests: int = 2
    themes: tuple[str, ...] = ("code_change_task", "db2_latency_incident", "research_rag")
    seed: int = 7

    @property
    def calls_per_session(self) -> int:
        return self.turns * (self.tool_loop_depth + 1)

    @property
    def requests(self) -> int:
        return self.sessions * self.calls_per_session

    @property
    def final_context_tokens(self) -> int:
        """Estimated prompt of a session's last call: head, catalog, every earlier call's input
        and output (the template and tool-call text add a little; sizing only)."""
        return (self.system_len + self.tools_per_agent * CATALOG_TOKENS_PER_TOOL
                + self.calls_per_session * (self.turn_input_len + 2 * self.output_len))

    @property
    def live_sessions(self) -> int:
        """Sessions under way at once: a finished session never comes back."""
        return min(self.sessions, self.concurrency)

    @property
    def working_set_tokens(self) -> int:
        return self.live_sessions * self.final_context_tokens

    def working_set_blocks(self, block: int) -> int:
        return self.live_sessions * -(-self.final_context_tokens // block)

    def request_blocks(self, block: int) -> int:
        return -(-(self.final_context_tokens + self.output_len) // block)

    def reusable_tokens(self, block: int) -> None:
        """Not known up front: tool-call outputs and the transcript's text re-tokenize per run."""
        return None

    @property
    def max_model_len(self) -> int:
        return 2 * self.final_context_tokens + 4 * self.output_len + 512

    @property
    def probe_len(self) -> int:
        return self.system_len + self.turn_input_len

    def describe(self) -> str:
        return (f"{self.sessions} agent sessions ({'/'.join(self.themes)}) x {self.turns} turns x "
                f"{self.tool_loop_depth + 1} calls ({self.tool_loop_depth} tool loop(s), {self.tool_gap_s:g} s tool "
                f"gaps, {self.think_s:g} s think time), {self.system_len}-token system head, {self.tools_per_agent} "
                f"tool(s) advertised, {self.turn_input_len}-token inputs, {self.output_len}-token outputs, "
                f"{self.concurrency} sessions at a time")

    def data(self) -> dict:
        return {"type": "synthetic_agentic", "synthetic_agentic": {
            "seed": self.seed, "num_sessions": self.sessions,
            "input_tokens_per_turn": fixed(self.turn_input_len), "output_tokens_per_turn": fixed(self.output_len),
            "turns_per_session": fixed(self.turns), "fanout_probability": 0.0,
            "theme_mix": {t: {"weight": 1.0} for t in self.themes},
            "shared_system_prompt_len": self.system_len, "tool_loop_depth": fixed(self.tool_loop_depth),
            "tool_catalog_size_per_agent": fixed(self.tools_per_agent),
            "parallel_tool_calls_per_step": fixed(1),
            "tool_call_latency_sec": fixed(self.tool_gap_s), "user_think_time_sec": fixed(self.think_s),
            # No tool_choice: a random-weight model under a forced JSON schema writes until
            # max_tokens; the server answers in text (its tool parser finds no call) and the
            # recorded tool results follow as the next call's tool messages.
            "tool_choice_mode": "as_recorded",
            "max_model_len": self.max_model_len}}

    def api(self) -> dict:
        return {"type": "chat", "streaming": True, "session_id_header_key": SESSION_HEADER}

    def load(self) -> dict:
        return {"type": "trace_session_replay",
                "stages": [{"concurrent_sessions": self.concurrency, "num_sessions": self.sessions}]}


@dataclasses.dataclass(frozen=True)
class Background:
    """Other traffic beside the agents: unique prompts at a steady rate (``load.type: constant``),
    sent by a second inference-perf run while the agents run. Every prompt is its own
    ``shared_prefix`` group, so nothing in it is ever reused: it only fills the tiers and pushes
    the agents' prefixes towards eviction during their tool gaps. It sends no session header, so
    the lease middleware never leases it: it is the unleased traffic a lease is weighed against."""

    kind = "background"
    rate: float = 0.5  # prompts per second
    duration_s: float = 160.0
    prompt_len: int = 1024
    output_len: int = 16
    concurrency: int = 8  # inference-perf's workers in flight at most (arrivals beyond it wait)
    seed: int = 11

    @property
    def requests(self) -> int:
        return int(self.rate * self.duration_s)

    def describe(self) -> str:
        return (f"other traffic: {self.rate:g} unique {self.prompt_len}-token prompts/s for {self.duration_s:g} s "
                f"({self.requests} requests, {self.output_len}-token outputs, never leased)")

    def data(self) -> dict:
        return {"type": "shared_prefix", "shared_prefix": {
            "num_groups": self.requests, "num_prompts_per_group": 1, "system_prompt_len": self.prompt_len,
            "question_len": 16, "output_len": self.output_len, "seed": self.seed}}

    def load(self) -> dict:
        return {"type": "constant", "stages": [{"rate": self.rate, "duration": self.duration_s}]}


def config(w: Workload | Conversations | Agentic | Background, url: str, model: str, report_dir: Path) -> dict:
    load = w.load() if hasattr(w, "load") else {
        "type": "concurrent", "stages": [{"num_requests": w.requests, "concurrency_level": w.concurrency}]}
    return {
        "api": w.api() if hasattr(w, "api") else {"type": "completion", "streaming": True},
        "data": w.data(),
        "load": {**load, "num_workers": 1, "worker_max_concurrency": max(w.concurrency, 1), "base_seed": w.seed,
                 "request_timeout": 600},
        "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": model},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False},
                   "prometheus": {"summary": False, "per_stage": False}},
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def run(w, url: str, model: str, workdir: Path, label: str, timeout_s: float = 1800, progress: bool = True) -> dict:
    """Run inference-perf once; return its ``summary_lifecycle_metrics`` report (plus wall time).
    ``progress``: print the server's completed requests (off for a second, concurrent run)."""
    exe = BENCH_VENV / "bin" / "inference-perf"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} is missing: run `make .venv-bench/.installed` (Python 3.12 + inference-perf)")
    workdir.mkdir(parents=True, exist_ok=True)
    report_dir = workdir / "report"
    cfg_path = workdir / "inference-perf.yaml"
    cfg_path.write_text(yaml.safe_dump(config(w, url, model, report_dir), sort_keys=False))
    log = workdir / "inference-perf.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "-c", str(cfg_path), "--log-level", "INFO"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
        _progress(proc, w.requests, label, t0, timeout_s, url, progress)
    if proc.returncode != 0:
        raise RuntimeError(f"inference-perf exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
    found = sorted(report_dir.rglob("summary_lifecycle_metrics.json"))
    if not found:
        raise RuntimeError(f"inference-perf wrote no summary_lifecycle_metrics.json under {report_dir}")
    summary = json.loads(found[-1].read_text())
    summary["wall_seconds"] = time.monotonic() - t0
    return summary


def _progress(proc, total: int, label: str, t0: float, timeout_s: float, url: str, show: bool = True) -> None:
    """Print completed requests (from the server's own counter) until inference-perf exits;
    kill it past ``timeout_s``."""
    import httpx

    from benchmarks.serving import prom

    start = None
    last = ""
    while proc.poll() is None:
        if time.monotonic() - t0 > timeout_s:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"inference-perf ran past {timeout_s:.0f} s ({label})")
        if not show:
            time.sleep(2)
            continue
        try:
            s = prom.parse(httpx.get(f"{url}/metrics", timeout=10).text)
            done = prom.total(s, "vllm:request_success_total") or 0
            if start is None:
                start = done
            line = f"  [{label}] {int(done - start)}/{total} requests, {time.monotonic() - t0:.0f} s"
            if line != last:
                print(line, end="\r", file=sys.stderr, flush=True)
                last = line
        except Exception:  # noqa: BLE001 - progress is best effort; the run itself is checked after
            pass
        time.sleep(2)
    if show:
        print(file=sys.stderr)


def figures(summary: dict) -> dict:
    """The guides' columns from an inference-perf summary (seconds, tokens/s)."""
    ok = summary.get("successes", {})
    lat = ok.get("latency", {})
    ttft = lat.get("time_to_first_token") or {}
    e2e = lat.get("request_latency") or {}
    tp = ok.get("throughput", {})
    pt = ok.get("prompt_tokens", {}) or {}
    return {
        "requests_ok": ok.get("count", 0),
        "requests_failed": (summary.get("failures") or {}).get("count", 0),
        "ttft_mean": ttft.get("mean"), "ttft_p50": ttft.get("median"), "ttft_p90": ttft.get("p90"),
        "e2e_mean": e2e.get("mean"), "e2e_p90": e2e.get("p90"),
        "input_tps": tp.get("input_tokens_per_sec"), "output_tps": tp.get("output_tokens_per_sec"),
        "total_tps": tp.get("total_tokens_per_sec"),
        "prompt_tokens": pt.get("total"), "cached_prompt_tokens": pt.get("cached"),
    }
