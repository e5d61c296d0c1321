"""Scheduler-side bookkeeping of the file tier's KV events on vLLM (``file_events``).

The end-to-end check (real engine, publisher and subscriber) is
tests/events/test_kv_events_files.py; these pin the cases a short workload cannot reach:
several ranks, failed writes, lost outcomes, the announcement cap.
"""

from __future__ import annotations

from gpu_offload.vllm.compat import Medium
from gpu_offload.vllm.file_events import FileEvents, FileTierWorkerMetadata
from tpu_offload.core.fs.journal import FAILED, PUBLISHED, REMOVED


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def meta(*entries):
    return FileTierWorkerMetadata.wrap(None, entries)


def evs(fe: FileEvents):
    return [(e.medium, e.removed, tuple(e.keys)) for e in fe.take()]


K1, K2, K3 = b"k1" * 8, b"k2" * 8, b"k3" * 8


def test_a_chunk_is_announced_once_every_rank_has_its_file():
    fe = FileEvents(world_size=2)
    fe.note(meta((PUBLISHED, K1)))
    assert evs(fe) == []
    merged = meta((PUBLISHED, K1)).aggregate(meta((REMOVED, K2)))  # vLLM's aggregator, two ranks
    assert merged.fs_published == {K1: 1} and merged.fs_removed == {K2: 1}
    fe.note(merged)
    assert evs(fe) == [(Medium.STORAGE, False, (K1,))]
    fe.note(meta((REMOVED, K1)))  # one rank lost its file: lookups miss it now
    assert evs(fe) == [(Medium.STORAGE, True, (K1,))]


def test_a_held_host_removal_waits_for_the_file_then_follows_it():
    clock = Clock()
    fe = FileEvents(world_size=1, hold_s=60, clock=clock)
    fe.expect([K1, K2])
    assert fe.hold([K1, K2, K3]) == [K3]  # K3 has no write coming: announced at once
    fe.note(meta((PUBLISHED, K1), (FAILED, K2)))
    # The file first (the tracker still has the payload), then the host removal; K2 never landed.
    assert evs(fe) == [(Medium.STORAGE, False, (K1,)), (Medium.CPU, True, (K1,)), (Medium.CPU, True, (K2,))]
    assert fe.held_timeouts == 0


def test_a_lost_outcome_releases_the_host_removal_after_the_hold():
    clock = Clock()
    fe = FileEvents(world_size=1, hold_s=60, clock=clock)
    fe.expect([K1])
    assert fe.hold([K1]) == []
    clock.t = 59
    assert evs(fe) == []
    clock.t = 61
    assert evs(fe) == [(Medium.CPU, True, (K1,))]
    assert fe.held_timeouts == 1


def test_back_in_the_host_tier_before_the_file_landed_cancels_the_removal():
    fe = FileEvents(world_size=1)
    fe.expect([K1])
    assert fe.hold([K1]) == []
    assert fe.back_in_host([K1, K2]) == [K2]  # the router never saw K1 leave
    fe.note(meta((PUBLISHED, K1)))
    assert evs(fe) == [(Medium.STORAGE, False, (K1,))]


def test_announcements_are_capped_oldest_retracted_first():
    fe = FileEvents(world_size=1, max_announced=2)
    fe.note(meta((PUBLISHED, K1), (PUBLISHED, K2), (PUBLISHED, K3)))
    assert evs(fe) == [(Medium.STORAGE, False, (K1,)), (Medium.STORAGE, False, (K2,)),
                       (Medium.STORAGE, False, (K3,)), (Medium.STORAGE, True, (K1,))]
    fe.note(meta((REMOVED, K1)))  # retracted already: nothing more
    assert evs(fe) == []


def test_one_rank_reports_the_last_outcome_of_a_key_in_a_step():
    m = meta((PUBLISHED, K1), (REMOVED, K1), (FAILED, K2), (PUBLISHED, K2))
    assert m.fs_published == {K2: 1} and m.fs_removed == {K1: 1} and not m.fs_failed
