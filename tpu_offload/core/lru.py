"""Chunk LRU manager: the shared scheduler-side index for both backends.

The scheduler calls this for every request on every step, so its per-key
cost is engine overhead on the critical path. Hence:

* The common path of every call runs as bulk C-level container operations
  (``map``/``filter``/``takewhile`` over bound methods of long-lived dicts),
  never a Python loop per key; Python loops only run on rare paths (errors,
  reset leftovers, pinned chunks at the least recent end).
* State is a few flat dicts from chunk key to slot, one per state (ready,
  parked, write in flight), not an object per chunk: nothing per chunk for
  the garbage collector to walk.
* Pinning a chunk for a load costs no LRU-list operation: the chunk keeps
  its place in ``_lru`` and moves to the recent end when its last pin goes.
  Eviction takes victims from the least recent end; a pinned chunk it meets
  there is unlinked ("parked") once and relinked as most recent when its
  last pin goes. So eviction never rescans pinned chunks (peers do, every
  time) and every operation is O(1) amortized per key.
* Session leases (``core/leases.py``): eviction passes over leased chunks
  while an unleased one is left, and moves each it passed to the recent end,
  so the next eviction does not meet it again first; when only leased chunks
  are left, the least recent of them go. The check is one probe per victim.
"""

from __future__ import annotations

import collections
from itertools import compress, filterfalse, islice, repeat, takewhile
from operator import is_not, sub
from typing import Iterable, Sequence

import numpy as np

from tpu_offload.core.keys import ChunkKey
from tpu_offload.core.leases import LeaseTable
from tpu_offload.core.manager import (
    ChunkEvent,
    ChunkManager,
    Lookup,
    Medium,
    StoreAllocation,
    TierStats,
)

try:  # the C loop behind Counter.update, applied to a plain dict
    from collections import _count_elements
except ImportError:  # pragma: no cover - other Python implementations

    def _count_elements(mapping, iterable):
        for elem in iterable:
            mapping[elem] = mapping.get(elem, 0) + 1


_HIT, _PENDING, _MISS = Lookup.HIT, Lookup.PENDING, Lookup.MISS
_consume = collections.deque(maxlen=0).extend  # drains an iterator in C
_NONES = repeat(None)  # endless: zip/map stop at the shorter input
_ONES = repeat(1)
_ZEROS = repeat(0)
_is_one = (1).__eq__
_above_one = (1).__lt__


def _name(key) -> str:
    return key.hex() if isinstance(key, (bytes, bytearray)) else repr(key)


class LRUChunkManager(ChunkManager):
    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        medium: Medium = Medium.CPU,
        enable_events: bool = True,
        max_pending_events: int = 1 << 20,
        leases: LeaseTable | None = None,
    ):
        if num_chunks <= 0:
            raise ValueError(f"num_chunks must be > 0, got {num_chunks}")
        self.medium = medium
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        self._free: list[int] = list(range(num_chunks - 1, -1, -1))  # stack; slot 0 is handed out first
        # key -> slot, by state. Ready chunks sit in _lru, least recent first;
        # a pinned one keeps its place until eviction meets it, then it is
        # parked until its last unpin.
        self._lru: collections.OrderedDict[ChunkKey, int] = collections.OrderedDict()
        self._parked: dict[ChunkKey, int] = {}
        self._pending: dict[ChunkKey, int] = {}  # write in flight
        self._pins: dict[ChunkKey, int] = {}  # ready and pinned -> count
        # Dropped by reset() while a transfer still uses the slot: [slot, pins]
        # (pins -1: a write in flight). The slot is freed when it ends.
        self._doomed: dict[ChunkKey, list[int]] = {}
        self._doomed_pins = 0
        self._doomed_writes = 0
        self._enable_events = enable_events
        self._events: collections.deque[ChunkEvent] = collections.deque(maxlen=max_pending_events)
        self.events_dropped = 0
        # Monotonic counters the metrics layer reads; never reset with the tier.
        self.evictions = 0
        self.allocation_failures = 0
        # Session leases (None: off). Shared with the adapter, which leases and renews through it.
        self.leases = leases
        # Bound methods, made once: the hot paths map them over keys.
        self._in_lru = self._lru.__contains__
        self._in_pending = self._pending.__contains__
        self._lru_slot = self._lru.__getitem__
        self._move = self._lru.move_to_end

    # ---- lookups (no side effects) ---------------------------------------
    def lookup(self, key: ChunkKey) -> Lookup:
        if key in self._lru or key in self._parked:
            return _HIT
        return _PENDING if key in self._pending else _MISS

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        n = len(list(takewhile(self._in_lru, keys)))
        if self._parked:  # parked chunks are ready too
            parked, lru = self._parked, self._lru
            while n < len(keys) and (keys[n] in parked or keys[n] in lru):
                n += 1
        return n

    def slot_of(self, key: ChunkKey) -> int | None:
        """Slot of a ready chunk, for tiers that copy out of the host slab."""
        slot = self._lru.get(key)
        return self._parked.get(key) if slot is None else slot

    # ---- loads -------------------------------------------------------------
    def prepare_load(self, keys: Sequence[ChunkKey]) -> np.ndarray:
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        try:
            slots = list(map(self._lru_slot, keys))
        except KeyError:
            slots = self._ready_slots(keys)  # raises before any change
        _count_elements(self._pins, keys)  # +1 per occurrence
        return np.fromiter(slots, np.int64, len(slots))

    def _ready_slots(self, keys: Sequence[ChunkKey]) -> list[int]:
        out = []
        for key in keys:
            slot = self.slot_of(key)
            if slot is None:
                raise KeyError(f"prepare_load of a chunk that is not ready: {_name(key)}")
            out.append(slot)
        return out

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        pins = self._pins
        counts = list(map(pins.get, keys, _ZEROS))  # read-only: a rejected call changes nothing
        if 0 in counts or len(set(keys)) != len(keys):  # not pinned, given twice, or reset() dropped it
            return self._unpin_slow(keys)
        if counts.count(1) == len(keys):  # the last pin of each: the common case
            _consume(map(pins.__delitem__, keys))
            return self._release(keys)
        # some still pinned by other loads (shared prefixes)
        last = list(compress(keys, map(_is_one, counts)))
        pins.update(zip(compress(keys, map(_above_one, counts)), map(sub, filter(_above_one, counts), _ONES)))
        _consume(map(pins.__delitem__, last))
        self._release(last)

    def _release(self, keys: Sequence[ChunkKey]) -> None:
        """Last pin gone: most recent, in call order."""
        if self._parked:
            parked = self._parked
            back = [k for k in keys if k in parked]
            self._lru.update(zip(back, map(parked.pop, back)))
        _consume(map(self._move, keys))

    def _unpin_slow(self, keys: Sequence[ChunkKey]) -> None:
        pins, doomed = self._pins, self._doomed
        for key, n in collections.Counter(keys).items():  # all or nothing
            have = pins.get(key) or doomed.get(key, (0, 0))[1]
            if have < n:
                raise ValueError(f"complete_load of a chunk that is not pinned: {_name(key)}")
        for key in keys:
            n = pins.get(key)
            if n is not None:
                if n == 1:
                    del pins[key]
                    self._release((key,))
                else:
                    pins[key] = n - 1
            else:
                entry = doomed[key]
                entry[1] -= 1
                if entry[1] == 0:
                    del doomed[key]
                    self._doomed_pins -= 1
                    self._free.append(entry[0])

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        # Reverse, so the head of a prefix ends most recent: every longer
        # prefix needs it, so it is worth more than the tail.
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        _consume(map(self._move, filter(self._in_lru, reversed(keys))))

    # ---- stores --------------------------------------------------------------
    def prepare_store(self, keys: Sequence[ChunkKey]) -> StoreAllocation | None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        free = self._free
        new = list(filterfalse(self._in_pending, filterfalse(self._in_lru, keys)))
        if new and (self._parked or self._doomed):
            new = [k for k in new if k not in self._parked and k not in self._doomed]
        n = len(new)
        if n > 1 and len(set(new)) != n:  # a key offered twice
            new = list(dict.fromkeys(new))
            n = len(new)
        evicted: list[ChunkKey] = []
        if n > len(free):
            evicted = self._evict(n - len(free), keys, protect=n < len(keys))
            if evicted is None:
                self.allocation_failures += 1
                return None
        slots = free[: -n - 1 : -1]
        if n:
            del free[-n:]
            self._pending.update(zip(new, slots))
        return StoreAllocation(new, np.fromiter(slots, np.int64, n), evicted)

    def _evict(self, need: int, keys: Sequence[ChunkKey], protect: bool) -> list[ChunkKey] | None:
        """Free ``need`` slots from the LRU end, never evicting ``keys``; None if impossible."""
        lru, pins = self._lru, self._pins
        if need > len(lru) - (len(pins) - len(self._parked)):  # fewer unpinned ready chunks
            return None
        leases = self.leases
        if leases is not None:
            leases.expire()  # no clock read while no lease is held
            if not len(leases):
                leases = None
        victims = list(islice(lru, need))
        if (pins and not pins.keys().isdisjoint(victims)) or (protect and not set(keys).isdisjoint(victims)) \
                or (leases is not None and not leases.isdisjoint(victims)):
            victims = self._scan(need, set(keys) if protect else (), leases)
            if victims is None:
                return None
        self._free.extend(map(lru.pop, victims))
        if leases is not None:
            leases.drop(victims)
        self.evictions += need
        self._emit(victims, removed=True)
        return victims

    def _scan(self, need: int, protected, leases: LeaseTable | None = None) -> list[ChunkKey] | None:
        """Victims past pinned, protected and leased chunks; parks the pinned ones it meets.

        Leased chunks are victims only once no unleased one is left; those it
        passed over and kept move to the recent end (met once per pass)."""
        lru, pins = self._lru, self._pins
        leased = leases if leases is not None else ()
        victims, parked, held = [], [], []
        for key in lru:
            if key in pins:
                parked.append(key)
            elif key in protected:
                continue
            elif key in leased:
                held.append(key)
            else:
                victims.append(key)
                if len(victims) == need:
                    break
        self._parked.update(zip(parked, map(lru.pop, parked)))  # never scanned again while pinned
        if held:
            unleased = len(victims)
            if unleased < need:  # only leased chunks are left: the least recent of them go
                victims.extend(held[: need - unleased])
                del held[: need - unleased]
            if unleased and held:
                leases.honoured += len(held)
            _consume(map(self._move, held))
        return victims if len(victims) == need else None

    def discard(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Drop ready, unpinned chunks now (their slots are free again); returns the keys dropped.

        For chunks an adapter will never serve (a failed load): a later store
        of the key then gets a fresh slot and fresh bytes. Pinned, parked or
        in-flight chunks are left alone.
        """
        gone = [k for k in dict.fromkeys(keys) if k in self._lru and k not in self._pins]
        if gone:
            self._free.extend(map(self._lru.pop, gone))
            if self.leases is not None:
                self.leases.drop(gone)
            self._emit(gone, removed=True)
        return gone

    def complete_store(self, keys: Iterable[ChunkKey], success: bool = True) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        pending = self._pending
        before = len(pending)
        slots = list(map(pending.pop, keys, _NONES))  # None: no write in flight, or given twice
        if before - len(pending) != len(slots):  # undo, then report (or drop chunks reset() dropped)
            pending.update(compress(zip(keys, slots), map(is_not, slots, _NONES)))
            return self._complete_store_slow(keys, success)
        if success:
            self._lru.update(zip(keys, slots))  # appended: most recent
            self._emit(keys, removed=False)
        else:
            self._free.extend(slots)

    def _complete_store_slow(self, keys: Sequence[ChunkKey], success: bool) -> None:
        pending, doomed = self._pending, self._doomed
        seen: set[ChunkKey] = set()
        for key in keys:  # all or nothing
            if key in seen or (key not in pending and doomed.get(key, (0, 0))[1] != -1):
                raise ValueError(f"complete_store of a chunk with no write in flight: {_name(key)}")
            seen.add(key)
        stored = []
        for key in keys:
            if key in pending:
                slot = pending.pop(key)
                if success:
                    self._lru[key] = slot
                    stored.append(key)
                    continue
            else:  # reset() dropped it: it vanishes whatever the outcome
                slot = doomed.pop(key)[0]
                self._doomed_writes -= 1
            self._free.append(slot)
        self._emit(stored, removed=False)

    # ---- housekeeping --------------------------------------------------------
    def take_events(self) -> list[ChunkEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def stats(self) -> TierStats:
        return TierStats(
            capacity_chunks=self.num_chunks,
            used_chunks=self.num_chunks - len(self._free),
            pinned_chunks=len(self._pins) + self._doomed_pins,
            pending_chunks=len(self._pending) + self._doomed_writes,
            chunk_bytes=self.chunk_bytes,
            leased_chunks=len(self.leases) if self.leases is not None else 0,
        )

    def reset(self) -> None:
        lru, parked, pins, doomed = self._lru, self._parked, self._pins, self._doomed
        removed = [*lru, *parked]  # every ready chunk
        for key, n in pins.items():
            doomed[key] = [self.slot_of(key), n]
        for key, slot in self._pending.items():
            doomed[key] = [slot, -1]
        self._doomed_pins += len(pins)
        self._doomed_writes += len(self._pending)
        self._free.extend(slot for key, slot in lru.items() if key not in pins)
        lru.clear()
        parked.clear()
        pins.clear()
        self._pending.clear()
        if self.leases is not None:
            self.leases.clear()
        self._emit(removed, removed=True)

    def __len__(self) -> int:
        """Chunks holding a slot (ready, in flight, or dropped but still in use)."""
        return len(self._lru) + len(self._parked) + len(self._pending) + len(self._doomed)

    def keys_lru_order(self) -> list[ChunkKey]:
        """Evictable keys (ready, unpinned), least recent first."""
        return list(filterfalse(self._pins.__contains__, self._lru))

    def items_lru_order(self) -> list[tuple[ChunkKey, int]]:
        """Every ready chunk with its slot, least recent first (for snapshots).

        Pinned chunks are being loaded right now, so they count as the most
        recent; chunks whose write is in flight are not ready and are left out.
        """
        pins = self._pins
        items = [(k, s) for k, s in self._lru.items() if k not in pins]
        return items + [(k, self.slot_of(k)) for k in pins]

    def restore(self, items: Iterable[tuple[ChunkKey, int]]) -> int:
        """Refill an empty manager with ready chunks at given slots, least recent first.

        For a warm restart: the slots must match the bytes a host pool kept.
        Emits no events (no request payload survives a restart). Returns the count.
        """
        if len(self):
            raise ValueError("restore needs an empty manager")
        items = [(ChunkKey(bytes(k)), int(s)) for k, s in items]
        slots = {s for _, s in items}
        if len(slots) != len(items) or len({k for k, _ in items}) != len(items) \
                or any(not 0 <= s < self.num_chunks for s in slots):
            raise ValueError("restore: duplicate keys or slots, or a slot out of range")
        self._lru.update(items)
        self._free = [s for s in self._free if s not in slots]
        return len(items)

    # ---- internals -----------------------------------------------------------
    def _emit(self, keys: Sequence[ChunkKey], removed: bool) -> None:
        if not self._enable_events or not keys:
            return
        events = self._events
        if len(events) == events.maxlen:
            self.events_dropped += 1
        events.append(ChunkEvent(tuple(keys), self.medium, removed))
