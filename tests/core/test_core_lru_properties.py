"""LRUChunkManager against a naive reference model under random operation sequences.

Checks, after every step: capacity never exceeded; exact stats in chunks and
bytes; lookups and slots agree with the model; the evictable order is the
model's LRU order; replaying the stored/removed events reproduces exactly
the set of ready keys (across resets too); live slots are distinct. Rules
check: pinned, pending and same-call keys are never evicted; lookups,
lookup_prefix and stats have no side effects; failed stores vanish; an
in-flight chunk is never loadable; errors change nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest
from core_model import ModelManager

from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Lookup, Medium

CHUNK_BYTES = 3 * 4096
KEYS = [make_chunk_key(bytes([i]) * 32, i % 2) for i in range(10)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
mostly_true = st.sampled_from([True, True, True, False])


def snapshot(mgr: LRUChunkManager):
    """Everything observable without draining events."""
    return (
        mgr.keys_lru_order(),
        mgr.items_lru_order(),
        mgr.stats(),
        [mgr.slot_of(k) for k in KEYS],
        len(mgr._events),
        mgr.evictions,
        mgr.allocation_failures,
        len(mgr),
    )


class ManagerMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 7), events=mostly_true)
    def init(self, capacity, events):
        self.mgr = LRUChunkManager(capacity, CHUNK_BYTES, enable_events=events)
        self.model = ModelManager(capacity)
        self.events = events
        self.replayed: set[bytes] = set()

    # ---- stores
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4), then=st.sampled_from(["complete", "complete", "fail", "leave"]))
    def prepare_store(self, keys, then):
        before_evictions = self.mgr.evictions
        evictable_before = set(self.model.lru)
        plan = self.model.plan_store(keys)
        if plan is None:
            snap = snapshot(self.mgr)
            assert self.mgr.prepare_store(keys) is None
            after = snapshot(self.mgr)
            assert after[:6] == snap[:6] and after[7] == snap[7]  # only the failure counter moved
            assert after[6] == snap[6] + 1
            return
        new, victims = plan
        live_slots = set(self.model.slot.values())
        alloc = self.mgr.prepare_store(keys)
        assert alloc is not None
        assert alloc.keys == new
        assert alloc.evicted == victims, "eviction must take the least recent evictable chunks, in order"
        assert set(alloc.evicted) <= evictable_before, "only ready, unpinned chunks are evicted"
        assert set(alloc.evicted).isdisjoint(keys), "keys of the same call are never evicted"
        assert alloc.slots.dtype.kind == "i" and len(alloc.slots) == len(new)
        slots = [int(s) for s in alloc.slots]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.model.capacity for s in slots)
        freed = {self.model.slot[k] for k in victims}
        assert set(slots).isdisjoint(live_slots - freed), "a slot still in use was handed out again"
        assert self.mgr.evictions - before_evictions == len(victims)
        self.model.store(new, victims, slots)
        if then != "leave" and new:
            assert self.mgr.lookup(new[0]) is Lookup.PENDING
            with pytest.raises(KeyError):
                self.mgr.prepare_load(new[:1])  # a write in flight is never loadable
            self.mgr.complete_store(new, success=then == "complete")
            self.model.complete_store(new, then == "complete")

    @precondition(lambda self: self.model.pending or -1 in self.model.doomed.values())
    @rule(data=st.data(), success=mostly_true)
    def complete_store(self, data, success):
        writes = sorted(self.model.pending | {k for k, p in self.model.doomed.items() if p == -1})
        keys = data.draw(st.lists(st.sampled_from(writes), unique=True, min_size=1))
        self.mgr.complete_store(keys, success=success)
        self.model.complete_store(keys, success)
        if not success:
            for k in keys:
                assert self.mgr.lookup(k) is Lookup.MISS, "a failed store must vanish"

    # ---- loads
    @precondition(lambda self: self.model.ready)
    @rule(data=st.data())
    def prepare_load(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model.ready)), min_size=1, max_size=5))
        slots = self.mgr.prepare_load(keys)
        assert slots.dtype.kind == "i"
        assert [int(s) for s in slots] == [self.model.slot[k] for k in keys]
        self.model.pin(keys)
        if data.draw(st.booleans()):  # the load finishes within the step
            self.mgr.complete_load(keys)
            self.model.unpin(keys)

    @precondition(lambda self: any(self.model.ready.values()) or any(p > 0 for p in self.model.doomed.values()))
    @rule(data=st.data())
    def complete_load(self, data):
        pinned = sorted([k for k, p in self.model.ready.items() if p] + [k for k, p in self.model.doomed.items() if p > 0])
        keys = data.draw(st.lists(st.sampled_from(pinned), unique=True, min_size=1))
        self.mgr.complete_load(keys)
        self.model.unpin(keys)

    # ---- rejected calls change nothing
    @rule(key=st.sampled_from(KEYS), op=st.sampled_from(["load", "complete_load", "complete_store"]), twice=st.booleans())
    def rejected(self, key, op, twice):
        m = self.model
        keys = [key, key] if twice else [key]
        if op == "load":  # not ready: pending (in flight), dropped by reset, or absent
            if key in m.ready:
                return
            err = KeyError
            call = lambda: self.mgr.prepare_load(keys)  # noqa: E731
        elif op == "complete_load":
            if m.ready.get(key, max(m.doomed.get(key, 0), 0)) >= len(keys):
                return
            err = ValueError
            call = lambda: self.mgr.complete_load(keys)  # noqa: E731
        else:
            if (key in m.pending or m.doomed.get(key) == -1) and not twice:
                return
            err = ValueError
            call = lambda: self.mgr.complete_store(keys, success=True)  # noqa: E731
        snap = snapshot(self.mgr)
        with pytest.raises(err):
            call()
        assert snapshot(self.mgr) == snap, f"a rejected {op} must change nothing"

    # ---- recency, reset
    @rule(data=st.data())
    def touch(self, data):
        pool = KEYS + 3 * list(self.model.ready)  # mostly chunks that are there
        keys = data.draw(st.lists(st.sampled_from(pool), max_size=6))
        self.mgr.touch(keys if data.draw(st.booleans()) else iter(keys))
        self.model.touch(keys)

    @rule(dice=st.integers(0, 7))
    def reset(self, dice):
        if dice != 7:  # rare, or nothing would ever fill up
            return
        self.model.reset()
        self.mgr.reset()

    # ---- queries have no side effects
    @rule(key=st.sampled_from(KEYS), keys=key_lists)
    def queries(self, key, keys):
        snap = snapshot(self.mgr)
        assert self.mgr.lookup(key) is self.model.lookup(key)
        assert self.mgr.lookup_prefix(keys) == self.model.lookup_prefix(keys)
        assert self.mgr.stats() == self.mgr.stats()
        assert snapshot(self.mgr) == snap

    # ---- invariants
    @invariant()
    def stats_exact(self):
        s, m = self.mgr.stats(), self.model
        assert s.capacity_chunks == m.capacity and s.capacity_bytes == m.capacity * CHUNK_BYTES
        assert s.used_chunks == m.used() <= m.capacity
        assert s.used_bytes == m.used() * CHUNK_BYTES
        assert s.pinned_chunks == m.pinned() and s.pinned_bytes == m.pinned() * CHUNK_BYTES
        assert s.pending_chunks == m.pending_count() and s.pending_bytes == m.pending_count() * CHUNK_BYTES
        assert len(self.mgr) == m.used()

    @invariant()
    def lookups_and_slots_agree(self):
        for k in KEYS:
            assert self.mgr.lookup(k) is self.model.lookup(k)
            assert self.mgr.slot_of(k) == (self.model.slot[k] if k in self.model.ready else None)
        live = list(self.model.slot.values())
        assert len(set(live)) == len(live)

    @invariant()
    def lru_order(self):
        assert self.mgr.keys_lru_order() == self.model.lru
        items = self.mgr.items_lru_order()
        assert [k for k, _ in items[: len(self.model.lru)]] == self.model.lru
        assert {k for k, _ in items} == set(self.model.ready)
        assert all(self.model.slot[k] == s for k, s in items)

    @invariant()
    def events_replay_to_ready_set(self):
        events = self.mgr.take_events()
        if not self.events:
            assert events == []
            return
        for ev in events:
            assert ev.medium is Medium.CPU and isinstance(ev.keys, tuple) and ev.keys
            if ev.removed:
                assert set(ev.keys) <= self.replayed, "removed a chunk never announced"
                self.replayed -= set(ev.keys)
            else:
                assert self.replayed.isdisjoint(ev.keys), "announced a chunk twice"
                self.replayed |= set(ev.keys)
        assert self.replayed == set(self.model.ready)


TestManagerProperties = ManagerMachine.TestCase
TestManagerProperties.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
