"""Prometheus metrics: the core ``tpu_offload_*`` set plus tpu-inference's names.

Dashboards built for tpu-inference's connector keep working: the
``tpu_inference:prefix_cache_*`` series are exported where our meaning
matches theirs. Two differences, both deliberate: ``hits`` counts tokens
served from the host tier only (theirs also counts tokens already in HBM),
and lookups are counted once per admitted request (theirs on every retry).
Gauges are read from live state at scrape time, so they hold their value
between readings instead of dropping to zero every logging interval.

One instance per process and registry: the scheduler and worker halves of
the connector share it when they run in one process.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from tpu_offload.core.metrics import OffloadMetrics

_P = "tpu_inference:prefix_cache_"
_DURATION = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BW = (1, 2, 5, 10, 20, 50, 100, 200, 500)
_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26, 100 << 20, 1 << 30)
_lock = threading.Lock()
_instances: dict[int, "ConnectorMetrics"] = {}


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.core = OffloadMetrics(registry=registry)
        r = registry
        self.lookups = Counter(_P + "lookup_queries", "Requests looked up in the host tier", registry=r)
        self.hits = Counter(_P + "hits", "Tokens served from the host tier", registry=r)
        self.misses = Counter(_P + "miss", "Tokens looked up and not found in the host tier", registry=r)
        self.ops = {
            d: Counter(_P + f"{d}_operations", f"Batched {d.upper()} transfers", registry=r) for d in ("d2h", "h2d")
        }
        self.duration = {
            d: Histogram(_P + f"{d}_transfer_duration_seconds", f"{d.upper()} transfer latency", buckets=_DURATION, registry=r)
            for d in ("d2h", "h2d")
        }
        self.bandwidth = {
            d: Histogram(_P + f"{d}_transfer_bw", f"{d.upper()} bandwidth in GBps", buckets=_BW, registry=r)
            for d in ("d2h", "h2d")
        }
        self.size = {
            d: Histogram(_P + f"{d}_request_bytes", f"Bytes per {d.upper()} transfer", buckets=_BYTES, registry=r)
            for d in ("d2h", "h2d")
        }

        # From a load's dispatch to its done array found ready (polled once per step): the stall a
        # load budget (connector/budget.py) bounds
        self.load_ready = Histogram("tpu_offload_load_ready_seconds", "Seconds from a load's dispatch to its ready",
                                    buckets=_DURATION, registry=r)
        self.hbm_deferred = Counter("tpu_offload_hbm_bound_deferrals",
                                    "device_put path: dispatches that waited for earlier transfers to land, "
                                    "HBM in flight being at its bound (connector/hbm.py)", ["direction"], registry=r)
        # Exceptions caught in the connector's paths (never let into the engine step): see connector/guard.py
        self.errors = Counter("tpu_offload_connector_errors", "Exceptions the connector caught, by path", ["path"],
                              registry=r)
        self.dropped_stores = Counter("tpu_offload_dropped_store_chunks",
                                      "Chunks whose store was dropped by a caught connector error", registry=r)
        # DP attention (connector/dp.py): hits one rank serves from another rank's host slots
        self.cross_rank = Counter("tpu_offload_cross_rank_loads",
                                  "DP attention: chunks a rank loaded from another rank's host slots, by outcome "
                                  "(loaded; stale: overwritten by their owner since the lookup, recomputed)",
                                  ["outcome"], registry=r)

    @classmethod
    def get(cls, registry: CollectorRegistry | None = None) -> "ConnectorMetrics":
        registry = registry if registry is not None else REGISTRY
        with _lock:
            inst = _instances.get(id(registry))
            if inst is None:
                inst = _instances[id(registry)] = cls(registry)
            return inst

    # ---- feeding ---------------------------------------------------------
    def set_gauges(self, host_used_bytes: Callable[[], float], staging_used: Callable[[], float],
                   staging_total: int) -> None:
        g = self.core.add_gauge  # live gauges: never reset to zero between readings
        g(_P + "host_memory_usage", "Host tier bytes in use, GiB", lambda: host_used_bytes() / (1 << 30))
        g(_P + "staging_buffer_usage", "Staging blocks used by the last step", staging_used)
        g(_P + "staging_buffer_free", "Staging blocks free in the last step", lambda: staging_total - staging_used())

    def lookup(self, queried_tokens: int, hit_tokens: int, hit_chunks: int, fs_chunks: int = 0,
               chunk_tokens: int = 0, hbm_chunks: int = 0) -> None:
        """``fs_chunks`` of the ``hit_chunks`` come from the file tier (promoted through host RAM),
        ``hbm_chunks`` from blocks HBM's prefix cache still held past vLLM's own hit (tier "hbm")."""
        fs_tokens = min(fs_chunks * chunk_tokens, hit_tokens)
        hbm_tokens = min(hbm_chunks * chunk_tokens, hit_tokens - fs_tokens)
        hits = [(t, c, n) for t, c, n in (("cpu", hit_chunks - fs_chunks - hbm_chunks,
                                           hit_tokens - fs_tokens - hbm_tokens),
                                          ("fs", fs_chunks, fs_tokens), ("hbm", hbm_chunks, hbm_tokens)) if n]
        self.core.record_lookup(queried_tokens, hits)
        self.lookups.inc()
        self.hits.inc(hit_tokens - hbm_tokens)  # the host tier's (and files' through it), as documented
        self.misses.inc(max(0, queried_tokens - hit_tokens))

    def transfer(self, direction: str, nbytes: int, seconds: float, chunks: int) -> None:
        """``direction``: "store" (device to host) or "load"."""
        self.core.record_transfer(direction, nbytes, seconds, chunks)
        d = "d2h" if direction == "store" else "h2d"
        self.ops[d].inc()
        self.duration[d].observe(seconds)
        self.size[d].observe(nbytes)
        if seconds > 0:
            self.bandwidth[d].observe(nbytes / seconds / 1e9)
