"""Which chunks hold their sliding-window layers, and the ids an order carries per layer class.

In "window" mode (``connector/windows.py``) a store carries sliding-window
layers only for the chunks within ``tail_blocks`` of the end of what the
request can store at that step (and, with ``window_every_chunks``, before
every N-th chunk boundary); ``held`` records which chunks have them. A hit
ends only where every chunk of the tail before it has them, and its load
writes those layers only there.

Layer classes (``LoadOp.groups``): vLLM's KV-cache groups with its hybrid
manager (each its own block table), else [every layer, sliding-window
layers]; none when every layer moves every block.
"""

from __future__ import annotations

from typing import Callable

from tpu_offload.connector import compat
from tpu_offload.connector.settings import Settings
from tpu_offload.core.keys import ChunkKey


class Tails:
    def __init__(self, s: Settings):
        self.s = s
        self.bpc = s.blocks_per_chunk
        self.blocks = s.tail_blocks  # 0: every layer stores every block
        self.every = s.config.window_every_chunks  # also a tail before every N-th chunk boundary (0: none)
        self.held: dict[ChunkKey, bool] = {}  # chunks stored with their sliding-window layers

    def start(self, end: int) -> int:
        """First chunk whose sliding-window blocks a prefix of ``end`` chunks needs."""
        return max(0, end * self.bpc - self.blocks) // self.bpc

    def in_a_tail(self, c: int, end: int) -> bool:
        """Whether chunk ``c`` of a prefix stored up to ``end`` chunks keeps its sliding-window layers:
        it is in the tail before ``end``, or before a boundary every ``window_every_chunks``."""
        if c >= self.start(end):
            return True
        if not self.every:
            return False
        boundary = (c // self.every + 1) * self.every  # the first boundary after chunk c
        return boundary <= end and c >= self.start(boundary)

    def hit(self, keys: list[ChunkKey], n: int, on_fs: list[bool]) -> int:
        """The longest prefix (<= n chunks) whose tail chunks hold their sliding-window layers."""
        if not self.blocks:
            return n
        for m in range(n, 0, -1):
            if all(self.held.get(keys[c], False) and not on_fs[c] for c in range(self.start(m), m)):
                return m
        return 0

    def classes(self) -> range:
        """Layer classes an order carries ids for: none when every layer moves every block."""
        if self.s.hybrid:
            return range(len(self.s.group_windows))
        return range(2) if self.blocks else range(0)

    def chunk_ids(self, block_ids: tuple[list[int], ...], span, in_tail: bool) -> list[list[int]]:
        """One chunk's ids per layer class: full-attention layers every block, sliding-window
        layers only in the tail (and, with vLLM's hybrid manager, only blocks it has not freed)."""
        if not self.s.hybrid:
            ids = [block_ids[self.s.full_group][b] for b in span]
            return [ids, ids if in_tail else [-1] * len(ids)]
        out = []
        for g, window in enumerate(self.s.group_windows):
            table = block_ids[g]
            if window is None:
                out.append([table[b] for b in span])
            else:
                out.append([table[b] if in_tail and b < len(table) and table[b] != compat.NULL_BLOCK else -1
                            for b in span])
        return out

    def record(self, key: ChunkKey, per_class: list[list[int]]) -> None:
        """A store of ``key`` carries these ids: it holds its window if every sliding-window class moves."""
        windowed = [ids for g, ids in enumerate(per_class)
                    if (self.s.group_windows[g] is not None if self.s.hybrid else g == 1)]
        self.held[key] = bool(windowed) and all(b >= 0 for ids in windowed for b in ids)

    def prune(self, present: Callable[[ChunkKey], bool]) -> None:
        """Forget evicted chunks, so ``held`` stays bounded by the tier's size."""
        if len(self.held) > 2 * self.s.num_slots + 64:
            self.held = {k: v for k, v in self.held.items() if present(k)}
