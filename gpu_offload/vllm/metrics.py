"""Metrics the vLLM path reports through ``OffloadingConnectorStats``.

vLLM turns these into Prometheus series in the API-server process, labelled
with its own engine labels, whichever process produced them. Names follow
vLLM's ``vllm:kv_offload_*`` where the meaning is the same as for vLLM's CPU
spec; the rest use the shared ``tpu_offload_*`` names of
``tpu_offload.core.metrics`` / ``tpu_offload.core.fs.metrics``, so one
dashboard or router config reads both backends. The capacity gauge is what
lets a router size itself without a hand-set ``lruCapacityPerServer``.

Two producers: the scheduler-side manager (``build_stats``: occupancy,
stores, evictions) and every worker (``WorkerStats``: the hits that actually
landed, and the file tier's ``tpu_offload_fs_*`` series, which live in the
worker process; read at most once a second). vLLM sums worker counters over
TP ranks and keeps the last gauge, so hits are sent by rank 0 only and
file-tier gauges carry ``rank``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from tpu_offload.core.fs import FsMetrics
from tpu_offload.core.manager import TierStats

from gpu_offload.vllm.compat import OffloadingConnectorStats, counter, gauge, histogram

TIER = ("cpu",)
FS_TIER = ("fs",)
_T = ("tier",)

USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
WRITE_USAGE = "vllm:kv_offload_cpu_cache_write_usage_perc"
READ_USAGE = "vllm:kv_offload_cpu_cache_read_usage_perc"
ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
CAPACITY_BYTES = "tpu_offload_tier_capacity_bytes"
USED_BYTES = "tpu_offload_tier_used_bytes"
CAPACITY_CHUNKS = "tpu_offload_tier_capacity_chunks"
USED_CHUNKS = "tpu_offload_tier_used_chunks"
HIT_CHUNKS = "tpu_offload_hit_chunks"
HIT_TOKENS = "tpu_offload_hit_tokens"
STORED_CHUNKS = "tpu_offload_stored_chunks"
EVICTED_CHUNKS = "tpu_offload_evicted_chunks"
# session leases (core/leases.py; the same series as tpu_offload.core.metrics)
LEASED_BYTES = "tpu_offload_tier_leased_bytes"
LEASE_HONOURED = "tpu_offload_lease_honoured_chunks"
LEASES_EXPIRED = "tpu_offload_leases_expired"
# load or recompute (core/costs.py; the same series as tpu_offload.core.metrics)
DECISION_TOKENS = "tpu_offload_decision_tokens"
DECISION_SAVED = "tpu_offload_decision_saved_seconds"
# 1: the worker's host slab is registered with CUDA (pinned); 0: cudaHostRegister failed and its copies run
# pageable (slower). Sent by every CUDA worker, labelled with its rank; absent on CPU.
PINNED = "tpu_offload_host_tier_pinned"

# tpu_offload.core.fs.metrics, sent from the workers.
FS_BYTES = "tpu_offload_fs_bytes"
FS_OPS = "tpu_offload_fs_ops"
FS_LATENCY = "tpu_offload_fs_latency_seconds"
FS_EVICTED = "tpu_offload_fs_evicted_files"
FS_CORRUPT = "tpu_offload_fs_corrupt_files"
FS_DROPPED = "tpu_offload_fs_dropped_writes"
FS_GAUGES = {  # usage() key -> series
    "capacity_bytes": "tpu_offload_fs_capacity_bytes",
    "used_bytes": "tpu_offload_fs_used_bytes",
    "files": "tpu_offload_fs_files",
    "writes_in_flight": "tpu_offload_fs_writes_in_flight",
}
FS_STATE = "tpu_offload_fs_state"
FS_STATES = ("rw", "read_only", "off", "closed")
FS_LATENCY_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_FS_COUNTERS = (  # (series, FsMetrics attribute, its labels after "tier")
    (FS_BYTES, "bytes", ("op",)), (FS_OPS, "ops", ("op", "result")), (FS_EVICTED, "evicted", ()),
    (FS_CORRUPT, "corrupt", ("reason",)), (FS_DROPPED, "dropped", ("reason",)),
)
FS_STATS_INTERVAL_S = 1.0  # file-tier series are read at most this often (~0.1 ms each time)

# 0.33 ``vllm:kv_offload_config_info`` labels, same names as vLLM's CPU spec.
CONFIG_INFO_KEYS = (
    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "cpu_kv_cache_size_tokens",
)


def lease_definitions() -> dict:
    """The session-lease series, by tier: the host tier's (``HostOffloadSpec``) and a ``SharedFileTier``'s."""
    return {
        LEASED_BYTES: gauge("Bytes of chunks under a session lease (the tpu_offload_lease hint in "
                            "kv_transfer_params), stores in flight included, by tier (HostOffloadSpec's "
                            "per-worker file tier: rank 0's files).", _T),
        LEASE_HONOURED: counter("Leased chunks an eviction kept while it evicted an unleased chunk of the same "
                                "tier.", _T),
        LEASES_EXPIRED: counter("Session leases that ran out before their session came back.", _T),
    }


def metric_definitions() -> dict:
    return {
        USAGE: gauge("Fraction of host-tier chunks pinned by in-flight loads or stores."),
        WRITE_USAGE: gauge("Fraction of host-tier chunks whose store is in flight."),
        READ_USAGE: gauge("Fraction of host-tier chunks pinned by in-flight loads."),
        ALLOCATION_SIZE: histogram(
            "Chunks requested by each host-tier prepare_store call.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536),
        ),
        CAPACITY_BYTES: gauge("Host-tier capacity in bytes, all workers of the engine.", _T),
        USED_BYTES: gauge("Host-tier bytes holding chunks, all workers of the engine.", _T),
        CAPACITY_CHUNKS: gauge("Host-tier capacity in chunks.", _T),
        USED_CHUNKS: gauge("Host-tier chunks in use.", _T),
        HIT_CHUNKS: counter("Chunks loaded instead of recomputed, by the tier they came from.", _T),
        HIT_TOKENS: counter("Tokens loaded instead of recomputed, by the tier they came from.", _T),
        STORED_CHUNKS: counter("Chunks stored into the host tier.", _T),
        EVICTED_CHUNKS: counter("Chunks evicted from the host tier.", _T),
        **lease_definitions(),
        DECISION_TOKENS: counter("Hit tokens loaded or recomputed, by the load decision's reason (auto: measured "
                                 "costs; always/never: the setting) and the tier that held them.",
                                 ("action", "reason", "tier")),
        DECISION_SAVED: counter("Seconds the load decision expects to have saved against the other choice."),
        PINNED: gauge("1 if this worker's host slab is pinned for DMA, 0 if cudaHostRegister failed and its copies "
                      "run from pageable memory (slower); CUDA workers only.", ("tier", "rank")),
        FS_BYTES: counter("Payload bytes moved to/from files", ("tier", "op")),
        FS_OPS: counter("File operations by outcome", ("tier", "op", "result")),
        FS_LATENCY: histogram("Latency of one chunk file read or write", FS_LATENCY_BUCKETS, ("tier", "op")),
        FS_EVICTED: counter("Files evicted by the tier's byte budget", _T),
        FS_CORRUPT: counter("Files rejected on read", ("tier", "reason")),
        FS_DROPPED: counter("Writes not done", ("tier", "reason")),
        **{name: gauge(doc, ("tier", "rank")) for name, doc in (
            (FS_GAUGES["capacity_bytes"], "File tier byte budget (per worker rank)"),
            (FS_GAUGES["used_bytes"], "Bytes of chunk files this tier knows (per worker rank)"),
            (FS_GAUGES["files"], "Chunk files this tier knows (per worker rank)"),
            (FS_GAUGES["writes_in_flight"], "Writes queued or running (per worker rank)"),
        )},
        FS_STATE: gauge("1 for the current state (per worker rank)", ("tier", "rank", "state")),
    }


def release_prometheus_names(registry=None) -> int:
    """Unregister collectors of our series from ``registry`` (prometheus' default).

    vLLM drops its own ``vllm:*`` collectors before an engine re-creates them
    (``unregister_vllm_metrics``); ours are named ``tpu_offload_*``, so without
    this the second engine of a process (a restart, as in notebooks and tests)
    fails with ``DuplicateTimeseries``. Returns how many were removed.
    """
    if registry is None:
        from prometheus_client import REGISTRY as registry
    ours = {n for n in metric_definitions() if not n.startswith("vllm:")}
    gone = 0
    for collector in list(getattr(registry, "_collector_to_names", {})):
        if getattr(collector, "_name", None) in ours:
            registry.unregister(collector)
            gone += 1
    return gone


def build_stats(
    s: TierStats,
    *,
    stored_chunks: int,
    evicted_chunks: int,
    allocation_sizes: list[int],
) -> OffloadingConnectorStats:
    """The manager's part. Gauges are snapshots; counters are the increase since the last call."""
    out = OffloadingConnectorStats()
    cap = s.capacity_chunks or 1
    out.set_gauge(USAGE, (s.pinned_chunks + s.pending_chunks) / cap)
    out.set_gauge(WRITE_USAGE, s.pending_chunks / cap)
    out.set_gauge(READ_USAGE, s.pinned_chunks / cap)
    out.set_gauge(CAPACITY_BYTES, s.capacity_bytes, TIER)
    out.set_gauge(USED_BYTES, s.used_bytes, TIER)
    out.set_gauge(CAPACITY_CHUNKS, s.capacity_chunks, TIER)
    out.set_gauge(USED_CHUNKS, s.used_chunks, TIER)
    out.set_gauge(LEASED_BYTES, s.leased_bytes, TIER)
    for n in allocation_sizes:
        out.observe_histogram(ALLOCATION_SIZE, n)
    if stored_chunks:
        out.increase_counter(STORED_CHUNKS, stored_chunks, TIER)
    if evicted_chunks:
        out.increase_counter(EVICTED_CHUNKS, evicted_chunks, TIER)
    return out


def add_decisions(out: OffloadingConnectorStats, tokens: dict[tuple[str, str, str], int], saved_s: float) -> None:
    """The manager's load decisions since the last call: (action, reason, tier) -> tokens, seconds saved."""
    for labels, n in tokens.items():
        if n:
            out.increase_counter(DECISION_TOKENS, n, labels)
    if saved_s > 0:
        out.increase_counter(DECISION_SAVED, saved_s)


def add_leases(out: OffloadingConnectorStats, honoured: int, expired: int, tier: tuple[str] = TIER) -> None:
    """A tier's session leases since the last call: chunks kept over unleased ones, leases run out."""
    if honoured:
        out.increase_counter(LEASE_HONOURED, honoured, tier)
    if expired:
        out.increase_counter(LEASES_EXPIRED, expired, tier)


class _RecordingHistogram:
    """Wraps the file tier's latency histogram and keeps each observation
    (bounded) so the worker can forward it: vLLM's channel carries samples."""

    def __init__(self, inner, maxlen: int = 65536):
        self.inner = inner
        self.samples: collections.deque = collections.deque(maxlen=maxlen)

    def labels(self, **kw):
        child, key, samples = self.inner.labels(**kw), (kw["tier"], kw["op"]), self.samples

        class _Child:
            def observe(self, v: float) -> None:
                child.observe(v)
                samples.append((key, v))

        return _Child()


def worker_fs_metrics() -> FsMetrics:
    """A private ``FsMetrics`` for one worker's file tier, read by ``WorkerStats``."""
    m = FsMetrics(CollectorRegistry())
    m.latency = _RecordingHistogram(m.latency)
    return m


class WorkerStats:
    """Per-step stats of one worker: hits that landed (rank 0), whether its slab is pinned, the file tier."""

    def __init__(self, rank: int, fs_interval_s: float = FS_STATS_INTERVAL_S):
        self.rank = rank
        self.fs_interval_s = fs_interval_s
        self._next_fs = 0.0
        self._next_pinned = 0.0
        self._hits_sent = {"cpu": [0, 0], "fs": [0, 0], "hbm": [0, 0]}
        self._fs_sent: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def collect(self, hits: dict, fs_tier: Any, fs_metrics: FsMetrics | None,
                pinned: bool | None = None) -> OffloadingConnectorStats | None:
        """``pinned``: whether the host slab is pinned (None off CUDA: not sent)."""
        out = OffloadingConnectorStats()
        if self.rank == 0:
            for tier, (chunks, tokens) in hits.items():
                sent = self._hits_sent.setdefault(tier, [0, 0])
                if chunks > sent[0]:
                    out.increase_counter(HIT_CHUNKS, chunks - sent[0], (tier,))
                if tokens > sent[1]:
                    out.increase_counter(HIT_TOKENS, tokens - sent[1], (tier,))
                sent[:] = [chunks, tokens]
        now = time.monotonic()
        if pinned is not None and now >= self._next_pinned:
            self._next_pinned = now + self.fs_interval_s
            out.set_gauge(PINNED, 1.0 if pinned else 0.0, (*TIER, str(self.rank)))
        if fs_tier is not None and fs_metrics is not None and now >= self._next_fs:
            self._next_fs = now + self.fs_interval_s
            self._fs(out, fs_tier, fs_metrics)
        return None if out.is_empty() else out

    def _fs(self, out: OffloadingConnectorStats, tier: Any, m: FsMetrics) -> None:
        with self._lock:
            for name, attr, labels_of in _FS_COUNTERS:
                for fam in getattr(m, attr).collect():
                    for sample in fam.samples:
                        if not sample.name.endswith("_total"):
                            continue
                        lv = (sample.labels["tier"], *(sample.labels[k] for k in labels_of))
                        key = (name, lv)
                        delta = sample.value - self._fs_sent.get(key, 0.0)
                        if delta > 0:
                            out.increase_counter(name, delta, lv)
                            self._fs_sent[key] = sample.value
            rec = m.latency
            while rec.samples:
                try:
                    lv, v = rec.samples.popleft()
                except IndexError:
                    break
                out.observe_histogram(FS_LATENCY, v, lv)
        if self.rank == 0 and getattr(tier, "leases", None) is not None:  # ranks lease alike: one reports
            leased, honoured, expired = tier.take_lease_counts()
            out.set_gauge(LEASED_BYTES, leased, (tier.name,))
            add_leases(out, honoured, expired, (tier.name,))
        usage = tier.usage()
        lv = (tier.name, str(self.rank))
        for key, name in FS_GAUGES.items():
            v = usage.get(key)
            if v is not None:
                out.set_gauge(name, float(v), lv)
        state = str(getattr(usage.get("state"), "value", usage.get("state")))
        for st in FS_STATES:
            out.set_gauge(FS_STATE, 1.0 if state == st else 0.0, (*lv, st))
