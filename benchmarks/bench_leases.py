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
lease counters.

``--file-tier``: the same trace over two tiers, a small host tier over a
larger file tier (``FileIndex``, the file tier's in-memory index and the
eviction order ``FileTier`` applies to its files; no disk I/O, so the
figures are the policy's, not the filesystem's). Every computed chunk is
written through to the file tier; a lookup takes the host prefix, then the
file tier's, and promotes the file hits into the host tier. Compared at
equal bytes: no leases, leases on the host tier only, leases on both.

Usage: python benchmarks/bench_leases.py [--seed N] [--quick] [--file-tier]
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
from tpu_offload.core.fs.index import FileIndex  # noqa: E402
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


def _hit_figures(agent_hit: int, agent_reusable: int, other_hit: int) -> dict:
    """Hits in tokens (counted in chunks): the agents', what an unbounded tier would have served them, the rest."""
    tok = TOKENS_PER_CHUNK
    return {
        "agent_hit_tokens": agent_hit * tok,
        "agent_reusable_tokens": agent_reusable * tok,
        "agent_hit_share": agent_hit / agent_reusable if agent_reusable else 0.0,
        "other_hit_tokens": other_hit * tok,
        "all_hit_tokens": (agent_hit + other_hit) * tok,
    }


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
    return {
        **_hit_figures(agent_hit, agent_reusable, other_hit),
        "honoured": table.honoured if table else 0,
        "expired": table.expired if table else 0,
        "evictions": m.evictions,
    }


class FileTierModel:
    """The file tier's eviction as ``FileTier._evict_to`` applies it, on its index alone (one unit per file)."""

    def __init__(self, capacity: int, table: leases.LeaseTable | None):
        self.index = FileIndex(touch_interval_s=1e9)  # no restamps: nothing on disk
        self.capacity, self.leases, self.evictions = capacity, table, 0

    def write(self, key) -> None:
        self.index.add(key, 1)
        if self.index.used_bytes > self.capacity:
            if self.leases is not None:
                self.leases.expire()
            victims, honoured = self.index.pop_lru_until(self.capacity, self.leases, spare=key)
            self.evictions += len(victims)
            if self.leases is not None:
                self.leases.honoured += honoured
                self.leases.drop(k for k, _ in victims)


def run_two_tiers(trace: Trace, host: int, files: int, ttl_s: float | None, fraction: float,
                  on_files: bool) -> dict:
    """Host tier of ``host`` chunks over a file tier of ``files``; leases on the host tier (``ttl_s``), and on
    the file tier too with ``on_files``."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    host_table = leases.table_for(fraction, 4096, host, clock=clock) if ttl_s else None
    file_table = leases.table_for(fraction, 4096, files, clock=clock) if ttl_s and on_files else None
    m = LRUChunkManager(host, 1, enable_events=False, leases=host_table)
    fs = FileTierModel(files, file_table)
    agent_hit = agent_file_hit = agent_reusable = other_hit = 0
    seen: set = set()
    for t, _, kind, session, keys in trace.events:
        now[0] = t
        hint = {leases.HINT_KEY: {"session": session, "ttl_s": ttl_s}} if (ttl_s and session) else None
        leases.renew_from(host_table, hint)
        leases.renew_from(file_table, hint)
        n = m.lookup_prefix(keys)
        if n:
            m.touch(keys[:n])
            m.prepare_load(keys[:n])
            m.complete_load(keys[:n])
        j = n
        while j < len(keys) and keys[j] in fs.index:  # the file tier's part of the prefix
            fs.index.touch(keys[j])
            j += 1
        if kind == "agent":
            agent_hit += j
            agent_file_hit += j - n
            agent_reusable += sum(1 for k in keys if k in seen)
            seen.update(keys)
        else:
            other_hit += j
        alloc = m.prepare_store(keys[n:])  # file hits promoted, the rest computed
        if alloc is not None:
            m.complete_store(alloc.keys)
        for k in keys[j:]:  # write-through of what was computed
            fs.write(k)
        leases.lease_from(host_table, hint, keys)
        leases.lease_from(file_table, hint, keys)
    return {
        **_hit_figures(agent_hit, agent_reusable, other_hit),
        "agent_file_hit_tokens": agent_file_hit * TOKENS_PER_CHUNK,
        "file_honoured": file_table.honoured if file_table else 0,
        "file_expired": file_table.expired if file_table else 0,
        "file_evictions": fs.evictions,
    }


def main_file_tier(a, trace_kw: dict, sessions: int) -> None:
    rows = []
    host = 256  # chunks (64K tokens): small, so the file tier holds most of what comes back
    for other_rate in (4.0, 8.0):
        trace = Trace(np.random.default_rng(a.seed), other_rate=other_rate, **trace_kw)
        for files in (1024, 2048, 4096):
            base = run_two_tiers(trace, host, files, None, 0.0, False)
            for name, ttl_s, on_files in (("off", None, False), ("host only", 60.0, False),
                                          ("host and file", 60.0, True)):
                r = base if ttl_s is None else run_two_tiers(trace, host, files, ttl_s, 0.5, on_files)
                rows.append({"other_per_s": other_rate, "host_chunks": host, "file_chunks": files,
                             "leases": name if ttl_s is None else f"{name}, ttl {ttl_s:g}s, share 0.5", **r,
                             "agent_hit_vs_off": r["agent_hit_tokens"] / base["agent_hit_tokens"]
                             if base["agent_hit_tokens"] else 0.0})
    cols = ["other_per_s", "file_chunks", "leases", "agent_hit_share", "agent_hit_vs_off", "agent_file_hit_tokens",
            "other_hit_tokens", "all_hit_tokens", "file_honoured", "file_expired"]
    print_table(rows, cols, title=f"two tiers: host {host} chunks over a file tier; {sessions} sessions x 12 turns, "
                                  f"tool gaps median 20 s; {TOKENS_PER_CHUNK} tokens per chunk")
    if not a.no_write:
        path = write_json("leases_file_tier", {"trace": {**trace_kw, "themes_chunks": THEMES,
                                                         "tokens_per_chunk": TOKENS_PER_CHUNK, "seed": a.seed},
                                               "rows": rows})
        print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smaller trace (a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write results/*.json")
    ap.add_argument("--file-tier", action="store_true",
                    help="a small host tier over a file tier (results/leases_file_tier.json)")
    a = ap.parse_args()
    sessions = 60 if a.quick else 400
    trace_kw = dict(sessions=sessions, turns=12, tool_chunks=2, gap_median_s=20.0, arrival_s=3.0,
                    other_chunks=16, other_repeat=0.2)
    if a.file_tier:
        main_file_tier(a, trace_kw, sessions)
        return
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
