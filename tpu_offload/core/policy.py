"""Host-tier store policy, and the exclusive policy's record of chunks held only in HBM.

``write_through`` copies every computed chunk to the host tier as soon as it
is complete, so the host tier mostly duplicates what the device's prefix
cache still holds. ``exclusive`` copies a chunk only when the engine is about
to reuse one of its device blocks for other content: the two tiers then cache
(almost) disjoint sets, and together hold close to the sum of their sizes.

``HbmWatch`` is that bookkeeping, engine-neutral: a chunk is watched with the
device block ids it lives in and each block's *tag* (what the engine's
prefix cache says the block holds: vLLM's block hash). When a block is handed
out again, its tag changes; the adapter asks ``check`` about the block ids it
saw handed out this step (before the forward that overwrites them) and gets
back the chunks that must be copied now or are lost. Nothing here touches
the engine: ``tag_of`` is the adapter's read-only view of it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Iterable

from tpu_offload.core.keys import ChunkKey

TagOf = Callable[[int], Any]  # block id -> what it holds now (None: nothing the prefix cache knows)


class StorePolicy(str, enum.Enum):
    WRITE_THROUGH = "write_through"
    EXCLUSIVE = "exclusive"


@dataclasses.dataclass(slots=True)
class Watched:
    key: ChunkKey
    blocks: tuple[int, ...]  # device block ids, every KV-cache group
    tags: tuple[Any, ...]  # aligned with ``blocks``
    payload: Any  # what the adapter needs to copy it later (block ids per group, request id, ...)


class HbmWatch:
    """Chunks that live only in device memory, indexed by the blocks that hold them.

    One chunk per block (a block holds one content); one entry per chunk (a
    second copy of the same chunk elsewhere in HBM is not watched: the first
    copy's eviction stores it, which is correct, merely early). Bounded by the
    device's block count: an entry leaves when its block is reused or the
    chunk is stored.
    """

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, Watched] = {}
        self._by_block: dict[int, ChunkKey] = {}
        self.lost = 0  # chunks whose blocks were reused before anyone could copy them

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def watch(self, key: ChunkKey, blocks: Iterable[int], tag_of: TagOf, payload: Any = None) -> bool:
        """Watch ``key`` in ``blocks``. False: some block is not in the prefix cache (store it now)."""
        ids = tuple(b for b in blocks if b > 0)  # <= 0: not stored (-1) or vLLM's null block (0)
        tags = tuple(map(tag_of, ids))
        if not ids or None in tags:
            return False
        old = self._chunks.get(key)
        if old is not None:
            if old.blocks == ids or self._intact(old, tag_of):
                return True  # already watched where it still lives
            self._drop(old)
        for b in ids:
            other = self._by_block.get(b)
            if other is not None and other != key:  # the block was reused unseen: that chunk is gone
                self._drop(self._chunks[other])
                self.lost += 1
            self._by_block[b] = key
        self._chunks[key] = Watched(key, ids, tags, payload)
        return True

    def check(self, handed_out: Iterable[int], tag_of: TagOf) -> list[Watched]:
        """The watched chunks one of whose blocks among ``handed_out`` no longer holds its tag.

        They stop being watched; the caller copies them before the next
        forward or counts them lost. Blocks handed out as prefix-cache hits
        keep their tags and change nothing.
        """
        out: list[Watched] = []
        by_block = self._by_block
        for b in handed_out:
            key = by_block.get(b)
            if key is None:
                continue
            w = self._chunks[key]
            if tag_of(b) != w.tags[w.blocks.index(b)]:
                self._drop(w)
                out.append(w)
        return out

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        for k in keys:
            w = self._chunks.get(k)
            if w is not None:
                self._drop(w)

    def clear(self) -> list[Watched]:
        """Forget everything (a cache reset: HBM's bytes are no longer wanted); returns what was watched."""
        out = list(self._chunks.values())
        self._chunks.clear()
        self._by_block.clear()
        return out

    def keys(self) -> list[ChunkKey]:
        return list(self._chunks)

    def _intact(self, w: Watched, tag_of: TagOf) -> bool:
        return all(tag_of(b) == t for b, t in zip(w.blocks, w.tags))

    def _drop(self, w: Watched) -> None:
        del self._chunks[w.key]
        for b in w.blocks:
            if self._by_block.get(b) == w.key:
                del self._by_block[b]

