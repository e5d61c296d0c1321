"""Slot allocator: a preallocated free stack of slot numbers, O(1) per slot."""

from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Hands out slot numbers of a fixed-size pool; never allocates after init."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        # Descending so the first allocations are slots 0, 1, 2, … (easier to read in logs).
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots  # number of free slots; the stack is _free[:_top]

    @property
    def free_count(self) -> int:
        return self._top

    def allocate(self, n: int) -> np.ndarray:
        if n > self._top:
            raise MemoryError(f"asked for {n} slots, {self._top} free")
        self._top -= n
        return self._free[self._top : self._top + n][::-1].copy()

    def allocate_one(self) -> int:
        if self._top == 0:
            raise MemoryError("no free slot")
        self._top -= 1
        return int(self._free[self._top])

    def free(self, slot: int) -> None:
        if self._top >= self.num_slots:
            raise ValueError(f"double free of slot {slot}: every slot is already free")
        self._free[self._top] = slot
        self._top += 1

    def reset(self) -> None:
        self._free[:] = np.arange(self.num_slots - 1, -1, -1, dtype=np.int64)
        self._top = self.num_slots
