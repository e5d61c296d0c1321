"""Session leases (core/leases.py) in the host-tier LRU: leased chunks go after unleased ones, until expiry.

A fake clock drives expiry; keys are plain chunk keys. Each test fails on an
LRU without leases (the leased prefix is the least recent, so plain LRU
evicts it first).
"""

from __future__ import annotations

import itertools
import logging

import pytest

from tpu_offload.core import leases as L
from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Lookup
from tpu_offload.core.metrics import OffloadMetrics

_ids = itertools.count()


def keys(n: int) -> list:
    return [make_chunk_key(next(_ids).to_bytes(32, "big")) for _ in range(n)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def tier(n: int, fraction: float = 0.5, sessions: int = 8):
    clock = Clock()
    table = L.table_for(fraction, sessions, n, clock)
    return LRUChunkManager(n, 10, leases=table), table, clock


def store(m: LRUChunkManager, ks) -> list:
    alloc = m.prepare_store(ks)
    assert alloc is not None
    m.complete_store(alloc.keys)
    return alloc.evicted


def held(m, ks) -> int:
    return sum(m.lookup(k) is Lookup.HIT for k in ks)


def test_leased_chunks_are_evicted_after_unleased_ones():
    m, table, _ = tier(8)
    a = keys(4)
    store(m, a)  # the session's prefix: the least recent chunks
    assert table.lease("s1", 60, a) == 4
    other = keys(4)
    store(m, other)
    store(m, keys(4))  # another session's traffic: would evict `a` first under plain LRU
    assert held(m, a) == 4
    assert held(m, other) == 0
    assert table.honoured >= 4
    assert m.stats().leased_chunks == 4 and m.stats().leased_bytes == 40


def test_only_leased_chunks_left_evicts_the_least_recent_leased():
    m, table, _ = tier(4, fraction=1.0)
    a = keys(4)
    store(m, a)
    table.lease("s1", 60, a)
    evicted = store(m, keys(2))
    assert evicted == a[:2]  # a full tier of leased chunks still takes stores
    assert len(table) == 2  # evicted chunks leave the lease


def test_lease_expires():
    m, table, clock = tier(8)
    a = keys(4)
    store(m, a)
    table.lease("s1", 30, a)
    clock.t += 31
    store(m, keys(8))
    assert held(m, a) == 0
    assert table.expired == 1 and len(table) == 0 and table.sessions() == 0


def test_share_bound_caps_what_one_session_pins():
    m, table, _ = tier(8, fraction=0.25)  # 2 of 8 chunks
    a = keys(6)
    store(m, a)
    assert table.lease("s1", 60, a) == 2  # the head of the prefix
    b = keys(4)
    assert table.lease("s2", 60, b) == 0  # the share is used up
    store(m, keys(6))
    assert [m.lookup(k) is Lookup.HIT for k in a] == [True, True, False, False, False, False]


def test_renewal_keeps_the_lease_alive():
    m, table, clock = tier(8)
    a = keys(4)
    store(m, a)
    table.lease("s1", 30, a)
    clock.t += 25
    assert table.renew("s1", 30)  # the session came back
    clock.t += 25  # 50 s after the lease: expired without the renewal
    store(m, keys(4))
    store(m, keys(4))
    assert held(m, a) == 4 and table.expired == 0
    assert not table.renew("nobody", 30)


def test_table_is_bounded():
    m, table, _ = tier(64, fraction=1.0, sessions=2)
    for s in ("s1", "s2"):
        assert table.lease(s, 60, keys(2)) == 2
    assert table.lease("s3", 60, keys(2)) == 0 and table.refused == 1
    assert table.sessions() == 2 and len(table) == 4
    for _ in range(1000):  # renewals leave no unbounded state behind
        table.renew("s1", 60)
    assert len(table._heap) <= 4 * table.max_sessions + 64


def test_a_shared_prefix_stays_leased_until_both_leases_end():
    m, table, clock = tier(16)
    shared = keys(2)
    table.lease("s1", 10, shared)
    table.lease("s2", 100, shared)
    clock.t += 20
    table.expire()
    assert all(k in table for k in shared)
    clock.t += 100
    table.expire()
    assert len(table) == 0


def test_reset_and_discard_drop_leases():
    m, table, _ = tier(8)
    a = keys(4)
    store(m, a)
    table.lease("s1", 60, a)
    m.discard(a[:1])
    assert len(table) == 3
    m.reset()
    assert len(table) == 0 and table.sessions() == 0


def test_no_leases_when_the_share_is_zero():
    assert L.table_for(0.0, 8, 100) is None
    m = LRUChunkManager(4, 1)
    assert m.stats().leased_chunks == 0


@pytest.mark.parametrize("params,cause", [
    ({L.HINT_KEY: "abc"}, "not an object"),
    ({L.HINT_KEY: {"ttl_s": 5}}, "'session'"),
    ({L.HINT_KEY: {"session": "", "ttl_s": 5}}, "'session'"),
    ({L.HINT_KEY: {"session": "x" * 300, "ttl_s": 5}}, "longer"),
    ({L.HINT_KEY: {"session": "a", "ttl_s": -1}}, "'ttl_s'"),
    ({L.HINT_KEY: {"session": "a", "ttl_s": True}}, "'ttl_s'"),
    ({L.HINT_KEY: {"session": "a", "ttl_s": float("nan")}}, "'ttl_s'"),
])
def test_bad_hints_are_ignored_with_one_warning_per_cause(params, cause, caplog):
    L._warned.clear()
    with caplog.at_level(logging.WARNING, logger="tpu_offload.core.leases"):
        assert L.parse_hint(params) is None
        assert L.parse_hint(params) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and cause in msgs[0]


def test_good_hints_parse_and_clamp():
    assert L.parse_hint(None) is None and L.parse_hint({}) is None
    assert L.parse_hint({L.HINT_KEY: {"session": "a", "ttl_s": 90}}) == L.LeaseHint("a", 90.0)
    assert L.parse_hint({L.HINT_KEY: {"session": "a", "ttl_s": 1e9}}).ttl_s == L.MAX_TTL_S


def test_metrics_export_leased_bytes_and_counters():
    from prometheus_client import CollectorRegistry

    m, table, clock = tier(8)
    r = CollectorRegistry()
    om = OffloadMetrics(registry=r)
    om.add_tier("cpu", m.stats)
    a = keys(4)
    store(m, a)
    table.lease("s1", 30, a)
    store(m, keys(4))
    store(m, keys(4))
    clock.t += 31
    table.expire()
    om.record_leases(table)
    assert r.get_sample_value("tpu_offload_lease_honoured_chunks_total", {"tier": "cpu"}) >= 4
    assert r.get_sample_value("tpu_offload_leases_expired_total", {"tier": "cpu"}) == 1
    assert r.get_sample_value("tpu_offload_tier_leased_bytes", {"tier": "cpu"}) == 0
    table.lease("s2", 30, a[:2])
    assert r.get_sample_value("tpu_offload_tier_leased_bytes", {"tier": "cpu"}) == 20


class CK(bytes):
    """A chunk key that counts how often it is hashed (every dict/set probe or ordered-dict step)."""

    ticks = 0

    def __hash__(self):
        CK.ticks += 1
        return bytes.__hash__(self)


def test_eviction_passes_each_leased_chunk_once_not_every_time():
    """O(1) amortized per key: eviction moves the leased chunks it passes to the recent end, so a
    thousand later evictions do not each rescan the thousand leased chunks at the least recent end."""
    n = 2000
    m, table, _ = tier(n, fraction=0.5)
    ks = [CK(k) for k in keys(n)]
    store(m, ks)
    assert table.lease("s1", 60, ks[: n // 2]) == n // 2
    fresh = [CK(k) for k in keys(1000)]
    before = CK.ticks
    for k in fresh:
        store(m, [k])
    per_store = (CK.ticks - before) / len(fresh)
    assert per_store < 40, per_store  # rescanning would cost ~1,000 per store
    assert all(m.lookup(k) is Lookup.HIT for k in ks[: n // 2])
