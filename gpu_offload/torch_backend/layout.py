"""Byte layout of one host slot, and page views over slot-shaped row buffers.

A slot holds one chunk. Inside it, for each canonical KV tensor in order, the
chunk's ``blocks_per_chunk`` pages sit back to back::

    | t0: page0 page1 .. page(k-1) | t1: page0 .. page(k-1) | ... | pad |

Keeping a whole chunk in one slab row lets a file tier write a slot with one
``write`` and lets a device copy move consecutive slots with one memcpy. The
same layout is used for the device staging buffer, so staging rows and host
rows can be copied byte for byte.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class HostLayout:
    page_bytes: tuple[int, ...]  # per canonical tensor: bytes of one engine block
    offsets: tuple[int, ...]  # per canonical tensor: where its pages start in a slot
    blocks_per_chunk: int
    chunk_bytes: int  # sum of all pages of one chunk (no row padding)

    @classmethod
    def build(cls, page_bytes: Sequence[int], blocks_per_chunk: int) -> "HostLayout":
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if not page_bytes or min(page_bytes) <= 0:
            raise ValueError(f"page sizes must be positive, got {list(page_bytes)}")
        offsets, pos = [], 0
        for p in page_bytes:
            offsets.append(pos)
            pos += p * blocks_per_chunk
        return cls(tuple(int(p) for p in page_bytes), tuple(offsets), blocks_per_chunk, pos)

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    def tensor_span(self, t: int, first_sub: int, end_sub: int) -> tuple[int, int]:
        """Byte range inside a slot of tensor ``t``'s sub-blocks [first_sub, end_sub)."""
        p = self.page_bytes[t]
        return self.offsets[t] + first_sub * p, self.offsets[t] + end_sub * p


class PagedRows:
    """Per-tensor page views of a contiguous ``(rows, stride)`` int8 buffer.

    When the row stride is a multiple of a tensor's page size, the tensor's
    pages form one uniform 2-D view ``(n, page)`` and page (row r, sub j) is
    view row ``r * rows_per_slot + j``. That lets one ``index_select`` /
    ``index_copy_`` move any set of pages. Otherwise a 3-D view
    ``(rows, blocks_per_chunk, page)`` is used with advanced indexing.
    """

    def __init__(self, rows: torch.Tensor, layout: HostLayout):
        if rows.dim() != 2 or not rows.is_contiguous() or rows.dtype != torch.int8:
            raise ValueError("PagedRows needs a contiguous 2-D int8 tensor")
        if rows.shape[1] < layout.chunk_bytes:
            raise ValueError(f"row of {rows.shape[1]} B cannot hold a {layout.chunk_bytes} B chunk")
        self.rows = rows
        self.layout = layout
        self.stride = rows.shape[1]
        base = rows.reshape(-1)
        off0 = base.storage_offset()
        self.rows_per_slot: list[int | None] = []
        self._views: list[torch.Tensor] = []
        k = layout.blocks_per_chunk
        for p, o in zip(layout.page_bytes, layout.offsets):
            if self.stride % p == 0:
                n = (base.numel() - o) // p
                self._views.append(base.as_strided((n, p), (p, 1), off0 + o))
                self.rows_per_slot.append(self.stride // p)
            else:
                self._views.append(base.as_strided((rows.shape[0], k, p), (self.stride, p, 1), off0 + o))
                self.rows_per_slot.append(None)

    def is_uniform(self, t: int) -> bool:
        return self.rows_per_slot[t] is not None

    def view(self, t: int) -> torch.Tensor:
        """2-D ``(n, page)`` view if uniform, else 3-D ``(rows, k, page)``."""
        return self._views[t]
