"""Host chunk pool: one preallocated, byte-bounded slab of fixed-size slots.

The manager's slot numbers index this slab. Rows are page-aligned (4 KiB) so
file tiers can use O_DIRECT and CUDA can register the slab in large pieces.
Nothing here allocates after construction.

``valid`` is the worker's own truth about each slot: set only after a store
into the slot completed, cleared before the slot is overwritten or when a
transfer into it failed. vLLM 0.32 gives a worker no way to tell the
scheduler's manager that a store failed, so a load from a slot that is not
valid is reported as a load error (recomputed) instead of serving garbage.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class HostChunkPool:
    def __init__(self, num_slots: int, chunk_bytes: int, *, zero: bool = False):
        if num_slots <= 0 or chunk_bytes <= 0:
            raise ValueError(f"num_slots ({num_slots}) and chunk_bytes ({chunk_bytes}) must be > 0")
        self.num_slots = num_slots
        self.chunk_bytes = chunk_bytes
        self.stride = _round_up(chunk_bytes, PAGE)
        total = self.stride * num_slots
        raw = (np.zeros if zero else np.empty)(total + PAGE, dtype=np.uint8)
        offset = (-raw.ctypes.data) % PAGE
        self._raw = raw  # keeps the allocation alive
        self.slab = raw[offset : offset + total].reshape(num_slots, self.stride)
        self.valid = np.zeros(num_slots, dtype=bool)

    @classmethod
    def from_budget(cls, budget_bytes: int, chunk_bytes: int, **kw) -> "HostChunkPool":
        """As many slots as fit in ``budget_bytes`` (counting row padding)."""
        n = budget_bytes // _round_up(chunk_bytes, PAGE)
        if n < 1:
            raise ValueError(f"budget {budget_bytes} B holds no chunk of {chunk_bytes} B")
        return cls(n, chunk_bytes, **kw)

    @property
    def nbytes(self) -> int:
        return self.slab.nbytes

    def row(self, slot: int) -> np.ndarray:
        """The chunk's bytes (a view, without row padding)."""
        return self.slab[slot, : self.chunk_bytes]

    def rows(self, slots: np.ndarray) -> np.ndarray:
        return self.slab[slots, : self.chunk_bytes]
