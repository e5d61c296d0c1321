"""The vLLM manager adapter over the core LRU, and the 0.33 API through the compat layer."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, make_offload_key
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_offload.vllm import compat as vllm_compat, metrics, patches
from gpu_offload.vllm.manager import HostTierManager
from gpu_offload.spec import HostOffloadSpec

CTX = ReqContext(req_id="r")


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def stored(mgr: HostTierManager, keys) -> list[int]:
    out = mgr.prepare_store(keys, CTX)
    mgr.complete_store(out.keys_to_store, CTX)
    return out.store_spec.block_ids.tolist()


@pytest.fixture
def mgr():
    m = HostTierManager(4, 8192, blocks_per_chunk=2, tokens_per_block=128, enable_events=True)
    yield m
    m.shutdown()


def test_lookup_store_load_cycle(mgr):
    k = [key(1), key(2)]
    assert mgr.lookup(k[0], CTX) is LookupResult.MISS
    out = mgr.prepare_store(k, CTX)
    assert out.keys_to_store == k and out.evicted_keys == []
    slots = out.store_spec.block_ids.tolist()
    assert len(set(slots)) == 2
    assert mgr.lookup(k[0], CTX) is LookupResult.HIT_PENDING
    assert mgr.prepare_store(k, CTX).keys_to_store == []  # in flight: not stored twice
    mgr.complete_store(k, CTX)
    assert mgr.lookup(k[1], CTX) is LookupResult.HIT
    assert mgr.get_load_source(k[1], CTX) == CacheHitSource.HOST
    load = mgr.prepare_load(k, CTX)
    assert load.block_ids.tolist() == slots
    mgr.complete_load(k, CTX)
    assert mgr.hit_chunks == 2 and mgr.stored_chunks == 2


def test_eviction_reports_keys_and_spares_the_offered_ones(mgr):
    stored(mgr, [key(i) for i in range(4)])
    mgr.touch([key(0)], CTX)  # key(1) is now least recent
    out = mgr.prepare_store([key(0), key(9)], CTX)
    assert out.keys_to_store == [key(9)] and out.evicted_keys == [key(1)]
    assert mgr.lookup(key(1), CTX) is LookupResult.MISS
    mgr.complete_store([key(9)], CTX)
    # everything pinned by loads: nothing can be evicted
    everyone = [key(0), key(2), key(3), key(9)]
    mgr.prepare_load(everyone, CTX)
    assert mgr.prepare_store([key(42)], CTX) is None


def test_failed_store_makes_the_chunk_vanish(mgr):
    out = mgr.prepare_store([key(1)], CTX)
    mgr.complete_store(out.keys_to_store, CTX, success=False)
    assert mgr.lookup(key(1), CTX) is LookupResult.MISS
    assert mgr.index.stats().used_chunks == 0


def test_events_map_to_vllm_offloading_events(mgr):
    stored(mgr, [key(1), key(2)])
    stored(mgr, [key(3), key(4)])
    mgr.prepare_store([key(5)], CTX)  # evicts key(1)
    events = list(mgr.take_events())
    assert [(e.keys, e.removed, e.medium) for e in events] == [
        ([key(1), key(2)], False, Medium.CPU),
        ([key(3), key(4)], False, Medium.CPU),
        ([key(1)], True, Medium.CPU),
    ]
    assert list(mgr.take_events()) == []


def test_reset_drops_pinned_and_in_flight_chunks_and_tolerates_stale_completions(mgr):
    stored(mgr, [key(1), key(2)])
    mgr.prepare_load([key(1)], CTX)
    mgr.prepare_store([key(3)], CTX)
    mgr.reset_cache()
    assert all(mgr.lookup(key(i), CTX) is LookupResult.MISS for i in (1, 2, 3))
    assert mgr.index.stats().used_chunks == 0  # slots of in-use chunks are free again
    mgr.complete_load([key(1)], CTX)  # vLLM fences these; if one slips through, no crash
    mgr.complete_store([key(3)], CTX)
    assert mgr.ignored_completions == 2
    assert len(stored(mgr, [key(i) for i in range(10, 14)])) == 4  # full capacity usable


def test_forgotten_chunks_miss_are_never_served_and_are_reported_removed_once(mgr):
    stored(mgr, [key(1), key(2)])
    list(mgr.take_events())
    mgr.prepare_load([key(1), key(2)], CTX)
    assert mgr.forget_chunks([key(1), key(2)]) == 2
    mgr.complete_load([key(1), key(2)], CTX)
    assert mgr.lookup(key(1), CTX) is LookupResult.MISS
    assert [(e.keys, e.removed) for e in mgr.take_events()] == [([key(1), key(2)], True)]
    mgr.touch([key(1), key(2)], CTX)  # ignored: they must age out
    stored(mgr, [key(7), key(8)])
    out = mgr.prepare_store([key(9), key(10)], CTX)  # evicts the two forgotten chunks
    assert set(out.evicted_keys) == {key(1), key(2)}
    assert [e.removed for e in mgr.take_events()] == [False]  # no second removal
    assert mgr.forget_chunks([key(1)]) == 0


def test_a_forgotten_chunk_is_stored_afresh_when_recomputed(mgr):
    """Its file is then written again (over a forged one, if that is why its load failed): one slot,
    never two, and it is served again once stored."""
    stored(mgr, [key(1), key(2)])
    list(mgr.take_events())
    mgr.prepare_load([key(1)], CTX)
    assert mgr.forget_chunks([key(1)]) == 1
    mgr.complete_load([key(1)], CTX)
    assert mgr.lookup(key(1), CTX) is LookupResult.MISS
    out = mgr.prepare_store([key(1)], CTX)  # the recompute stores it
    assert out.keys_to_store == [key(1)] and out.evicted_keys == []
    mgr.complete_store([key(1)], CTX)
    assert mgr.lookup(key(1), CTX) is LookupResult.HIT and mgr.index.stats().used_chunks == 2
    assert [(e.keys, e.removed) for e in mgr.take_events()] == [([key(1)], True), ([key(1)], False)]


def test_stats_use_only_declared_metrics(mgr):
    declared = HostOffloadSpec.build_metric_definitions({})
    assert declared == metrics.metric_definitions()
    stored(mgr, [key(1), key(2), key(3)])
    mgr.prepare_load([key(1)], CTX)
    mgr.prepare_store([key(4)], CTX)
    s = mgr.get_stats()
    values = s.data["data"]
    assert set(values) <= set(declared)
    assert values[metrics.CAPACITY_BYTES][("cpu",)] == 4 * 8192
    assert values[metrics.USED_CHUNKS][("cpu",)] == 4
    assert values[metrics.READ_USAGE][()] == 0.25 and values[metrics.WRITE_USAGE][()] == 0.25
    assert metrics.HIT_TOKENS not in values  # hits come from the worker: what actually landed
    assert values[metrics.STORED_CHUNKS][("cpu",)] == 3
    again = mgr.get_stats().data["data"]  # counters are deltas, gauges persist
    assert metrics.STORED_CHUNKS not in again and again[metrics.CAPACITY_BYTES][("cpu",)] == 4 * 8192


def test_033_manager_api_through_the_compat_layer(mgr):
    with mgr.lock:  # the 0.33 scheduler holds it for a whole step
        with mgr.lock:  # no re-entrancy needed, but a no-op lock allows it
            assert mgr.lookup(key(1), CTX) is LookupResult.MISS
    (info,) = mgr.config_info()
    assert tuple(info) == HostOffloadSpec.config_info_keys({})
    assert info["cpu_kv_cache_size_bytes"] == 4 * 8192 and info["cpu_kv_cache_size_tokens"] == 4 * 256
    assert mgr.on_reset_flushed() is None
    import vllm.v1.kv_offload.base as base

    assert vllm_compat.HAS_MANAGER_LOCK == hasattr(base.OffloadingManager, "lock")
    assert vllm_compat.HAS_ON_RESET_FLUSHED == hasattr(base.OffloadingManager, "on_reset_flushed")


class _Connector:
    """The connector attributes our patches read; ``get_finished`` as vLLM's worker side does it."""

    def __init__(self, worker, groups: int):
        import types

        self.connector_worker = types.SimpleNamespace(worker=worker, _load_jobs={1: "req-a", 2: "req-b"})
        self.connector_scheduler = None
        self._kv_cache_config = types.SimpleNamespace(kv_cache_groups=[object()] * groups)

    def get_finished(self, finished_req_ids):
        done = {r.job_id for r in self.connector_worker.worker.get_finished()}
        return set(), {self.connector_worker._load_jobs.pop(j) for j in done}


def _failing_worker():
    import types

    import numpy as np
    import torch

    from gpu_offload.vllm.worker import HostOffloadWorker

    w = HostOffloadWorker([torch.zeros(8, 4096, dtype=torch.int8)], [4096], [(0,)], 4, 1, tokens_per_block=[16])
    slot = types.SimpleNamespace(block_ids=np.array([0], np.int32))
    w.submit_load(1, slot, types.SimpleNamespace(block_ids=np.array([5], np.int32), group_sizes=[1], block_indices=[0]))
    return w  # slot 0 was never stored: job 1 leaves block 5 unfilled


@pytest.mark.parametrize("groups", [1, 2])
def test_load_errors_reach_the_scheduler_as_blocks_or_as_failed_requests(groups):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector as C

    patches.install()  # idempotent: the spec's construction installs them too
    conn = _Connector(_failing_worker(), groups)
    res = C.get_transfer_results(conn, set())
    assert res.finished_recving == {"req-a"}
    if groups == 1:  # vLLM recomputes just the block
        assert res.failed_recving == set() and C.get_block_ids_with_load_errors(conn) == {5}
    else:  # block ids are ambiguous with several KV-cache groups: the request is recomputed
        assert res.failed_recving == {"req-a"} and C.get_block_ids_with_load_errors(conn) == set()
    assert C.get_block_ids_with_load_errors(conn) == set()
    foreign = _Connector(object(), 1)
    assert C.get_block_ids_with_load_errors(foreign) == set()


def test_worker_metrics_reach_vllm_through_the_managers_get_stats():
    """Each worker's stats ride in its step report (summed over ranks as vLLM sums worker stats); our manager's
    ``get_stats``, vLLM's channel for a spec's metrics, returns them with its own, once."""
    import types

    from gpu_offload.vllm import hooks
    from gpu_offload.vllm.compat import OffloadingConnectorStats

    def rank(hit_tokens: int):
        stats = OffloadingConnectorStats()
        stats.increase_counter(metrics.HIT_TOKENS, hit_tokens, ("cpu",))
        worker = _failing_worker()
        worker.take_connector_stats = lambda: stats
        conn = _Connector(worker, 1)
        conn._connector_metadata = None
        return hooks.wrap_build_connector_worker_meta(lambda self: None)(conn)

    report = rank(16).aggregate(rank(32))
    m = HostTierManager(4, 8192, blocks_per_chunk=2, tokens_per_block=128)
    try:
        sched = types.SimpleNamespace(connector_scheduler=types.SimpleNamespace(manager=m, _jobs={}))
        seen = []
        out = types.SimpleNamespace(kv_connector_worker_meta=report, failed_recving=set(), invalid_block_ids=set())
        hooks.wrap_update_connector_output(lambda self, o: seen.append(o))(sched, out)
        assert seen == [out]  # vLLM's own update still runs
        assert m.get_stats().data["data"][metrics.HIT_TOKENS] == {("cpu",): 48}
        assert metrics.HIT_TOKENS not in m.get_stats().data["data"]  # handed over once
    finally:
        m.shutdown()
