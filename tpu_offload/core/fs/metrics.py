"""Prometheus metrics of file tiers (``tpu_offload_fs_*``), labelled by tier.

Registry-injectable like ``OffloadMetrics``; one ``FsMetrics`` per registry
(``for_registry``) so several tiers, or a tier re-created after a config
reload, share the families instead of failing on duplicate registration.
Capacity and usage are read from live tier state at scrape time.

Under ``PROMETHEUS_MULTIPROC_DIR`` (the llm-d overlays; vLLM's server then
exports only what processes write to that directory, never a custom
collector) the same gauges are mirrored into ``mostrecent`` gauges, refreshed
at most once a second from the I/O record paths plus one trailing refresh,
so they exist and hold their last value (the TPU workers' file tiers were
missing from ``/metrics`` before).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from tpu_offload.core.throttle import TrailingThrottle

_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_CACHE: "weakref.WeakKeyDictionary[CollectorRegistry, FsMetrics]" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


class _Usage:
    """Scrape-time gauges: bytes used and allowed, state, in-flight writes."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.tiers: dict[str, Callable[[], dict]] = {}

    def describe(self):
        return []

    def collect(self):
        names = ["tier", *self.labels]
        cap = GaugeMetricFamily("tpu_offload_fs_capacity_bytes", "File tier byte budget", labels=names)
        used = GaugeMetricFamily("tpu_offload_fs_used_bytes", "Bytes of chunk files this tier knows", labels=names)
        files = GaugeMetricFamily("tpu_offload_fs_files", "Chunk files this tier knows", labels=names)
        infl = GaugeMetricFamily("tpu_offload_fs_writes_in_flight", "Writes queued or running", labels=names)
        state = GaugeMetricFamily("tpu_offload_fs_state", "1 for the current state", labels=[*names, "state"])
        unreadable = GaugeMetricFamily("tpu_offload_fs_unreadable_paths",
                                       "Paths the last rescan could not read and skipped", labels=names)
        for tier, fn in list(self.tiers.items()):
            s = fn()
            v = [tier, *self.labels.values()]
            cap.add_metric(v, s["capacity_bytes"])
            used.add_metric(v, s["used_bytes"])
            files.add_metric(v, s["files"])
            infl.add_metric(v, s["writes_in_flight"])
            unreadable.add_metric(v, s.get("unreadable_paths", 0))
            for st in ("rw", "read_only", "off", "closed"):
                state.add_metric([*v, st], 1.0 if s["state"] == st else 0.0)
        yield from (cap, used, files, infl, state, unreadable)


class FsMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, labels: dict[str, str] | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = dict(labels or {})
        ln = ["tier", *self.labels]
        r = self.registry
        self.bytes = Counter("tpu_offload_fs_bytes", "Payload bytes moved to/from files", [*ln, "op"], registry=r)
        self.ops = Counter("tpu_offload_fs_ops", "File operations by outcome", [*ln, "op", "result"], registry=r)
        self.latency = Histogram(
            "tpu_offload_fs_latency_seconds", "Latency of one chunk file read or write",
            [*ln, "op"], buckets=_BUCKETS, registry=r,
        )
        self.evicted = Counter("tpu_offload_fs_evicted_files", "Files evicted by the tier's byte budget", ln, registry=r)
        self.corrupt = Counter("tpu_offload_fs_corrupt_files", "Files rejected on read", [*ln, "reason"], registry=r)
        self.dropped = Counter("tpu_offload_fs_dropped_writes", "Writes not done", [*ln, "reason"], registry=r)
        self.auth_failures = Counter("tpu_offload_fs_auth_failures",
                                     "Files whose MAC failed (written without this tier's key): never served",
                                     ln, registry=r)
        self.repairs = Counter("tpu_offload_fs_repairs",
                               "Self-healing: our directories set back to our mode (what=mode), entries in "
                               "the way of our names moved into the quarantine (moved_aside), and repairs "
                               "that could not be done (failed)", [*ln, "what"], registry=r)
        self._usage = _Usage(self.labels)
        self._multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._mirror: dict[str, Gauge] = {}
        self._throttle = TrailingThrottle(self._mirror_now)
        if not self._multiprocess:
            r.register(self._usage)

    def refresh(self, force: bool = False) -> None:
        """Multiprocess mode only: copy the live gauges into files the server reads (at most once a second)."""
        if self._multiprocess:
            self._throttle(force)

    def _mirror_now(self) -> None:
        for fam in self._usage.collect():
            gauge = self._mirror.get(fam.name)
            for sample in fam.samples:
                if gauge is None:
                    gauge = self._mirror[fam.name] = Gauge(fam.name, fam.documentation, list(sample.labels),
                                                           registry=self.registry, multiprocess_mode="mostrecent")
                gauge.labels(**sample.labels).set(sample.value)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry, labels: dict[str, str] | None = None) -> "FsMetrics":
        with _CACHE_LOCK:
            m = _CACHE.get(registry)
            if m is None:
                m = _CACHE[registry] = cls(registry, labels)
            return m

    def add_tier(self, tier: str, usage_fn: Callable[[], dict]) -> None:
        self._usage.tiers[tier] = usage_fn
        self.refresh(force=True)

    def remove_tier(self, tier: str, usage_fn: Callable[[], dict] | None = None) -> None:
        """Stop reporting ``tier`` (only if still registered with ``usage_fn``)."""
        if usage_fn is None or self._usage.tiers.get(tier) == usage_fn:
            self._usage.tiers.pop(tier, None)
            state = self._mirror.get("tpu_offload_fs_state")
            if state is not None:  # a closed tier keeps its last usage; its state says closed
                for st in ("rw", "read_only", "off", "closed"):
                    state.labels(tier=tier, **self.labels, state=st).set(1.0 if st == "closed" else 0.0)

    def for_tier(self, tier: str) -> "TierMetrics":
        return TierMetrics(self, {"tier": tier, **self.labels})


class TierMetrics:
    """Label-bound children, resolved once so the I/O path does no dict work."""

    def __init__(self, m: FsMetrics, lv: dict[str, str]):
        self._m, self._lv = m, lv
        self.read_bytes = m.bytes.labels(**lv, op="read")
        self.write_bytes = m.bytes.labels(**lv, op="write")
        self.read_latency = m.latency.labels(**lv, op="read")
        self.write_latency = m.latency.labels(**lv, op="write")
        self.evicted = m.evicted.labels(**lv)
        self._auth = m.auth_failures.labels(**lv)
        self._ops: dict[tuple[str, str], object] = {}

    def op(self, op: str, result: str, n: int = 1) -> None:
        child = self._ops.get((op, result))
        if child is None:
            child = self._ops[(op, result)] = self._m.ops.labels(**self._lv, op=op, result=result)
        child.inc(n)
        self._m.refresh()

    def repair(self, what: str) -> None:
        self._m.repairs.labels(**self._lv, what=what).inc()

    def auth_failure(self) -> None:
        self._auth.inc()

    def corrupt(self, reason: str) -> None:
        self._m.corrupt.labels(**self._lv, reason=reason).inc()

    def dropped(self, reason: str, n: int = 1) -> None:
        self._m.dropped.labels(**self._lv, reason=reason).inc(n)
