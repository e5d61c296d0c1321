"""The backend-neutral chunk manager interface both engines drive.

The scheduler side of every engine adapter talks only to this interface; the
worker side only sees slot numbers. Method contract (checked by property tests):

* ``lookup`` has no side effects: no pin, no recency change, no event.
* ``prepare_load`` pins ready chunks; ``complete_load`` unpins them.
* ``prepare_store`` allocates slots, evicting only ready, unpinned chunks that
  are not among the keys of the same call, and reports what it evicted.
* ``complete_store(success=False)`` makes the chunk vanish; a chunk whose write
  is in flight is never loadable.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Iterable, Sequence

import numpy as np

from tpu_offload.core.keys import ChunkKey


class Lookup(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # present, but its write is still in flight


class Medium(str, enum.Enum):
    CPU = "CPU"
    STORAGE = "STORAGE"


# Plain slotted dataclasses: built on the scheduler's hot path, where a
# frozen dataclass's __init__ (object.__setattr__ per field) costs ~1 us.
@dataclasses.dataclass(slots=True)
class ChunkEvent:
    keys: tuple[ChunkKey, ...]
    medium: Medium
    removed: bool


@dataclasses.dataclass(slots=True)
class StoreAllocation:
    """What ``prepare_store`` decided: which keys get which slots, what left."""

    keys: list[ChunkKey]
    slots: np.ndarray  # int64, aligned with ``keys``
    evicted: list[ChunkKey]


@dataclasses.dataclass(frozen=True)
class TierStats:
    capacity_chunks: int
    used_chunks: int
    pinned_chunks: int
    pending_chunks: int
    chunk_bytes: int
    leased_chunks: int = 0  # under a session lease (core/leases.py), stores still in flight included

    @property
    def leased_bytes(self) -> int:
        return self.leased_chunks * self.chunk_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_chunks * self.chunk_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.pinned_chunks * self.chunk_bytes

    @property
    def pending_bytes(self) -> int:
        return self.pending_chunks * self.chunk_bytes

    @property
    def usage(self) -> float:
        return self.used_chunks / self.capacity_chunks if self.capacity_chunks else 0.0


class ChunkManager(abc.ABC):
    """Scheduler-side index of one tier: keys → slots, with pins and LRU."""

    medium: Medium = Medium.CPU

    @abc.abstractmethod
    def lookup(self, key: ChunkKey) -> Lookup: ...

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading keys that are ready to load (no side effects)."""
        n = 0
        for key in keys:
            if self.lookup(key) is not Lookup.HIT:
                break
            n += 1
        return n

    @abc.abstractmethod
    def prepare_load(self, keys: Sequence[ChunkKey]) -> np.ndarray:
        """Pin ready chunks and return their slots. Raises KeyError on a non-hit."""

    @abc.abstractmethod
    def complete_load(self, keys: Iterable[ChunkKey]) -> None: ...

    @abc.abstractmethod
    def touch(self, keys: Iterable[ChunkKey]) -> None: ...

    @abc.abstractmethod
    def prepare_store(self, keys: Sequence[ChunkKey]) -> StoreAllocation | None:
        """Allocate slots for the absent keys; ``None`` if they cannot all fit."""

    @abc.abstractmethod
    def complete_store(self, keys: Iterable[ChunkKey], success: bool = True) -> None: ...

    @abc.abstractmethod
    def take_events(self) -> list[ChunkEvent]: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every chunk. In-flight chunks vanish once their transfer completes."""
