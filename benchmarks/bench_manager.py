"""Scheduler-side chunk manager cost on one realistic trace, three managers.

Compares, in one run and on the same trace:

* ours: ``tpu_offload.core.lru.LRUChunkManager``
* vLLM 0.32: ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` (LRU policy)
* tpu-inference 0.32: ``tpu_inference.offload.offload_manager.LRUCacheManager``

The trace is a stream of requests (one per scheduler step): multi-turn
conversations that start from Zipf-popular shared system prompts, grow by a
few chunks per turn, and are revisited with a recency skew; new documents
keep arriving, so the cache fills and then evicts. Population sizes scale
with the capacity so the hit ratio and the operation mix stay comparable
from 1K to 1M chunks.

Each step does what the engine's scheduler does with its manager: complete
the transfers submitted ``DELAY`` steps ago, look up the request's prefix,
update recency, pin the hits for a load, allocate the misses for a store and
drain the KV events. Only the manager calls are timed; engine-side
bookkeeping that every engine does anyway (building the request context,
slicing key lists) is outside the timed sections. Each peer is driven
through the API its own connector uses (vLLM: per-key ``lookup`` with a
``ReqContext``, ``on_new_request``/``on_request_finished``; tpu-inference:
``lookup``/``touch``/``allocate_for_save``/``prepare_load``/``mark_completion``).

Each (manager, capacity) runs in its own process by default, so a manager's
heap (and the garbage collector's walk over it) is charged to that manager
alone; runs rotate order and repeat (``--rounds``), and the median is kept.
``--interleave`` instead alternates all managers in one process in blocks
of steps, which shares machine-load swings evenly but lets each manager's
heap pollute the others' caches and GC.

Usage: python benchmarks/bench_manager.py [--capacities 1000,100000,1000000]
       [--managers ours,vllm,tpu] [--rounds N] [--interleave [--block STEPS]] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402

CHUNK_BYTES = 2 << 20  # only scales the byte stats; no memory is allocated
TOKENS_PER_CHUNK = 256
DELAY = 2  # transfers complete this many steps after submission
MAX_CHUNKS = 200  # longest request, in chunks (51K tokens)
P_NEW = 0.5  # share of steps that start a new conversation
ZIPF_A = 1.1  # system-prompt popularity
_GROUP0 = (0).to_bytes(4, "big")


# ---- trace ------------------------------------------------------------------


class _KeyGen:
    """Fresh 36-byte chunk keys (32-byte hash + group 0), vLLM's OffloadKey shape."""

    def __init__(self, rng: np.random.Generator):
        self._rng = rng
        self._buf = b""
        self._pos = 0
        self.count = 0

    def take(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            if self._pos >= len(self._buf):
                self._buf = self._rng.bytes(32 * 65536)
                self._pos = 0
            out.append(self._buf[self._pos : self._pos + 32] + _GROUP0)
            self._pos += 32
        self.count += n
        return out


def make_trace(capacity: int, min_steps: int, fill_factor: float, seed: int = 0) -> tuple[list[list[bytes]], dict]:
    """Requests (chunk-key lists) until ``fill_factor * capacity`` distinct keys exist."""
    rng = np.random.default_rng(seed)
    keys = _KeyGen(rng)
    n_sys = max(4, capacity // 128)
    sys_len = rng.integers(4, 33, n_sys)
    sys_keys: list[list[bytes] | None] = [None] * n_sys
    cdf = np.cumsum(1.0 / np.arange(1, n_sys + 1) ** ZIPF_A)
    cdf /= cdf[-1]
    window = max(16, capacity // 40)  # conversations still being revisited
    convs: list[list[bytes]] = []
    trace: list[list[bytes]] = []
    while len(trace) < min_steps or keys.count < fill_factor * capacity:
        if not convs or rng.random() < P_NEW:
            s = min(int(np.searchsorted(cdf, rng.random())), n_sys - 1)
            if sys_keys[s] is None:
                sys_keys[s] = keys.take(int(sys_len[s]))
            conv = sys_keys[s] + keys.take(int(rng.integers(8, 65)))
            convs.append(conv)
        else:
            w = min(len(convs), window)
            conv = convs[len(convs) - 1 - int(w * rng.random() ** 3)]
            room = MAX_CHUNKS - len(conv)
            if room > 0:  # a full conversation is re-read as is (a retry)
                conv.extend(keys.take(min(int(rng.integers(1, 9)), room)))
        trace.append(list(conv))
    lengths = np.fromiter((len(r) for r in trace), dtype=np.int64, count=len(trace))
    meta = {
        "steps": len(trace),
        "distinct_keys": keys.count,
        "mean_request_chunks": float(lengths.mean()),
        "system_prompts": n_sys,
        "conversation_window": window,
    }
    return trace, meta


# ---- adapters: one per manager, identical step structure ---------------------


class _Adapter:
    """Drives one manager through the trace; records per-step time and key-ops.

    A step: complete the transfers submitted ``DELAY`` steps ago, look up the
    request's prefix, update recency, pin the hits for a load, allocate the
    misses for a store, drain events. Only manager calls are timed.
    """

    name = ""

    def __init__(self, capacity: int, steps: int):
        self.capacity = capacity
        self.step_ns = np.zeros(steps, dtype=np.int64)
        self.key_ops = np.zeros(steps, dtype=np.int64)
        self.inflight: collections.deque = collections.deque()
        self.hit_chunks = self.req_chunks = self.stored = self.failures = 0
        self.fill_step: int | None = None
        t = time.perf_counter()
        self.build()
        self.build_s = time.perf_counter() - t

    def build(self) -> None:
        raise NotImplementedError

    def record(self, i: int, ns: int, keys: list, n: int, stored: int) -> None:
        L = len(keys)
        # lookups examined + recency over the request + pin + unpin + store offers + store completions
        self.key_ops[i] = (n + (n < L)) + L + 2 * n + (L - n) + stored
        self.step_ns[i] = ns
        self.hit_chunks += n
        self.req_chunks += L
        self.stored += stored
        if self.fill_step is None and self.used() == self.capacity:
            self.fill_step = i


class Ours(_Adapter):
    name = "ours"

    def build(self) -> None:
        from tpu_offload.core.lru import LRUChunkManager

        self.mgr = LRUChunkManager(self.capacity, CHUNK_BYTES, enable_events=True)

    def used(self) -> int:
        return self.mgr.stats().used_chunks

    def step(self, i: int, keys: list) -> None:
        mgr, inflight, pc = self.mgr, self.inflight, time.perf_counter_ns
        t0 = pc()
        if len(inflight) == DELAY:
            loads, stores = inflight.popleft()
            if loads:
                mgr.complete_load(loads)
            if stores:
                mgr.complete_store(stores)
        n = mgr.lookup_prefix(keys)
        mgr.touch(keys)
        t1 = pc()
        hit, miss = keys[:n], keys[n:]
        t2 = pc()
        if n:
            mgr.prepare_load(hit)
        alloc = mgr.prepare_store(miss) if miss else None
        mgr.take_events()
        t3 = pc()
        stored = alloc.keys if alloc is not None else None
        if miss and alloc is None:
            self.failures += 1
        inflight.append((hit, stored))
        self.record(i, (t1 - t0) + (t3 - t2), keys, n, len(stored) if stored else 0)


class VLLM(_Adapter):
    name = "vllm"

    def build(self) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.mgr = CPUOffloadingManager(self.capacity, cache_policy="lru", enable_events=True)
        self.HIT, self.ReqContext = LookupResult.HIT, ReqContext

    def used(self) -> int:
        return self.mgr._num_allocated_chunks - len(self.mgr._free_list)

    def step(self, i: int, keys: list) -> None:
        mgr, inflight, pc, HIT = self.mgr, self.inflight, time.perf_counter_ns, self.HIT
        # engine side (untimed): the scheduler builds the request context and
        # records each key's end-token position (update_offload_keys)
        ctx = self.ReqContext(req_id=str(i))
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, (j + 1) * TOKENS_PER_CHUNK)
        lookup = mgr.lookup
        t0 = pc()
        if len(inflight) == DELAY:
            loads, stores, old = inflight.popleft()
            if loads:
                mgr.complete_load(loads, old)
            if stores:
                mgr.complete_store(stores, old)
            mgr.on_request_finished(old)
        mgr.on_new_request(ctx)
        n = 0
        for k in keys:  # the scheduler's maximal-prefix scan, one key per call
            if lookup(k, ctx) is not HIT:
                break
            n += 1
        t1 = pc()
        hit, miss = keys[:n], keys[n:]
        t2 = pc()
        if n:
            mgr.prepare_load(hit, ctx)
        out = mgr.prepare_store(miss, ctx) if miss else None
        list(mgr.take_events())
        t3 = pc()
        stored = out.keys_to_store if out is not None else None
        if miss and out is None:
            self.failures += 1
        inflight.append((hit, stored, ctx))
        self.record(i, (t1 - t0) + (t3 - t2), keys, n, len(stored) if stored else 0)


class TPU(_Adapter):
    name = "tpu"

    def build(self) -> None:
        from tpu_inference.offload.offload_manager import LRUCacheManager

        self.mgr = LRUCacheManager(self.capacity)

    def used(self) -> int:
        return self.mgr.chunk_pool.num_allocated_chunks

    def step(self, i: int, keys: list) -> None:
        mgr, inflight, pc = self.mgr, self.inflight, time.perf_counter_ns
        t0 = pc()
        if len(inflight) == DELAY:
            load_ids, save_ids = inflight.popleft()
            if load_ids:
                mgr.mark_completion(load_ids, "load")
            if save_ids:
                mgr.mark_completion(save_ids, "save")
        n = mgr.lookup(keys)
        mgr.touch(keys)
        t1 = pc()
        hit, miss = keys[:n], keys[n:]
        t2 = pc()
        # the connector turns chunks into ids right away (tpu_offload_connector.py)
        load_ids = [c.chunk_id for c in mgr.prepare_load(hit)] if n else None
        out = mgr.allocate_for_save(miss) if miss else None
        save_ids = [c.chunk_id for c in out[0]] if out is not None else None
        t3 = pc()
        if miss and out is None and any(k not in mgr.cpu_cache for k in miss):
            self.failures += 1  # None also means "nothing new to save"
        inflight.append((load_ids, save_ids))
        self.record(i, (t1 - t0) + (t3 - t2), keys, n, len(save_ids) if save_ids else 0)


ADAPTERS = {"ours": Ours, "vllm": VLLM, "tpu": TPU}
LABELS = {
    "ours": "ours (LRUChunkManager)",
    "vllm": "vLLM 0.32 CPUOffloadingManager",
    "tpu": "tpu-inference 0.32 LRUCacheManager",
}


def run_interleaved(trace: list[list[bytes]], capacity: int, names: list[str], block: int) -> list[_Adapter]:
    """All managers over the same trace, alternating in blocks of steps so
    that machine load (shared CI boxes) hits them alike; order rotates per block."""
    adapters = [ADAPTERS[m](capacity, len(trace)) for m in names]
    gc.collect()
    gc.freeze()  # trace and empty managers are startup heap (vLLM freezes its startup heap too)
    try:
        for b, lo in enumerate(range(0, len(trace), block)):
            hi = min(lo + block, len(trace))
            for k in range(len(adapters)):
                ad = adapters[(b + k) % len(adapters)]
                step = ad.step
                for i in range(lo, hi):
                    step(i, trace[i])
    finally:
        gc.unfreeze()
    for ad in adapters:
        ad.used_at_end = ad.used()
    return adapters


def summarize(ad: _Adapter) -> dict:
    steps = len(ad.step_ns)
    start = (ad.fill_step + 1) if ad.fill_step is not None else steps
    ss_ns, ss_ops = ad.step_ns[start:], ad.key_ops[start:]
    total_ns, total_ops = int(ad.step_ns.sum()), int(ad.key_ops.sum())
    nan = float("nan")
    return {
        "manager": ad.name,
        "capacity": ad.capacity,
        "steps": steps,
        "fill_step": ad.fill_step,
        "hit_ratio": ad.hit_chunks / max(1, ad.req_chunks),
        "evictions": ad.stored - ad.used_at_end,
        "alloc_failures": ad.failures,
        "key_ops": total_ops,
        "ns_per_key_op": total_ns / max(1, total_ops),
        "us_per_step": total_ns / steps / 1e3,
        "steady_steps": len(ss_ns),
        "steady_ns_per_key_op": float(ss_ns.sum() / ss_ops.sum()) if len(ss_ns) else nan,
        "steady_us_per_step": float(ss_ns.mean() / 1e3) if len(ss_ns) else nan,
        "steady_p50_us": float(np.percentile(ss_ns, 50) / 1e3) if len(ss_ns) else nan,
        "steady_p99_us": float(np.percentile(ss_ns, 99) / 1e3) if len(ss_ns) else nan,
        "steady_max_us": float(ss_ns.max() / 1e3) if len(ss_ns) else nan,
        "timed_s": total_ns / 1e9,
        "build_s": ad.build_s,
    }


def plot(rows: list[dict], capacities: list[int], managers: list[str]) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(managers)
    x = np.arange(len(capacities))
    for j, m in enumerate(managers):
        by_cap = {r["capacity"]: r for r in rows if r["manager"] == m}
        for ax, key in zip(axes, ("steady_ns_per_key_op", "steady_us_per_step")):
            vals = [by_cap[c][key] if c in by_cap else 0 for c in capacities]
            bars = ax.bar(x + j * width, vals, width, label=LABELS[m])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for ax, title in zip(axes, ("ns per key-op (steady state, full cache)", "µs per step (steady state)")):
        ax.set_xticks(x + width * (len(managers) - 1) / 2, [f"{c:,}" for c in capacities])
        ax.set_xlabel("capacity (chunks)")
        ax.set_title(title)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Chunk manager cost per step on a multi-turn / shared-prefix trace (lower is better)")
    return save_figure(fig, "manager")


def _print_row(row: dict) -> None:
    print(
        f"  {row['manager']:5s} steady {row['steady_ns_per_key_op']:8.1f} ns/key-op "
        f"{row['steady_us_per_step']:9.2f} us/step (p50 {row['steady_p50_us']:.1f})  "
        f"all {row['ns_per_key_op']:8.1f} ns/key-op  hit {row['hit_ratio']:.3f} "
        f"evict {row['evictions']:,} fail {row['alloc_failures']} fill@{row['fill_step']}",
        flush=True,
    )


def _import_tpu_inference() -> None:
    # importing tpu_inference probes a GCE metadata server and logs; harmless
    logging.getLogger().setLevel(logging.ERROR)
    import tpu_inference.offload.offload_manager  # noqa: F401


def _worker(args) -> int:
    """One manager at one capacity in this process; prints one RESULT line."""
    if args.managers == "tpu":
        _import_tpu_inference()
    trace, meta = make_trace(args.capacities_int[0], args.min_steps, args.fill_factor)
    (ad,) = run_interleaved(trace, args.capacities_int[0], [args.managers], args.block)
    print("RESULT " + json.dumps({"row": summarize(ad), "trace": meta}), flush=True)
    return 0


def _isolated(cap: int, manager: str, args) -> tuple[dict, dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--capacities", str(cap), "--managers", manager,
           "--min-steps", str(args.min_steps), "--fill-factor", str(args.fill_factor), "--block", str(args.block)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"worker {manager}@{cap} failed:\n{out.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    return res["row"], res["trace"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacities", default="1000,100000,1000000")
    ap.add_argument("--managers", default="ours,vllm,tpu")
    ap.add_argument("--rounds", type=int, default=2,
                    help="isolated runs per (manager, capacity) below 1M chunks, order rotating; the median is kept")
    ap.add_argument("--interleave", action="store_true",
                    help="one process, managers alternating in blocks of --block steps (robust to machine load, "
                         "but peers' heaps pollute each other's caches and GC)")
    ap.add_argument("--block", type=int, default=100, help="steps per manager before switching (--interleave)")
    ap.add_argument("--min-steps", type=int, default=20000)
    ap.add_argument("--fill-factor", type=float, default=2.0, help="distinct keys in the trace / capacity")
    ap.add_argument("--profile", action="store_true", help="cProfile an interleaved run instead of reporting")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    capacities = args.capacities_int = [int(c) for c in args.capacities.split(",")]
    managers = [m for m in args.managers.split(",") if m]
    if args.worker:
        return _worker(args)
    mode = "interleaved" if (args.interleave or args.profile) else "isolated"
    if mode == "interleaved" and "tpu" in managers:
        _import_tpu_inference()

    rows, traces = [], {}
    for cap in capacities:
        t = time.perf_counter()
        meta = {"loadavg_before": os.getloadavg()[0]}
        if mode == "isolated":
            rounds = args.rounds if cap < 1_000_000 else 1
            runs: dict[str, list[dict]] = {m: [] for m in managers}
            for r in range(rounds):
                for k in range(len(managers)):
                    m = managers[(r + k) % len(managers)]
                    row, tmeta = _isolated(cap, m, args)
                    runs[m].append(row)
                    meta.update(tmeta)
            print(f"capacity {cap:,}: trace {meta}", flush=True)
            for m in managers:
                got = sorted(runs[m], key=lambda x: x["steady_ns_per_key_op"])
                row = dict(got[(len(got) - 1) // 2])  # the median (the lower one of two)
                row["rounds_steady_ns_per_key_op"] = [round(x["steady_ns_per_key_op"], 1) for x in runs[m]]
                rows.append(row)
                _print_row(row)
        else:
            trace, tmeta = make_trace(cap, args.min_steps, args.fill_factor)
            meta.update(tmeta)
            print(f"capacity {cap:,}: trace {meta}", flush=True)
            if args.profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.runcall(run_interleaved, trace, cap, managers, args.block)
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
                continue
            adapters = run_interleaved(trace, cap, managers, args.block)
            for ad in adapters:
                rows.append(summarize(ad))
                _print_row(rows[-1])
            del trace, adapters
            gc.collect()
        meta["run_s"] = round(time.perf_counter() - t, 1)
        meta["loadavg_after"] = os.getloadavg()[0]
        traces[cap] = meta
    if args.profile:
        return 0

    cols = ["manager", "capacity", "steps", "hit_ratio", "evictions", "alloc_failures", "ns_per_key_op",
            "us_per_step", "steady_ns_per_key_op", "steady_us_per_step", "steady_p50_us", "steady_p99_us"]
    print()
    print_table(rows, cols, title="Chunk manager per-step cost (steady = after the cache first filled)")

    verdict = {}
    if "ours" in managers:
        ours = {r["capacity"]: r for r in rows if r["manager"] == "ours"}
        for cap in capacities:
            peers = [r for r in rows if r["capacity"] == cap and r["manager"] != "ours"]
            if peers and cap in ours:
                fastest = min(peers, key=lambda p: p["steady_ns_per_key_op"])
                speedup = fastest["steady_ns_per_key_op"] / ours[cap]["steady_ns_per_key_op"]
                verdict[f"speedup_vs_fastest_peer@{cap}"] = {
                    "peer": fastest["manager"], "x": round(speedup, 2), "target": 3.0, "met": speedup >= 3.0,
                }
        lo, hi = min(ours), max(ours)
        if lo != hi:
            ratio = ours[hi]["steady_ns_per_key_op"] / ours[lo]["steady_ns_per_key_op"]
            verdict[f"scaling_{hi}_over_{lo}"] = {"x": round(ratio, 3), "target": 1.2, "met": ratio <= 1.2}
            for m in managers:  # the same ratio for each manager, for context
                by = {r["capacity"]: r["steady_ns_per_key_op"] for r in rows if r["manager"] == m}
                if lo in by and hi in by:
                    verdict[f"scaling_{hi}_over_{lo}"][m] = round(by[hi] / by[lo], 3)
        print("\nTargets:")
        for k, v in verdict.items():
            print(f"  {k}: {v}")

    if not args.no_write:
        path = write_json("manager", {
            "benchmark": "bench_manager",
            "settings": {"delay_steps": DELAY, "max_request_chunks": MAX_CHUNKS, "p_new": P_NEW,
                         "zipf_a": ZIPF_A, "fill_factor": args.fill_factor, "min_steps": args.min_steps,
                         "block_steps": args.block, "mode": mode, "rounds_below_1M": args.rounds,
                         "timer": "perf_counter_ns around manager calls only"},
            "managers": {m: LABELS[m] for m in managers},
            "traces": {str(k): v for k, v in traces.items()},
            "results": rows,
            "targets": verdict,
        })
        print(f"wrote {path}")
        png = plot(rows, capacities, managers)
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
