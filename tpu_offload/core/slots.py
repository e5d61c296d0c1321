"""Slot allocator: a preallocated free stack of slot numbers, O(1) per slot.

Every slot has a free flag, so a double free (or freeing a slot never handed
out) raises instead of silently putting one slot on the stack twice, which
would later hand the same slot to two chunks.
"""

from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Hands out slot numbers of a fixed-size pool; never allocates after init."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = []
        self._is_free = bytearray(num_slots)
        self.reset()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        if n < 0 or n > len(self._free):
            raise MemoryError(f"asked for {n} slots, {len(self._free)} free")
        out = self._free[: -n - 1 : -1]  # the top n, last pushed first
        if n:
            del self._free[-n:]
        for s in out:
            self._is_free[s] = 0
        return np.array(out, dtype=np.int64)

    def allocate_one(self) -> int:
        if not self._free:
            raise MemoryError("no free slot")
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        if self._is_free[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)

    def reset(self) -> None:
        # Descending so the first allocations are slots 0, 1, 2, ... (easier to read in logs).
        self._free[:] = range(self.num_slots - 1, -1, -1)
        self._is_free[:] = b"\x01" * self.num_slots
