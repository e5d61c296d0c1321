"""Metrics: counters move; tier gauges are read from live stats at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.metrics import OffloadMetrics


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """Every sample of a real text-format scrape, keyed by (name, sorted labels)."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize("labels", [None, {"model": "m", "engine": "e0"}])
def test_counters_move(labels):
    reg = CollectorRegistry()
    m = OffloadMetrics(registry=reg, labels=labels)
    L = tuple(sorted((labels or {}).items()))

    def v(name, **kw):
        return reg.get_sample_value(name, {**kw, **(labels or {})})

    assert (v("tpu_offload_lookups_total") or 0) == 0  # a labelled child appears on first use
    m.record_lookup(512, hits=[("cpu", 2, 256), ("fs", 1, 128)])
    m.record_lookup(100)
    assert v("tpu_offload_lookups_total") == 2
    assert v("tpu_offload_queried_tokens_total") == 612
    assert v("tpu_offload_hit_chunks_total", tier="cpu") == 2
    assert v("tpu_offload_hit_tokens_total", tier="fs") == 128

    m.record_transfer("store", nbytes=4096, seconds=0.002, chunks=3)
    m.record_transfer("load", nbytes=1000, seconds=0.5, chunks=1, tier="fs")
    m.record_transfer("load", nbytes=24, seconds=0.1)
    assert v("tpu_offload_transfer_bytes_total", direction="store") == 4096
    assert v("tpu_offload_transfer_bytes_total", direction="load") == 1024
    assert v("tpu_offload_transfer_seconds_total", direction="load") == pytest.approx(0.6)
    assert v("tpu_offload_stored_chunks_total", tier="cpu") == 3
    assert v("tpu_offload_loaded_chunks_total", tier="fs") == 1
    assert v("tpu_offload_transfer_latency_seconds_count", direction="load") == 2
    assert v("tpu_offload_transfer_latency_seconds_bucket", direction="store", le="0.005") == 1

    m.record_evictions(0)
    m.record_evictions(5)
    m.record_alloc_failure()
    m.record_load_errors(2, tier="fs")
    m.record_deferred("load", 7)
    assert v("tpu_offload_evicted_chunks_total", tier="cpu") == 5
    assert v("tpu_offload_allocation_failures_total", tier="cpu") == 1
    assert v("tpu_offload_load_errors_total", tier="fs") == 2
    assert v("tpu_offload_deferred_blocks_total", direction="load") == 7
    # and the same numbers come out of a real text scrape
    assert scrape(reg)[("tpu_offload_evicted_chunks_total", tuple(sorted({"tier": "cpu", **dict(L)}.items())))] == 5


def test_tier_gauges_read_live_stats_and_hold():
    reg = CollectorRegistry()
    metrics = OffloadMetrics(registry=reg)
    mgr = LRUChunkManager(8, 1 << 20)
    metrics.add_tier("cpu", mgr.stats)
    g = ("tpu_offload_tier_used_chunks", (("tier", "cpu"),))
    cap = ("tpu_offload_tier_capacity_bytes", (("tier", "cpu"),))

    first = scrape(reg)
    assert first[g] == 0 and first[cap] == 8 << 20

    keys = [make_chunk_key(bytes([i]) * 32) for i in range(5)]
    alloc = mgr.prepare_store(keys)
    second = scrape(reg)
    assert second[g] == 5
    assert second[("tpu_offload_tier_pending_chunks", (("tier", "cpu"),))] == 5
    assert second[("tpu_offload_tier_used_bytes", (("tier", "cpu"),))] == 5 << 20

    mgr.complete_store(alloc.keys)
    mgr.prepare_load(keys[:2])
    for _ in range(3):  # no reset between scrapes: the value holds
        s = scrape(reg)
        assert s[g] == 5
        assert s[("tpu_offload_tier_pinned_chunks", (("tier", "cpu"),))] == 2
        assert s[("tpu_offload_tier_pending_chunks", (("tier", "cpu"),))] == 0
        assert s[("tpu_offload_tier_usage_ratio", (("tier", "cpu"),))] == pytest.approx(5 / 8)


def test_two_instances_on_separate_registries():
    a, b = CollectorRegistry(), CollectorRegistry()
    OffloadMetrics(registry=a).record_evictions(1)
    OffloadMetrics(registry=b).record_evictions(2)
    assert a.get_sample_value("tpu_offload_evicted_chunks_total", {"tier": "cpu"}) == 1
    assert b.get_sample_value("tpu_offload_evicted_chunks_total", {"tier": "cpu"}) == 2
