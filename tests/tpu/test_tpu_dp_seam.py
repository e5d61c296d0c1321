"""Our metadata through tpu-inference's own DPScheduler merge (``_combine_scheduler_outputs``).

The merge keeps only ``requests_meta`` / ``reqs_to_send`` / ``reqs_to_load``
of an empty ``type(meta)()`` and shifts ``local_block_ids`` by
``rank * num_blocks_per_rank``. Each rank's orders ride as one item; the
worker gets global block ids and each rank's own partition of the host tier.
"""

import pickle
import types

import pytest

from tpu_offload.connector import dp
from tpu_offload.connector.metadata import LoadOp, OffloadMetadata, OffloadReport, StoreOp

BLOCKS_PER_RANK, SLOTS = 10, 8


def _merge(metas):
    """tpu-inference's merge, run on what each rank's process would send (pickled, as over its pipe)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    try:
        from tpu_offload.testing import cpu_support

        cpu_support._import_torchax()  # tpu-inference's package needs the CPU support's torchax shim
        from tpu_inference.core.sched.dp_scheduler import DPScheduler
    except Exception as e:  # the .venv environment has no working tpu-inference
        pytest.skip(f"tpu-inference cannot be imported here: {e!r}")

    sched = object.__new__(DPScheduler)
    sched.per_rank_kv_cache_configs = [types.SimpleNamespace(num_blocks=BLOCKS_PER_RANK)] * len(metas)
    sched.assigned_dp_rank = {}
    outs = []
    for m in metas:
        so = SchedulerOutput.make_empty()
        so.kv_connector_metadata = m
        outs.append(pickle.loads(pickle.dumps(so)))
    return sched._combine_scheduler_outputs(outs).kv_connector_metadata


def test_without_the_wrap_our_orders_arrive_empty():
    meta = OffloadMetadata(stores=[StoreOp(1, "a", [0], [3, 4])])
    merged = _merge([meta, OffloadMetadata()])
    assert type(merged) is OffloadMetadata and not merged.stores and not merged.requests_meta


def test_each_ranks_orders_arrive_in_global_blocks_and_its_own_slots():
    r0 = OffloadMetadata(stores=[StoreOp(1, "a", [0, 2], [3, 4, 5, 6])], release=["a"],
                         loads=[LoadOp(2, "b", [1], [-1, 7], True, True)])
    r1 = OffloadMetadata(stores=[StoreOp(1 << 40, "c", [0], [3, 4], groups=[[3, 4]])],
                         loads=[LoadOp(5 << 40, "d", [3, -1], [0, 1, 2, 9], True, True, restart=0)])
    un = dp.Unwrapper(2, 2 * BLOCKS_PER_RANK, SLOTS)
    out = un(_merge([dp.wrap(r0), dp.wrap(r1)]))
    assert [(op.req_id, op.slots, op.blocks) for op in out.stores] == [
        ("a", [0, 2], [3, 4, 5, 6]), ("c", [4], [13, 14])]
    assert out.stores[1].groups == [[13, 14]]
    assert [(op.req_id, op.slots, op.blocks, op.restart) for op in out.loads] == [
        ("b", [1], [-1, 7], -1), ("d", [7, -1], [10, 11, 12, 19], 10)]
    assert out.release == ["a"]

    # completions go to every rank; failed slots come back in the issuing rank's own numbering
    rep = un.localize(OffloadReport(stores=[(1 << 40, 0, [4])], loads=[(5 << 40, 0, [7]), (2, 0, [1])]))
    assert rep.stores == [(1 << 40, 0, [0])] and rep.loads == [(5 << 40, 0, [3]), (2, 0, [1])]


def test_one_merged_object_is_unwrapped_once():
    un = dp.Unwrapper(2, 2 * BLOCKS_PER_RANK, SLOTS)
    merged = _merge([dp.wrap(OffloadMetadata(stores=[StoreOp(1, "a", [1], [2, 3])])), dp.wrap(OffloadMetadata())])
    first = un(merged)
    assert un(merged) is first and first.stores[0].blocks == [2, 3]  # not shifted twice


def test_ranks_op_ids_do_not_meet():
    starts = {dp.first_op_id(2) for _ in range(64)}
    assert dp.first_op_id(1) == 0 and len(starts) > 60 and all(s % dp.OP_ID_SPAN == 0 for s in starts)


def test_finished_ids_are_kept_only_by_the_rank_holding_their_blocks():
    class Manager:  # vLLM's KVCacheManager.get_block_ids: per KV-cache group, the request's blocks
        def get_block_ids(self, req_id):
            return ([1, 2],) if req_id == "mine" else ([],)

    out = types.SimpleNamespace(finished_sending={"mine", "other"}, finished_recving={"other"})
    dp.keep_own(out, Manager())
    assert out.finished_sending == {"mine"} and out.finished_recving == set()


def test_a_chunk_stored_by_one_rank_is_loaded_by_the_other_from_its_slot():
    """The worker publishes (slot, generation, key) with the completion; the other rank's index names that
    slot and generation in its load; once the owner overwrites the slot, the same reference fails."""
    from tpu_offload.core.lru import LRUChunkManager

    un = dp.Unwrapper(2, 2 * BLOCKS_PER_RANK, SLOTS)
    key = b"k" * 16
    out = un(_merge([dp.wrap(OffloadMetadata(stores=[StoreOp(7, "a", [2], [3], keys=[key])])),
                     dp.wrap(OffloadMetadata())]))
    assert out.stores[0].slots == [2] and out.stores[0].keys == []  # no file tier: nothing to write
    report = un.localize(OffloadReport(stores=[(7, 0, [])]))
    assert report.retired == [2] and report.published == [(2, 1, key)]
    report = pickle.loads(pickle.dumps(report))  # as every rank receives it

    rank1 = dp.SharedIndex(SLOTS)
    rank1.apply(report)
    own = LRUChunkManager(SLOTS // 2, 1)
    assert rank1.extend([key, b"x" * 16], 0) == 1
    slots, ready = [-5], [False]
    assert rank1.place(own, [key], [0], slots, ready) == [] and ready == [True]  # nothing pinned on rank 1
    ref = slots[0]
    assert ref < -1 and dp.parse_ref(ref, SLOTS) == (2, 1)

    load = un(_merge([dp.wrap(OffloadMetadata()),
                      dp.wrap(OffloadMetadata(loads=[LoadOp(1 << 40, "b", [ref], [4], True, True)]))]))
    assert load.loads[0].slots == [2] and load.loads[0].blocks == [14]  # rank 0's slot, rank 1's block

    # rank 0 reuses its slot: the other rank's index forgets the key, and an old reference fails
    un(_merge([dp.wrap(OffloadMetadata(stores=[StoreOp(8, "c", [2], [5], keys=[b"n" * 16])])),
               dp.wrap(OffloadMetadata())]))
    late = un(_merge([dp.wrap(OffloadMetadata()),
                      dp.wrap(OffloadMetadata(loads=[LoadOp((1 << 40) + 1, "d", [ref], [4], True, True)]))]))
    assert late.loads[0].slots == [-1] and un.stale == 1
    assert un.foreign == 1
    report = un.localize(OffloadReport(stores=[(8, 0, [])], loads=[((1 << 40) + 1, 0, [-1])]))
    assert report.loads == [((1 << 40) + 1, 0, [-1])]
    rank1.apply(report)
    assert rank1.extend([key], 0) == 0 and rank1.extend([b"n" * 16], 0) == 1


def test_a_reset_drops_publications_of_earlier_stores():
    un = dp.Unwrapper(2, 2 * BLOCKS_PER_RANK, SLOTS)
    un(_merge([dp.wrap(OffloadMetadata(stores=[StoreOp(7, "a", [0], [3], keys=[b"k" * 16])])),
               dp.wrap(OffloadMetadata())]))
    un(_merge([dp.wrap(OffloadMetadata(reset_salt="r0")), dp.wrap(OffloadMetadata(reset_salt="r1"))]))
    assert un.localize(OffloadReport(stores=[(7, 0, [])])).published == []


def test_cross_rank_loads_are_exported():
    """The worker's counts of chunks loaded from another rank's slots reach Prometheus, by outcome."""
    from prometheus_client import CollectorRegistry

    from tpu_offload.connector.metrics import ConnectorMetrics

    registry = CollectorRegistry()
    un = dp.Unwrapper(2, 2 * BLOCKS_PER_RANK, SLOTS)
    un.metrics = ConnectorMetrics(registry)
    un(_merge([dp.wrap(OffloadMetadata(stores=[StoreOp(7, "a", [2], [3], keys=[b"k" * 16])])),
               dp.wrap(OffloadMetadata())]))
    ref = dp.foreign_ref(2, 1, SLOTS)
    un(_merge([dp.wrap(OffloadMetadata()),
               dp.wrap(OffloadMetadata(loads=[LoadOp(1 << 40, "b", [ref], [4], True, True)]))]))
    un(_merge([dp.wrap(OffloadMetadata(stores=[StoreOp(8, "c", [2], [5], keys=[b"n" * 16])])),
               dp.wrap(OffloadMetadata())]))
    un(_merge([dp.wrap(OffloadMetadata()),
               dp.wrap(OffloadMetadata(loads=[LoadOp((1 << 40) + 1, "d", [ref], [4], True, True)]))]))

    def value(outcome):
        return registry.get_sample_value("tpu_offload_cross_rank_loads_total", {"outcome": outcome})

    assert (un.foreign, un.stale) == (1, 1) and (value("loaded"), value("stale")) == (1.0, 1.0)
