"""Turn a (GPU spec, host slots) pair into page-level index arrays.

vLLM describes a transfer as engine block ids per KV group plus, per group,
the logical index of the first block (``block_indices``) and, on the host
side, one slot per touched chunk. With ``blocks_per_chunk = k`` the first
chunk of a group may be entered mid-way: its first ``block_indices[g] % k``
sub-blocks are skipped, and the last chunk may be ragged. Page ``i`` of group
``g`` therefore lands in slot position ``(skip + i) // k``, sub-block
``(skip + i) % k``; this is the same convention vLLM's CPU worker uses.

All arrays live in one preallocated buffer that is reused by the next plan,
so callers consume a plan before planning again.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class GroupPages:
    tensors: tuple[int, ...]  # canonical tensors this KV group lives in
    gpu: np.ndarray  # int64 engine block id of each page
    pos: np.ndarray  # int64 index into the transfer's slot list (non-decreasing)
    slot: np.ndarray  # int64 host slot of each page
    sub: np.ndarray  # int64 sub-block of each page inside its chunk
    index: int = 0  # the KV group's position in the spec

    @property
    def num_pages(self) -> int:
        return len(self.gpu)

    def select(self, mask: np.ndarray) -> "GroupPages":
        """A copy holding only the masked pages (error paths only)."""
        return GroupPages(self.tensors, self.gpu[mask], self.pos[mask], self.slot[mask], self.sub[mask], self.index)


@dataclasses.dataclass
class TransferPlan:
    groups: list[GroupPages]
    slots: np.ndarray  # int64 host slots, in spec order

    @property
    def num_pages(self) -> int:
        return sum(g.num_pages for g in self.groups)

    def gpu_blocks(self) -> list[int]:
        return [int(b) for g in self.groups for b in g.gpu]


class TransferPlanner:
    def __init__(
        self,
        blocks_per_chunk: int,
        group_tensors: Sequence[tuple[int, ...]],
        num_engine_blocks: int,
        num_slots: int,
    ):
        self.k = blocks_per_chunk
        self.group_tensors = [tuple(g) for g in group_tensors]
        self.num_engine_blocks = num_engine_blocks
        self.num_slots = num_slots
        self._grow(max(num_engine_blocks, 1))

    def _grow(self, n: int) -> None:
        self._buf = np.empty((4, n), dtype=np.int64)  # gpu, pos, slot, sub
        self._arange = np.arange(n, dtype=np.int64)
        self._slots = np.empty(n, dtype=np.int64)

    def plan(self, block_ids, group_sizes, block_indices, slots) -> TransferPlan:
        """Raise ValueError on any inconsistency; the caller turns it into a failed job."""
        block_ids = np.asarray(block_ids)
        slots_in = np.asarray(slots)
        if len(group_sizes) != len(self.group_tensors) or len(block_indices) != len(group_sizes):
            raise ValueError(
                f"spec has {len(group_sizes)} group sizes / {len(block_indices)} block indices, "
                f"engine has {len(self.group_tensors)} offloaded KV groups"
            )
        total = len(block_ids)
        if sum(int(s) for s in group_sizes) != total:
            raise ValueError(f"group sizes {list(group_sizes)} do not sum to {total} blocks")
        if total > self._buf.shape[1] or len(slots_in) > len(self._slots):
            self._grow(max(total, len(slots_in), 2 * self._buf.shape[1]))
        if total and (block_ids.min() < 0 or block_ids.max() >= self.num_engine_blocks):
            raise ValueError(f"engine block id out of range [0, {self.num_engine_blocks})")
        if len(slots_in) and (slots_in.min() < 0 or slots_in.max() >= self.num_slots):
            raise ValueError(f"host slot out of range [0, {self.num_slots})")
        slots_all = self._slots[: len(slots_in)]
        slots_all[:] = slots_in
        gpu_all, pos_all, slot_all, sub_all = self._buf
        groups: list[GroupPages] = []
        b_off = s_off = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
            n = int(size)
            if n == 0:
                continue
            skip = int(first) % self.k
            n_slots = -(-(skip + n) // self.k)
            if s_off + n_slots > len(slots_all):
                raise ValueError(f"group {g} needs {n_slots} slots, only {len(slots_all) - s_off} left")
            sl = slice(b_off, b_off + n)
            gpu, pos, slot, sub = gpu_all[sl], pos_all[sl], slot_all[sl], sub_all[sl]
            gpu[:] = block_ids[sl]
            np.add(self._arange[:n], skip, out=sub)
            np.floor_divide(sub, self.k, out=pos)
            pos += s_off
            np.remainder(sub, self.k, out=sub)
            np.take(slots_all, pos, out=slot)
            groups.append(GroupPages(self.group_tensors[g], gpu, pos, slot, sub, g))
            b_off += n
            s_off += n_slots
        if s_off != len(slots_all):
            raise ValueError(f"spec has {len(slots_all)} slots, its blocks use {s_off}")
        return TransferPlan(groups, slots_all)


def runs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of maximal runs where ``a`` and ``b`` both step by +1."""
    n = len(a)
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return starts, lengths


def piece_spans(start: int, n: int, piece: int | None):
    """Cut rows ``[start, start + n)`` at multiples of ``piece``: (offset, length)
    pairs, offsets relative to ``start``. ``piece`` None: one span."""
    if piece is None or n <= 0:
        if n > 0:
            yield 0, n
        return
    off = 0
    while off < n:
        m = min(n - off, piece - (start + off) % piece)
        yield off, m
        off += m
