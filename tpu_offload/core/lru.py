"""Chunk LRU manager: the shared scheduler-side index for both backends.

Every operation is O(1) per key. Only chunks that are ready and unpinned sit
in the ``_evictable`` ordered dict (LRU first), so eviction never scans past
pinned or in-flight chunks, which is where peer managers go quadratic.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

from tpu_offload.core.keys import ChunkKey
from tpu_offload.core.manager import (
    ChunkEvent,
    ChunkManager,
    Lookup,
    Medium,
    StoreAllocation,
    TierStats,
)
from tpu_offload.core.slots import SlotAllocator


class _Entry:
    __slots__ = ("slot", "pins", "pending", "doomed")

    def __init__(self, slot: int):
        self.slot = slot
        self.pins = 0
        self.pending = True  # a write is in flight until complete_store
        self.doomed = False  # reset() dropped it while in use; freed on release


class LRUChunkManager(ChunkManager):
    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        medium: Medium = Medium.CPU,
        enable_events: bool = True,
        max_pending_events: int = 1 << 20,
    ):
        self.medium = medium
        self.chunk_bytes = chunk_bytes
        self._slots = SlotAllocator(num_chunks)
        self._index: dict[ChunkKey, _Entry] = {}
        self._evictable: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._num_pinned = 0
        self._num_pending = 0
        self._enable_events = enable_events
        self._events: collections.deque[ChunkEvent] = collections.deque(maxlen=max_pending_events)
        self.events_dropped = 0
        # Monotonic counters the metrics layer reads; never reset with the tier.
        self.evictions = 0
        self.allocation_failures = 0

    # ---- lookups -------------------------------------------------------
    def lookup(self, key: ChunkKey) -> Lookup:
        entry = self._index.get(key)
        if entry is None or entry.doomed:
            return Lookup.MISS
        return Lookup.PENDING if entry.pending else Lookup.HIT

    def slot_of(self, key: ChunkKey) -> int | None:
        """Slot of a ready chunk, for tiers that copy out of the host slab."""
        entry = self._index.get(key)
        if entry is None or entry.pending or entry.doomed:
            return None
        return entry.slot

    # ---- loads ---------------------------------------------------------
    def prepare_load(self, keys: Sequence[ChunkKey]) -> np.ndarray:
        for key in keys:
            if self.lookup(key) is not Lookup.HIT:
                raise KeyError(f"prepare_load of a chunk that is not ready: {key.hex()}")
        slots = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            entry = self._index[key]
            if entry.pins == 0:
                self._evictable.pop(key, None)
                self._num_pinned += 1
            entry.pins += 1
            slots[i] = entry.slot
        return slots

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            entry = self._index.get(key)
            if entry is None or entry.pins == 0:
                raise ValueError(f"complete_load of a chunk that is not pinned: {key.hex()}")
            entry.pins -= 1
            if entry.pins == 0:
                self._num_pinned -= 1
                self._release(key, entry)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        # Reverse, so the head of a prefix ends most recent: every longer
        # prefix needs it, so it is worth more than the tail.
        for key in reversed(list(keys)):
            if key in self._evictable:
                self._evictable.move_to_end(key)

    # ---- stores --------------------------------------------------------
    def prepare_store(self, keys: Sequence[ChunkKey]) -> StoreAllocation | None:
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._index))
        need = len(new_keys) - self._slots.free_count
        if need > 0:
            protected = [k for k in dict.fromkeys(keys) if k in self._evictable]
            if need > len(self._evictable) - len(protected):
                self.allocation_failures += 1
                return None
            evicted = self._evict(need, set(protected))
        else:
            evicted = []
        slots = self._slots.allocate(len(new_keys))
        for key, slot in zip(new_keys, slots):
            self._index[key] = _Entry(int(slot))
        self._num_pending += len(new_keys)
        return StoreAllocation(keys=new_keys, slots=slots, evicted=evicted)

    def complete_store(self, keys: Iterable[ChunkKey], success: bool = True) -> None:
        stored = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None or not entry.pending:
                raise ValueError(f"complete_store of a chunk with no write in flight: {key.hex()}")
            entry.pending = False
            self._num_pending -= 1
            if success and not entry.doomed:
                self._evictable[key] = None
                stored.append(key)
            else:
                self._drop(key, entry)
        if stored:
            self._emit(stored, removed=False)

    # ---- housekeeping --------------------------------------------------
    def take_events(self) -> list[ChunkEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def stats(self) -> TierStats:
        return TierStats(
            capacity_chunks=self._slots.num_slots,
            used_chunks=self._slots.num_slots - self._slots.free_count,
            pinned_chunks=self._num_pinned,
            pending_chunks=self._num_pending,
            chunk_bytes=self.chunk_bytes,
        )

    def reset(self) -> None:
        removed = []
        for key, entry in list(self._index.items()):
            if entry.doomed:
                continue
            if not entry.pending:
                removed.append(key)
            if entry.pins or entry.pending:
                entry.doomed = True
            else:
                self._drop(key, entry)
        self._evictable.clear()
        if removed:
            self._emit(removed, removed=True)

    def __len__(self) -> int:
        return len(self._index)

    def keys_lru_order(self) -> list[ChunkKey]:
        """Evictable keys, least recent first (for tests and snapshots)."""
        return list(self._evictable)

    # ---- internals -----------------------------------------------------
    def _evict(self, n: int, protected: set[ChunkKey]) -> list[ChunkKey]:
        evicted: list[ChunkKey] = []
        skipped: list[ChunkKey] = []
        while len(evicted) < n:
            key, _ = self._evictable.popitem(last=False)
            if key in protected:
                skipped.append(key)
                continue
            entry = self._index.pop(key)
            self._slots.free(entry.slot)
            evicted.append(key)
        for key in reversed(skipped):  # put protected keys back where they were
            self._evictable[key] = None
            self._evictable.move_to_end(key, last=False)
        self.evictions += len(evicted)
        self._emit(evicted, removed=True)
        return evicted

    def _release(self, key: ChunkKey, entry: _Entry) -> None:
        if entry.doomed:
            self._drop(key, entry)
        else:
            self._evictable[key] = None  # just used: most recent

    def _drop(self, key: ChunkKey, entry: _Entry) -> None:
        del self._index[key]
        self._evictable.pop(key, None)
        self._slots.free(entry.slot)

    def _emit(self, keys: list[ChunkKey], removed: bool) -> None:
        if not self._enable_events or not keys:
            return
        if len(self._events) == self._events.maxlen:
            self.events_dropped += 1
        self._events.append(ChunkEvent(keys=tuple(keys), medium=self.medium, removed=removed))
