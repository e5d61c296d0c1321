"""Session leases on an agentic trace: hit tokens with and without leases, at equal tier bytes.

Drives the core host-tier manager (``LRUChunkManager``) the way the
adapters do, on simulated time:

* Agent sessions arrive at random. Each picks a theme (code change,
  incident, RAG: a long system prompt plus tool definitions, shared by every
  session of the theme), then runs many turns; every turn's prompt is the
  previous one plus the tool's output, and between turns the session waits
  for its tool (the gap: lognormal, seconds to minutes).
* Other traffic meanwhile: prompts of unique tokens (batch jobs, single
  questions) that fill the tier; one in five repeats one of the last 50
  (a popular document), so leases have a cost to show as well.

Each request looks its prefix up (hit chunks are loaded: pin, unpin), then
stores the chunks it computed, evicting the least recent. With leases, an
agent request carries ``{"tpu_offload_lease": {"session": id, "ttl_s": T}}``:
it renews its session's lease on arrival and leases its prefix when it ends
(``core/leases.py``, as both engine adapters do). Same trace, same capacity;
the only difference is the lease hint.

Reported: agent hit tokens (what the next turn found in the tier, out of
what an unbounded tier would have had), every request's hit tokens, and the
lease counters. Usage: python benchmarks/bench_leases.py [--seed N] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, write_json  # noqa: E402

from tpu_offload.core import leases  # noqa: E402
from tpu_offload.core.keys import make_chunk_key  # noqa: E402
from tpu_offload.core.lru import LRUChunkManager  # noqa: E402

TOKENS_PER_CHUNK = 256
THEMES = {"code_change": 24, "incident": 16, "rag": 32}  # shared prefix, chunks (6K, 4K, 8K tokens)


class Trace:
    """Requests in time order: (time, kind, session or None, prompt keys)."""

    def __init__(self, rng, *, sessions: int, turns: int, tool_chunks: int, gap_median_s: float,
                 arrival_s: float, other_rate: float, other_chunks: int, other_repeat: float):
        self.events: list[tuple[float, int, str, object, list]] = []
        ids = iter(range(1 << 62))

        def fresh(n):
            return [make_chunk_key(next(ids).to_bytes(32, "big")) for _ in range(n)]

        theme_keys = {t: fresh(n) for t, n in THEMES.items()}
        t0, seq = 0.0, 0
        end = 0.0
        for s in range(sessions):
            t0 += rng.exponential(arrival_s)
            theme = list(THEMES)[rng.integers(len(THEMES))]
            ctx = list(theme_keys[theme]) + fresh(int(rng.integers(1, 4)))  # the task statement
            t = t0
            for turn in range(turns):
                seq += 1
                self.events.append((t, seq, "agent", f"s{s}", list(ctx)))
                ctx += fresh(tool_chunks + int(rng.integers(0, 3)))  # model output + tool result
                t += rng.lognormal(np.log(gap_median_s), 0.8)
            end = max(end, t)
        t, recent = 0.0, []
        while t < end:
            t += rng.exponential(1.0 / other_rate)
            seq += 1
            if recent and rng.random() < other_repeat:  # a recent prompt again (a popular document or question)
                keys = recent[int(rng.integers(len(recent)))]
            else:
                keys = fresh(other_chunks)
                recent = (recent + [keys])[-50:]
            self.events.append((t, seq, "other", None, keys))
        self.events.sort()


def run(trace: Trace, capacity: int, ttl_s: float | None, fraction: float) -> dict:
    now = [0.0]
    table = leases.table_for(fraction, 4096, capacity, clock=lambda: now[0]) if ttl_s else None
    m = LRUChunkManager(capacity, 1, enable_events=False, leases=table)
    agent_hit = agent_reusable = other_hit = 0
    seen: set = set()
    for t, _, kind, session, keys in trace.events:
        now[0] = t
        hint = {leases.HINT_KEY: {"session": session, "ttl_s": ttl_s}} if (ttl_s and session) else None
        leases.renew_from(table, hint)
        n = m.lookup_prefix(keys)
        if n:
            m.touch(keys[:n])
            m.prepare_load(keys[:n])
            m.complete_load(keys[:n])
        if kind == "agent":
            agent_hit += n
            agent_reusable += sum(1 for k in keys if k in seen)  # what an unbounded tier would hold
            seen.update(keys)
        else:
            other_hit += n
        alloc = m.prepare_store(keys[n:])
        if alloc is not None:
            m.complete_store(alloc.keys)
        leases.lease_from(table, hint, keys)
    tok = TOKENS_PER_CHUNK
    return {
        "agent_hit_tokens": agent_hit * tok,
        "agent_reusable_tokens": agent_reusable * tok,
        "agent_hit_share": agent_hit / agent_reusable if agent_reusable else 0.0,
        "other_hit_tokens": other_hit * tok,
        "all_hit_tokens": (agent_hit + other_hit) * tok,
        "honoured": table.honoured if table else 0,
        "expired": table.expired if table else 0,
        "evictions": m.evictions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smaller trace (a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write results/leases.json")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    sessions = 60 if a.quick else 400
    trace_kw = dict(sessions=sessions, turns=12, tool_chunks=2, gap_median_s=20.0, arrival_s=3.0,
                    other_chunks=16, other_repeat=0.2)
    rows = []
    for other_rate in (1.0, 4.0, 8.0):  # one-off prompts per second: 4K, 16K, 32K tokens/s
        trace = Trace(np.random.default_rng(a.seed), other_rate=other_rate, **trace_kw)
        for capacity in (1024, 2048, 4096):  # chunks: 256K, 512K, 1M tokens
            base = run(trace, capacity, None, 0.0)
            for ttl_s, fraction in ((None, 0.0), (60.0, 0.25), (60.0, 0.5), (120.0, 0.5)):
                r = base if ttl_s is None else run(trace, capacity, ttl_s, fraction)
                rows.append({
                    "other_per_s": other_rate, "capacity_chunks": capacity,
                    "leases": "off" if ttl_s is None else f"ttl {ttl_s:g}s, share {fraction:g}",
                    **r,
                    "agent_hit_vs_off": r["agent_hit_tokens"] / base["agent_hit_tokens"]
                    if base["agent_hit_tokens"] else 0.0,
                })
    cols = ["other_per_s", "capacity_chunks", "leases", "agent_hit_tokens", "agent_hit_share",
            "agent_hit_vs_off", "other_hit_tokens", "all_hit_tokens", "honoured", "expired"]
    print_table(rows, cols, title=f"agentic trace: {sessions} sessions x 12 turns, tool gaps median 20 s; "
                                  f"{TOKENS_PER_CHUNK} tokens per chunk")
    if not a.no_write:
        path = write_json("leases", {"trace": {**trace_kw, "themes_chunks": THEMES,
                                               "tokens_per_chunk": TOKENS_PER_CHUNK, "seed": a.seed},
                                     "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
