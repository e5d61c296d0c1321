"""The exclusive policy's HBM watch, and the store_policy setting.

The watch must report a chunk exactly when one of its blocks was handed out
for other content (its tag changed), never for a prefix-cache hit on it
(tag unchanged), and never twice.
"""

from __future__ import annotations

import pytest

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.policy import HbmWatch, StorePolicy


def key(i: int):
    return make_chunk_key(i.to_bytes(8, "big"))


def test_reused_block_reports_its_chunk_once():
    tags = {1: "a", 2: "b", 3: "c", 4: "d"}
    w = HbmWatch()
    assert w.watch(key(1), [1, 2], tags.get, payload="p1")
    assert w.watch(key(2), [3, 4], tags.get)
    assert w.check([1, 2, 3, 4], tags.get) == []  # handed out as hits: same content
    tags[2] = None  # evicted and handed to new content
    out = w.check([2], tags.get)
    assert [(x.key, x.payload) for x in out] == [(key(1), "p1")]
    assert w.check([1, 2], tags.get) == [] and key(1) not in w and key(2) in w


def test_unwatchable_and_null_blocks():
    w = HbmWatch()
    assert not w.watch(key(1), [5], {5: None}.get)  # not in the prefix cache: the caller stores now
    assert not w.watch(key(1), [-1, 0], {}.get)  # nothing but placeholders
    assert w.watch(key(1), [-1, 0, 7], {7: "x"}.get) and len(w) == 1


def test_block_reused_unseen_counts_lost():
    tags = {1: "a"}
    w = HbmWatch()
    w.watch(key(1), [1], tags.get)
    tags[1] = "z"  # the block now holds another chunk the adapter watches
    w.watch(key(2), [1], tags.get)
    assert w.lost == 1 and w.keys() == [key(2)]


def test_second_copy_keeps_the_intact_first():
    tags = {1: "a", 9: "a"}
    w = HbmWatch()
    w.watch(key(1), [1], tags.get)
    w.watch(key(1), [9], tags.get)
    assert w.check([9], tags.get) == []
    tags[1] = None
    assert [x.key for x in w.check([1], tags.get)] == [key(1)]


def test_clear_and_discard():
    tags = {1: "a", 2: "b"}
    w = HbmWatch()
    w.watch(key(1), [1], tags.get)
    w.watch(key(2), [2], tags.get)
    w.discard([key(2)])
    assert [x.key for x in w.clear()] == [key(1)] and len(w) == 0
    tags[1] = None
    assert w.check([1, 2], tags.get) == []


def test_store_policy_setting():
    assert OffloadConfig.from_sources({}, {}).store_policy == StorePolicy.WRITE_THROUGH.value
    assert OffloadConfig.from_sources({"store_policy": "exclusive"}, {}).store_policy == "exclusive"
    assert OffloadConfig.from_sources({}, {"TPU_OFFLOAD_STORE_POLICY": "exclusive"}).store_policy == "exclusive"
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({"store_policy": "write_around"}, {})
    assert "store_policy" in str(e.value) and "write_around" in str(e.value) and "exclusive" in str(e.value)


def test_exclusive_outcomes_are_counted():
    from prometheus_client import CollectorRegistry

    from tpu_offload.core.metrics import OffloadMetrics

    r = CollectorRegistry()
    m = OffloadMetrics(registry=r)
    m.record_exclusive("copied", 3)
    m.record_exclusive("lost", 2)
    m.record_exclusive("lost", 0)
    assert r.get_sample_value("tpu_offload_exclusive_chunks_total", {"outcome": "copied"}) == 3
    assert r.get_sample_value("tpu_offload_exclusive_chunks_total", {"outcome": "lost"}) == 2
