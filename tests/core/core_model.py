"""A deliberately naive reference model of the chunk manager contract.

Plain lists and dicts, no cleverness, so that it is obviously right; the
property tests drive it and ``LRUChunkManager`` side by side.
"""

from __future__ import annotations

from tpu_offload.core.manager import Lookup


class ModelManager:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ready: dict[bytes, int] = {}  # key -> pins
        self.lru: list[bytes] = []  # ready and unpinned, least recent first
        self.pending: set[bytes] = set()
        self.doomed: dict[bytes, int] = {}  # dropped by reset: pins, or -1 for a write in flight
        self.slot: dict[bytes, int] = {}  # every key holding a slot

    # ---- queries
    def lookup(self, key) -> Lookup:
        if key in self.ready:
            return Lookup.HIT
        return Lookup.PENDING if key in self.pending else Lookup.MISS

    def lookup_prefix(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.ready:
            n += 1
        return n

    def used(self) -> int:
        return len(self.slot)

    def pinned(self) -> int:
        return sum(1 for p in self.ready.values() if p) + sum(1 for p in self.doomed.values() if p > 0)

    def pending_count(self) -> int:
        return len(self.pending) + sum(1 for p in self.doomed.values() if p == -1)

    def holds(self, key) -> bool:
        return key in self.slot

    # ---- transitions (the caller checks preconditions)
    def pin(self, keys) -> None:
        for k in keys:
            if self.ready[k] == 0:
                self.lru.remove(k)
            self.ready[k] += 1

    def unpin(self, keys) -> list[int]:
        freed = []
        for k in keys:
            if k in self.ready:
                self.ready[k] -= 1
                if self.ready[k] == 0:
                    self.lru.append(k)
            else:
                self.doomed[k] -= 1
                if self.doomed[k] == 0:
                    del self.doomed[k]
                    freed.append(self.slot.pop(k))
        return freed

    def touch(self, keys) -> None:
        for k in reversed(list(keys)):
            if k in self.lru:
                self.lru.remove(k)
                self.lru.append(k)

    def plan_store(self, keys):
        """(new keys, victims) or None if they cannot all fit."""
        new = list(dict.fromkeys(k for k in keys if not self.holds(k)))
        need = len(new) - (self.capacity - self.used())
        victims: list[bytes] = []
        if need > 0:
            offered = set(keys)
            candidates = [k for k in self.lru if k not in offered]
            if len(candidates) < need:
                return None
            victims = candidates[:need]
        return new, victims

    def store(self, new, victims, slots) -> None:
        for k in victims:
            self.lru.remove(k)
            del self.ready[k]
            del self.slot[k]
        for k, s in zip(new, slots):
            self.pending.add(k)
            self.slot[k] = int(s)

    def complete_store(self, keys, success: bool) -> None:
        for k in keys:
            if k in self.pending:
                self.pending.discard(k)
                if success:
                    self.ready[k] = 0
                    self.lru.append(k)
                    continue
            else:
                del self.doomed[k]
            del self.slot[k]

    def reset(self) -> list[bytes]:
        removed = list(self.ready)
        for k, pins in self.ready.items():
            if pins:
                self.doomed[k] = pins
            else:
                del self.slot[k]
        for k in self.pending:
            self.doomed[k] = -1
        self.ready.clear()
        self.lru.clear()
        self.pending.clear()
        return removed
