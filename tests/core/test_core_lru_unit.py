"""LRUChunkManager by example, plus work counting for the O(1) claims.

Work is counted, not timed: keys are a bytes subclass whose ``__hash__``
counts calls, so every dict/set probe, insert, delete and ordered-dict step
on a key is one tick, whether the loop runs in Python or in C.
"""

from __future__ import annotations

import itertools

import pytest

from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Lookup


class CK(bytes):
    """A chunk key that counts how often it is hashed."""

    ticks = 0

    def __hash__(self):
        CK.ticks += 1
        return bytes.__hash__(self)


_ids = itertools.count()


def ck(n: int) -> list[CK]:
    return [CK(make_chunk_key(next(_ids).to_bytes(32, "big"))) for _ in range(n)]


def stored(mgr: LRUChunkManager, keys) -> None:
    alloc = mgr.prepare_store(keys)
    assert alloc is not None and alloc.keys == list(keys)
    mgr.complete_store(alloc.keys)


def ticks(fn, *args):
    before = CK.ticks
    fn(*args)
    return CK.ticks - before


# ---- order by example -----------------------------------------------------------


def test_lru_order_touch_unpin_evict():
    m = LRUChunkManager(3, 1)
    a, b, c, d = ck(4)
    stored(m, [a, b, c])
    assert m.keys_lru_order() == [a, b, c]
    m.touch([b, c])  # reversed: the head of the prefix ends most recent
    assert m.keys_lru_order() == [a, c, b]
    m.prepare_load([a])
    assert m.keys_lru_order() == [c, b] and m.lookup(a) is Lookup.HIT
    m.complete_load([a])  # unpin: most recent
    assert m.keys_lru_order() == [c, b, a]
    alloc = m.prepare_store([d])
    assert alloc.evicted == [c]
    assert m.take_events()[-1].keys == (c,)


def test_pinned_pending_and_same_call_keys_are_not_evicted():
    m = LRUChunkManager(3, 1)
    a, b, c, d, e = ck(5)
    stored(m, [a, b, c])
    m.prepare_load([a])
    alloc = m.prepare_store([b, d])  # b is offered again: protected; a is pinned
    assert alloc.keys == [d] and alloc.evicted == [c]
    # a pinned, d in flight, b offered in the same call: nothing may go
    assert m.prepare_store([b, e]) is None
    assert m.allocation_failures == 1 and m.stats().used_chunks == 3
    assert m.prepare_store([e]).evicted == [b]  # outside its own call b is fair game


def test_failed_store_vanishes_and_frees_its_slot():
    m = LRUChunkManager(2, 10)
    a, b = ck(2)
    alloc = m.prepare_store([a, b])
    assert m.lookup(a) is Lookup.PENDING
    with pytest.raises(KeyError):
        m.prepare_load([a])
    m.complete_store([a], success=False)
    m.complete_store([b])
    assert m.lookup(a) is Lookup.MISS and m.lookup(b) is Lookup.HIT
    assert m.stats().used_chunks == 1 and m.stats().used_bytes == 10
    assert [e.keys for e in m.take_events()] == [(b,)]
    assert m.prepare_store([a]).slots.tolist() == [int(alloc.slots[0])]  # the slot came back


def test_reset_drops_everything_in_flight_chunks_after_release():
    m = LRUChunkManager(4, 1)
    a, b, c, e = ck(4)
    stored(m, [a, b])
    m.prepare_load([b])
    m.prepare_store([c])  # write in flight
    m.take_events()
    m.reset()
    (ev,) = m.take_events()
    assert ev.removed and set(ev.keys) == {a, b}
    assert [m.lookup(k) for k in (a, b, c)] == [Lookup.MISS] * 3
    s = m.stats()
    assert (s.used_chunks, s.pinned_chunks, s.pending_chunks) == (2, 1, 1)  # b and c still hold slots
    alloc = m.prepare_store([b, c, e])
    assert alloc.keys == [e], "a slot still in use by a transfer cannot be reused yet"
    m.complete_load([b])
    m.complete_store([c], success=True)  # lands after the reset: dropped, not announced
    assert m.stats().used_chunks == 1 and m.lookup(c) is Lookup.MISS
    assert m.take_events() == []
    with pytest.raises(ValueError):
        m.complete_load([b])


def test_event_queue_is_bounded():
    m = LRUChunkManager(8, 1, max_pending_events=2)
    for k in ck(3):
        stored(m, [k])
    assert m.events_dropped == 1 and len(m.take_events()) == 2
    quiet = LRUChunkManager(2, 1, enable_events=False)
    stored(quiet, ck(2))
    assert quiet.take_events() == []


# ---- work counting --------------------------------------------------------------


def eviction_work(cls, pinned: int, kind: str = "pinned", evictions: int = 30, rest: int = 20) -> list[int]:
    """Ticks of each of ``evictions`` one-chunk stores into a full cache whose
    least recent end holds ``pinned`` chunks that cannot be evicted."""
    m = cls(pinned + rest, 1)
    held = ck(pinned)
    if kind == "pinned":
        stored(m, held)
        m.prepare_load(held)
    else:  # writes in flight
        m.prepare_store(held)
    stored(m, ck(rest))
    out = []
    for k in ck(evictions):
        out.append(ticks(lambda: stored(m, [k])))
    assert m.stats().used_chunks == pinned + rest
    return out


@pytest.mark.parametrize("kind", ["pinned", "pending"])
def test_eviction_does_not_rescan_unevictable_chunks(kind):
    small, big = eviction_work(LRUChunkManager, 10, kind), eviction_work(LRUChunkManager, 5000, kind)
    # After the first eviction, the work does not depend on how many are held at all.
    assert small[1:] == big[1:]
    assert max(big[1:]) <= 40
    # Each pinned chunk is met at most once, by the first eviction that reaches it
    # (it is then parked until unpinned); chunks in flight are never met at all.
    assert big[0] - small[0] <= (4 * (5000 - 10) if kind == "pinned" else 0)


class _RescanningManager(LRUChunkManager):
    """What peers do: walk from the LRU end past every unevictable chunk, every time."""

    def _evict(self, need, keys, protect):
        victims = [k for k in self._lru if k not in self._pins and k not in keys][:need]
        if len(victims) < need:
            return None
        self._free.extend(map(self._lru.pop, victims))
        self.evictions += need
        self._emit(victims, removed=True)
        return victims


def test_work_counter_catches_a_rescanning_manager():
    small, big = eviction_work(_RescanningManager, 10), eviction_work(_RescanningManager, 5000)
    assert sum(big) - sum(small) >= 30 * (5000 - 10), "the harness must see a per-eviction scan"


@pytest.mark.parametrize("size", [50, 5000])
def test_per_key_work_does_not_grow_with_the_cache(size):
    m = LRUChunkManager(size + 100, 1)
    stored(m, ck(size))
    req = ck(30)
    stored(m, req[:20])
    w = {
        "lookup_prefix": ticks(m.lookup_prefix, req),
        "touch": ticks(m.touch, req),
        "prepare_load": ticks(m.prepare_load, req[:20]),
        "complete_load": ticks(m.complete_load, req[:20]),
        "prepare_store": ticks(lambda: m.prepare_store(req[20:])),
        "complete_store": ticks(m.complete_store, req[20:]),
    }
    # a few hash operations per key, whatever the cache size
    assert w["lookup_prefix"] <= 21 and w["touch"] <= 2 * 30
    # complete_load: one more per key for its read-only check (a rejected call changes nothing)
    assert w["prepare_load"] <= 3 * 20 and w["complete_load"] <= 4 * 20
    assert w["prepare_store"] <= 4 * 10 and w["complete_store"] <= 3 * 10
    test_per_key_work_does_not_grow_with_the_cache.seen.setdefault(tuple(sorted(w.items())), size)
    assert len(test_per_key_work_does_not_grow_with_the_cache.seen) == 1, "work differs between cache sizes"


test_per_key_work_does_not_grow_with_the_cache.seen = {}
