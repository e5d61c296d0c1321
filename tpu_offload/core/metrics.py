"""Prometheus metrics shared by both backends.

Counters are ``tpu_offload_*``. Tier gauges are read from live ``TierStats``
at scrape time, so they hold their value between readings (the upstream TPU
logger zeroes its gauges every interval) and a router can size itself from
``tpu_offload_tier_capacity_bytes`` instead of a hand-set capacity.
Engine-specific names (``vllm:kv_offload_*``, ``tpu_inference:prefix_cache_*``)
are produced by the adapters from the same numbers.

Under ``PROMETHEUS_MULTIPROC_DIR`` (set by the llm-d overlays) the server
exports only what processes write to that directory, never custom
collectors; live gauges are then mirrored into ``mostrecent`` gauges,
refreshed at most once a second from the record paths, so they still hold
their last value between readings.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, REGISTRY
from prometheus_client.core import GaugeMetricFamily

from tpu_offload.core.throttle import TrailingThrottle
from tpu_offload.core.manager import TierStats

DIRECTIONS = ("store", "load")  # store: device → host; load: host → device
_LATENCY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class _TierCollector:
    """Reads tier stats when Prometheus scrapes, never caches a stale zero."""

    def __init__(self, tiers: dict[str, Callable[[], TierStats]], labels: dict[str, str],
                 extra: dict[str, tuple[str, Callable[[], float]]]):
        self._tiers = tiers
        self._labels = labels
        self._extra = extra

    def describe(self):
        return []

    def collect(self):
        names = ["tier", *self._labels]
        fams = {
            "capacity_bytes": GaugeMetricFamily("tpu_offload_tier_capacity_bytes", "Tier capacity in bytes", labels=names),
            "used_bytes": GaugeMetricFamily("tpu_offload_tier_used_bytes", "Bytes held by the tier", labels=names),
            "capacity_chunks": GaugeMetricFamily("tpu_offload_tier_capacity_chunks", "Tier capacity in chunks", labels=names),
            "used_chunks": GaugeMetricFamily("tpu_offload_tier_used_chunks", "Chunks held by the tier", labels=names),
            "pinned_chunks": GaugeMetricFamily("tpu_offload_tier_pinned_chunks", "Chunks pinned by in-flight loads", labels=names),
            "pending_chunks": GaugeMetricFamily("tpu_offload_tier_pending_chunks", "Chunks whose write is in flight", labels=names),
            "usage": GaugeMetricFamily("tpu_offload_tier_usage_ratio", "used / capacity", labels=names),
            "leased_bytes": GaugeMetricFamily(
                "tpu_offload_tier_leased_bytes", "Bytes of chunks under a session lease (the tpu_offload_lease "
                "hint in kv_transfer_params), stores in flight included", labels=names),
        }
        for tier, fn in self._tiers.items():
            s = fn()
            values = [tier, *self._labels.values()]
            fams["capacity_bytes"].add_metric(values, s.capacity_bytes)
            fams["used_bytes"].add_metric(values, s.used_bytes)
            fams["capacity_chunks"].add_metric(values, s.capacity_chunks)
            fams["used_chunks"].add_metric(values, s.used_chunks)
            fams["pinned_chunks"].add_metric(values, s.pinned_chunks)
            fams["pending_chunks"].add_metric(values, s.pending_chunks)
            fams["usage"].add_metric(values, s.usage)
            fams["leased_bytes"].add_metric(values, s.leased_bytes)
        yield from fams.values()
        for name, (doc, fn) in list(self._extra.items()):
            fam = GaugeMetricFamily(name, doc, labels=list(self._labels))
            fam.add_metric(list(self._labels.values()), float(fn()))
            yield fam

    def samples(self):
        """(name, doc, label names, label values, value) for the multiprocess mirror."""
        for fam in self.collect():
            for sample in fam.samples:
                yield fam.name, fam.documentation, list(sample.labels), list(sample.labels.values()), sample.value


class OffloadMetrics:
    """One instance per engine process; pass a registry in tests."""

    def __init__(self, registry: CollectorRegistry | None = None, labels: dict[str, str] | None = None):
        self.registry = registry if registry is not None else REGISTRY
        self.labels = dict(labels or {})
        ln = list(self.labels)
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*extra, *ln], registry=r)

        self.lookups = counter("tpu_offload_lookups", "Requests looked up in the offload tiers")
        self.hit_chunks = counter("tpu_offload_hit_chunks", "Chunks found ready in a tier", ["tier"])
        self.hit_tokens = counter("tpu_offload_hit_tokens", "Tokens served from a tier instead of recomputed", ["tier"])
        self.queried_tokens = counter("tpu_offload_queried_tokens", "Tokens looked up (hit or miss)")
        self.stored_chunks = counter("tpu_offload_stored_chunks", "Chunks stored", ["tier"])
        self.loaded_chunks = counter("tpu_offload_loaded_chunks", "Chunks loaded", ["tier"])
        self.bytes = counter("tpu_offload_transfer_bytes", "Bytes moved", ["direction"])
        self.seconds = counter("tpu_offload_transfer_seconds", "Seconds spent moving bytes", ["direction"])
        self.evictions = counter("tpu_offload_evicted_chunks", "Chunks evicted", ["tier"])
        self.alloc_failures = counter("tpu_offload_allocation_failures", "Stores refused: nothing evictable", ["tier"])
        self.load_errors = counter("tpu_offload_load_errors", "Loads that failed and were recomputed", ["tier"])
        self.deferred_blocks = counter("tpu_offload_deferred_blocks", "Blocks deferred to a later step by the per-step budget or staging (counted each step they wait)", ["direction"])
        self.deferred_bytes = counter("tpu_offload_deferred_bytes", "Bytes (all devices) deferred to a later step by the per-step budget or staging (counted each step they wait)", ["direction"])
        self.exclusive_chunks = counter(
            "tpu_offload_exclusive_chunks", "store_policy=exclusive: chunks whose HBM blocks were reused, by outcome "
            "(copied to the host, already there, lost: no staging budget or host slot in time)", ["outcome"])
        # load or recompute (core/costs.py): each hit's tokens by what was done, why, and where they were
        self.decision_tokens = counter(
            "tpu_offload_decision_tokens", "Hit tokens loaded or recomputed, by the load decision's reason "
            "(auto: measured costs; always/never: the setting) and the tier that held them",
            ["action", "reason", "tier"])
        self.decision_saved = counter(
            "tpu_offload_decision_saved_seconds", "Seconds the load decision expects to have saved against "
            "the other choice for each hit (loading its prefix, recomputing the rest)")
        # session leases (core/leases.py)
        self.lease_honoured = counter(
            "tpu_offload_lease_honoured_chunks", "Leased chunks an eviction kept while it evicted an unleased "
            "chunk of the same tier", ["tier"])
        self.leases_expired = counter(
            "tpu_offload_leases_expired", "Session leases that ran out before their session came back", ["tier"])
        self.latency = Histogram(
            "tpu_offload_transfer_latency_seconds", "Latency of one batched transfer",
            ["direction", *ln], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._tiers: dict[str, Callable[[], TierStats]] = {}
        self._extra: dict[str, tuple[str, Callable[[], float]]] = {}
        self._live = _TierCollector(self._tiers, self.labels, self._extra)
        self._multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._mirror: dict[str, Gauge] = {}
        self._throttle = TrailingThrottle(self._mirror_now)
        if not self._multiprocess:
            self.registry.register(self._live)

    def _l(self, **kw) -> dict[str, str]:
        return {**kw, **self.labels}

    def add_tier(self, name: str, stats_fn: Callable[[], TierStats]) -> None:
        self._tiers[name] = stats_fn
        self.refresh(force=True)

    def add_gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read from live state (an adapter's own names, e.g. staging usage)."""
        self._extra[name] = (doc, fn)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Multiprocess mode only: copy live gauges into files the server reads.

        At most once a second; a call inside that second schedules one trailing
        refresh, so the files never stay stale once the engine goes idle (the
        last stores of a burst complete in steps that trigger no later call).
        """
        if self._multiprocess:
            self._throttle(force)

    def _mirror_now(self) -> None:
        for name, doc, labelnames, labelvalues, value in self._live.samples():
            gauge = self._mirror.get(name)
            if gauge is None:
                gauge = self._mirror[name] = Gauge(
                    name, doc, labelnames, registry=self.registry, multiprocess_mode="mostrecent"
                )
            (gauge.labels(*labelvalues) if labelnames else gauge).set(value)

    def record_lookup(self, queried_tokens: int, hits: Iterable[tuple[str, int, int]] = ()) -> None:
        """``hits``: (tier, chunks, tokens) per tier that served the request."""
        self.refresh()
        self.lookups.labels(**self.labels).inc() if self.labels else self.lookups.inc()
        self._inc(self.queried_tokens, queried_tokens)
        for tier, chunks, tokens in hits:
            self.hit_chunks.labels(**self._l(tier=tier)).inc(chunks)
            self.hit_tokens.labels(**self._l(tier=tier)).inc(tokens)

    def record_transfer(self, direction: str, nbytes: int, seconds: float, chunks: int = 0, tier: str = "cpu") -> None:
        self.refresh()
        self.bytes.labels(**self._l(direction=direction)).inc(nbytes)
        self.seconds.labels(**self._l(direction=direction)).inc(seconds)
        self.latency.labels(**self._l(direction=direction)).observe(seconds)
        target = self.stored_chunks if direction == "store" else self.loaded_chunks
        if chunks:
            target.labels(**self._l(tier=tier)).inc(chunks)

    def record_evictions(self, n: int, tier: str = "cpu") -> None:
        if n:
            self.evictions.labels(**self._l(tier=tier)).inc(n)

    def record_alloc_failure(self, tier: str = "cpu") -> None:
        self.alloc_failures.labels(**self._l(tier=tier)).inc()

    def record_load_errors(self, n: int, tier: str = "cpu") -> None:
        if n:
            self.load_errors.labels(**self._l(tier=tier)).inc(n)

    def record_deferred(self, direction: str, blocks: int, nbytes: int = 0) -> None:
        if blocks:
            self.deferred_blocks.labels(**self._l(direction=direction)).inc(blocks)
        if nbytes:
            self.deferred_bytes.labels(**self._l(direction=direction)).inc(nbytes)

    def record_exclusive(self, outcome: str, n: int) -> None:
        if n:
            self.exclusive_chunks.labels(**self._l(outcome=outcome)).inc(n)

    def record_leases(self, table, tier: str = "cpu") -> None:
        """A tier's ``core.leases.LeaseTable`` (None: leases off): its honoured and expired counts since the
        last call."""
        if table is None:
            return
        honoured, expired = table.take_counts()
        if honoured:
            self.lease_honoured.labels(**self._l(tier=tier)).inc(honoured)
        if expired:
            self.leases_expired.labels(**self._l(tier=tier)).inc(expired)

    def record_decision(self, decision, chunk_tokens: int) -> None:
        """A ``core.costs.Decision`` taken for one request's hit."""
        for action, loaded in (("load", True), ("recompute", False)):
            for tier, tokens in decision.tokens_by_tier(chunk_tokens, loaded).items():
                self.decision_tokens.labels(**self._l(action=action, reason=decision.reason, tier=tier)).inc(tokens)
        if decision.saved_s > 0:
            self._inc(self.decision_saved, decision.saved_s)

    def _inc(self, metric, n) -> None:
        (metric.labels(**self.labels) if self.labels else metric).inc(n)
