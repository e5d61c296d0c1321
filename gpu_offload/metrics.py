"""Metrics the vLLM host tier reports through ``OffloadingConnectorStats``.

vLLM turns these into Prometheus series in the API-server process, labelled
with its own engine labels. Names follow vLLM's ``vllm:kv_offload_*`` where
the meaning is the same as for vLLM's CPU spec; the rest use the shared
``tpu_offload_*`` names of ``tpu_offload.core.metrics`` (with ``tier="cpu"``),
so one dashboard or router config reads both backends. The capacity gauge is
what lets a router size itself without a hand-set ``lruCapacityPerServer``.
"""

from __future__ import annotations

from tpu_offload.core.manager import TierStats

from gpu_offload.vllm_compat import OffloadingConnectorStats, counter, gauge, histogram

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

# 0.33 ``vllm:kv_offload_config_info`` labels, same names as vLLM's CPU spec.
CONFIG_INFO_KEYS = (
    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "cpu_kv_cache_size_tokens",
)


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
    }


def build_stats(
    s: TierStats,
    *,
    hit_chunks: int,
    tokens_per_chunk: int,
    stored_chunks: int,
    evicted_chunks: int,
    allocation_sizes: list[int],
    fs_hit_chunks: int = 0,
) -> OffloadingConnectorStats:
    """Gauges are snapshots; counters are the increase since the last call."""
    out = OffloadingConnectorStats()
    cap = s.capacity_chunks or 1
    out.set_gauge(USAGE, (s.pinned_chunks + s.pending_chunks) / cap)
    out.set_gauge(WRITE_USAGE, s.pending_chunks / cap)
    out.set_gauge(READ_USAGE, s.pinned_chunks / cap)
    out.set_gauge(CAPACITY_BYTES, s.capacity_bytes, TIER)
    out.set_gauge(USED_BYTES, s.used_bytes, TIER)
    out.set_gauge(CAPACITY_CHUNKS, s.capacity_chunks, TIER)
    out.set_gauge(USED_CHUNKS, s.used_chunks, TIER)
    for n in allocation_sizes:
        out.observe_histogram(ALLOCATION_SIZE, n)
    if hit_chunks:
        out.increase_counter(HIT_CHUNKS, hit_chunks, TIER)
        out.increase_counter(HIT_TOKENS, hit_chunks * tokens_per_chunk, TIER)
    if fs_hit_chunks:  # promoted from files through the host tier
        out.increase_counter(HIT_CHUNKS, fs_hit_chunks, FS_TIER)
        out.increase_counter(HIT_TOKENS, fs_hit_chunks * tokens_per_chunk, FS_TIER)
    if stored_chunks:
        out.increase_counter(STORED_CHUNKS, stored_chunks, TIER)
    if evicted_chunks:
        out.increase_counter(EVICTED_CHUNKS, evicted_chunks, TIER)
    return out
