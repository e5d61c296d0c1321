"""The ways pages move between engine KV blocks and host slots, and between engine blocks.

``DirectCopier``: engine tensors and the host slab share a device (vLLM's CPU
platform). Runs of pages that are consecutive on both sides become one
memcpy each; scattered small pages go through one gather/scatter per tensor
instead of a Python loop per block.

``StagedCopier``: engine tensors on an accelerator. Pages are gathered on the
device into a staging buffer shaped like host slots (same layout and row
stride), so each run of consecutive host slots crosses the bus as one large
memcpy; partially covered chunks copy only the sub-block spans they own.
Loads copy whole rows in and scatter on the device. The gather (scatter) is
either a gather and a copy per KV tensor ("index") or, given ``make_mover``,
one launch for all tensors' pages of a piece ("fused", ``fused_gather``). The staging buffer is
split into ``buffers`` halves that take turns: while the bus moves one, the
device gathers (or scatters) the other, so the copy engine never waits for a
gather (``pipe`` orders them; on CUDA two streams and per-half events). A
transfer is cut into pieces of at most a half and at most ``piece_bytes``. Row
runs are also cut at multiples of ``piece_rows`` (the host slab's
registration pieces), so no memcpy straddles two registrations. The same code
runs on CPU tensors, which is how CI checks it.

``DevicePageCopier``: engine block to engine block, for chunks the engine's
own prefix cache holds (a load sourced from the device). CPU: numpy. On an
accelerator: per tensor, a gather into a scratch buffer allocated once and a
scatter, in pieces of at most the scratch's size.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from gpu_offload._log import get_logger
from gpu_offload.torch_backend import fused_gather
from gpu_offload.torch_backend.layout import HostLayout, PagedRows
from gpu_offload.torch_backend.plan import GroupPages, TransferPlan, piece_spans, runs

logger = get_logger(__name__)

# A run is copied with narrow() when it is long enough to beat a gather.
RUN_MIN_PAGES = 4
RUN_MIN_BYTES = 64 << 10


class DirectCopier:
    """CPU page copies done by numpy on views of the same memory.

    numpy, not torch: torch's CPU ``copy_`` runs an OpenMP parallel region per
    call, and when vLLM's CPU threads (bound to every core) are busy each
    region can wait a scheduler tick; measured here, 64 page copies took up
    to 600 ms under load against 10 ms for single-threaded memcpy.
    """

    def __init__(self, engine: list[torch.Tensor], host: PagedRows):
        self.layout = host.layout
        self.rows_per_slot = host.rows_per_slot
        self._eng = [t.numpy() for t in engine]
        self._host = [host.view(t).numpy() for t in range(self.layout.num_tensors)]

    def copy(self, plan: TransferPlan, to_host: bool) -> int:
        nbytes = 0
        for g in plan.groups:
            cache: dict[int, tuple] = {}
            for t in g.tensors:
                nbytes += self._copy_tensor(g, t, to_host, cache)
        return nbytes

    def _copy_tensor(self, g: GroupPages, t: int, to_host: bool, cache: dict) -> int:
        eng, view = self._eng[t], self._host[t]
        page = self.layout.page_bytes[t]
        rps = self.rows_per_slot[t]
        m = g.num_pages
        if rps is None:  # row stride not a multiple of this page size: 3-D view
            if to_host:
                view[g.slot, g.sub] = eng[g.gpu]
            else:
                eng[g.gpu] = view[g.slot, g.sub]
            return m * page
        if rps not in cache:
            rows = g.slot * rps + g.sub
            cache[rps] = (rows, *runs(g.gpu, rows))
        rows, starts, lengths = cache[rps]
        n_runs = len(starts)
        if n_runs * RUN_MIN_PAGES <= m or m * page >= n_runs * RUN_MIN_BYTES:
            for s, n in zip(starts.tolist(), lengths.tolist()):
                r, b = int(rows[s]), int(g.gpu[s])
                if to_host:
                    np.copyto(view[r : r + n], eng[b : b + n])
                else:
                    np.copyto(eng[b : b + n], view[r : r + n])
        elif to_host:
            view[rows] = eng[g.gpu]
        else:
            eng[g.gpu] = view[rows]
        return m * page


class SerialPipe:
    """Orders nothing: every step runs in call order (CPU, or one stream)."""

    def device(self, buf: int):
        return contextlib.nullcontext()

    bus = device

    def join(self) -> None:
        pass


class StagedCopier:
    def __init__(
        self,
        engine: list[torch.Tensor],
        host_rows: torch.Tensor,
        staging: PagedRows,
        upload: Callable[[np.ndarray], torch.Tensor],
        non_blocking: bool,
        piece_rows: int | None = None,
        buffers: int = 1,
        pipe=None,
        piece_bytes: int | None = None,
        make_mover: Callable | None = None,
    ):
        self.engine = engine
        self.host_rows = host_rows  # (num_slots, stride) int8 on the CPU
        self.layout: HostLayout = staging.layout
        rows = staging.rows.shape[0]
        self.buffers = max(1, min(buffers, rows))
        half = rows // self.buffers
        self.halves = [PagedRows(staging.rows[i * half:(i + 1) * half], self.layout)
                       for i in range(self.buffers)] if self.buffers > 1 else [staging]
        # Rows per piece: a staging half, at most ``piece_bytes`` (a transfer of a few large rows still
        # goes in several pieces, so its memcpys overlap its gathers).
        cap = half if piece_bytes is None else max(1, piece_bytes // staging.stride)
        self.capacity = min(half, cap)
        self.pipe = pipe or SerialPipe()
        self.upload = upload
        self.nb = non_blocking
        self.piece_rows = piece_rows
        self.row_copies: list[tuple[int, int]] | None = None  # tests: (first host row, rows) per memcpy
        self._all_tensors = tuple(range(self.layout.num_tensors))
        # Gathers and scatters move the widest words every page allows: an index kernel copies an
        # element per thread step, so int8 elements run it at a fraction of what int64 ones do.
        n = self.layout.num_tensors
        self.word, (self._eng, self._views) = _widest(
            lambda dt: ([e.view(dt) for e in engine], [[h.view(t).view(dt) for t in range(n)] for h in self.halves]))
        # Fused gather (``fused_gather``): one launch per piece for every tensor's pages, planned on the host.
        # ``make_mover(addresses)``: the mover, or None to keep the index path.
        self.addresses, self.mover = None, None
        if make_mover is not None:
            try:
                self.addresses = fused_gather.PageAddresses(engine, self.layout, staging.stride,
                                                            [h.rows.data_ptr() for h in self.halves])
            except ValueError as e:
                logger.warning("fused gather not possible (%s); using the per-tensor index gather", e)
            else:
                self.mover = make_mover(self.addresses)
                self._stg_words = [h.rows.view(-1).view(self.addresses.dtype) for h in self.halves]

    # ---- planning: one packed index upload per transfer ------------------------
    def _index_pieces(self, plan: TransferPlan):
        parts: list[np.ndarray] = []
        offset = 0

        def add(a: np.ndarray, align: int = 1) -> slice:
            nonlocal offset
            if offset % align:  # the fused kernel's arrays start 16-byte aligned: one compile, not eight
                parts.append(np.zeros(align - offset % align, np.int64))
                offset += align - offset % align
            parts.append(a)
            offset += len(a)
            return slice(offset - len(a), offset)

        pieces = []
        n_pos = len(plan.slots)
        for p0 in range(0, n_pos, self.capacity):
            p1 = min(p0 + self.capacity, n_pos)
            work = []
            for g in plan.groups:
                lo, hi = np.searchsorted(g.pos, (p0, p1))
                if lo == hi:
                    continue
                rel, sub = g.pos[lo:hi] - p0, g.sub[lo:hi]
                if self.mover is not None:  # one address list for the piece, below
                    work.append((g, int(lo), int(hi), (rel, sub)))
                    continue
                idx: dict = {"gpu": add(g.gpu[lo:hi])}
                for t in g.tensors:
                    rps = self.halves[0].rows_per_slot[t]
                    if rps not in idx:
                        idx[rps] = add(rel * rps + sub) if rps is not None else (add(rel), add(sub))
                work.append((g, int(lo), int(hi), idx))
            if self.mover is not None and work:
                half = len(pieces) % self.buffers  # the staging half this piece goes through (see copy)
                per = [self.addresses.pages(g.tensors, g.gpu[lo:hi], rel, sub, half)
                       for g, lo, hi, (rel, sub) in work]
                eng, stg, words = (np.concatenate(a) for a in zip(*per))
                pieces.append((p0, p1, work, (add(eng, 2), add(stg, 2), add(words, 2))))
            else:
                pieces.append((p0, p1, work, None))
        packed = self.upload(np.concatenate(parts)) if parts else None
        return pieces, packed

    # ---- the copy --------------------------------------------------------------
    def copy(self, plan: TransferPlan, to_host: bool) -> int:
        pieces, dev = self._index_pieces(plan)
        nbytes = 0
        for i, (p0, p1, work, fused) in enumerate(pieces):
            b = i % self.buffers
            stg, words = self.halves[b], self._views[b]
            if not to_host:
                with self.pipe.bus(b):
                    self._rows_from_host(plan, p0, work, stg)
            with self.pipe.device(b):
                if fused is None:
                    nbytes += self._move_indexed(work, dev, stg, words, to_host)
                else:
                    nbytes += self._move_fused(work, dev, fused, b, to_host)
            if to_host:
                with self.pipe.bus(b):
                    self._rows_to_host(plan, p0, work, stg)
        self.pipe.join()
        return nbytes

    def _move_indexed(self, work, dev: torch.Tensor, stg: PagedRows, words, to_host: bool) -> int:
        """Per tensor: a gather and a copy (two launches each)."""
        nbytes = 0
        for g, lo, hi, idx in work:
            gpu = dev[idx["gpu"]]
            rows = {r: (dev[ix[0]], dev[ix[1]]) if r is None else dev[ix]  # one slice per row stride
                    for r, ix in idx.items() if r != "gpu"}
            for t in g.tensors:
                rps = stg.rows_per_slot[t]
                nbytes += (hi - lo) * self.layout.page_bytes[t]
                self._move(words[t], t, gpu, rows[rps], rps, to_host)
        return nbytes

    def _move_fused(self, work, dev: torch.Tensor, fused, buf: int, to_host: bool) -> int:
        """Every tensor's pages of the piece in one launch of the mover."""
        e, s, w = fused
        self.mover(self._stg_words[buf], dev[e], dev[s], dev[w], self.addresses.max_words, to_host)
        return sum((hi - lo) * self.layout.page_bytes[t] for g, lo, hi, _ in work for t in g.tensors)

    def _move(self, view: torch.Tensor, t: int, gpu: torch.Tensor, rows, rps, to_host: bool) -> None:
        eng = self._eng[t]
        if rps is None:  # rows: (staging rows, sub-blocks)
            if to_host:
                view.index_put_(rows, eng.index_select(0, gpu))
            else:
                eng.index_copy_(0, gpu, view[rows])
        elif to_host:
            view.index_copy_(0, rows, eng.index_select(0, gpu))
        else:
            eng.index_copy_(0, gpu, view.index_select(0, rows))

    def _rows_from_host(self, plan: TransferPlan, p0: int, work, stg: PagedRows) -> None:
        """Whole rows in: bytes a load does not scatter are simply never read."""
        pos = np.concatenate([np.unique(g.pos[lo:hi]) for g, lo, hi, _ in work]) if work else []
        if len(pos) == 0:
            return
        slots = plan.slots[pos]
        for s, n in zip(*(x.tolist() for x in runs(pos, slots))):
            self._copy_rows(stg, int(pos[s]) - p0, int(slots[s]), n, to_host=False)

    def _rows_to_host(self, plan: TransferPlan, p0: int, work, stg: PagedRows) -> None:
        """Full chunks go out as whole rows; partial ones only as their own spans."""
        k = self.layout.blocks_per_chunk
        for g, lo, hi, _ in work:
            pos, first, count = np.unique(g.pos[lo:hi], return_index=True, return_counts=True)
            full = count == k if g.tensors == self._all_tensors else np.zeros(len(pos), bool)
            fpos = pos[full]
            if len(fpos):
                fslots = plan.slots[fpos]
                for s, n in zip(*(x.tolist() for x in runs(fpos, fslots))):
                    self._copy_rows(stg, int(fpos[s]) - p0, int(fslots[s]), n, to_host=True)
            for j in np.flatnonzero(~full).tolist():
                i, slot = int(pos[j]) - p0, int(plan.slots[pos[j]])
                j0 = int(g.sub[lo + first[j]])
                for t in g.tensors:
                    a, b = self.layout.tensor_span(t, j0, j0 + int(count[j]))
                    self.host_rows[slot, a:b].copy_(stg.rows[i, a:b], non_blocking=self.nb)

    def _copy_rows(self, stg: PagedRows, i0: int, s0: int, n: int, to_host: bool) -> None:
        """Staging rows [i0, i0+n) <-> host rows [s0, s0+n), one memcpy per registration piece."""
        for off, m in piece_spans(s0, n, self.piece_rows):
            host = self.host_rows[s0 + off : s0 + off + m]
            staged = stg.rows[i0 + off : i0 + off + m]
            if to_host:
                host.copy_(staged, non_blocking=self.nb)
            else:
                staged.copy_(host, non_blocking=self.nb)
            if self.row_copies is not None:
                self.row_copies.append((s0 + off, m))


SCRATCH_BYTES = 8 << 20


class DevicePageCopier:
    """Engine pages -> engine pages. ``upload``: index arrays to the device (None: numpy on CPU tensors)."""

    def __init__(self, engine: list[torch.Tensor], page_bytes,
                 upload: Callable[[np.ndarray], torch.Tensor] | None = None, scratch_bytes: int = SCRATCH_BYTES):
        self.engine = engine
        self.page_bytes = tuple(int(p) for p in page_bytes)
        self.upload = upload
        self.scratch_bytes = max(int(scratch_bytes), max(self.page_bytes))
        self.device_bytes = 0
        self._np = [t.numpy() for t in engine] if upload is None else None
        self._views = None  # (engine views, scratch views) in the widest word, made at the first copy

    def copy(self, pages) -> int:
        """``pages``: (tensor indices, source block ids, destination block ids) per KV group. Returns bytes."""
        nbytes = 0
        for tensors, src, dst in pages:
            if not len(src):
                continue
            for t in tensors:
                nbytes += len(src) * self.page_bytes[t]
                if self._np is not None:
                    self._np[t][dst] = self._np[t][src]  # fancy indexing reads all sources first
            if self._np is None:
                self._copy_indexed(tensors, src, dst)
        return nbytes

    def _copy_indexed(self, tensors, src: np.ndarray, dst: np.ndarray) -> None:
        if self._views is None:
            scratch = torch.empty(self.scratch_bytes, dtype=torch.int8, device=self.engine[0].device)
            self.device_bytes = scratch.numel()
            scr = [scratch[: (self.scratch_bytes // p) * p].view(-1, p) for p in self.page_bytes]
            self._views = _widest(lambda dt: ([e.view(dt) for e in self.engine], [x.view(dt) for x in scr]))[1]
        eng, scr = self._views
        n = len(src)
        idx = self.upload(np.concatenate([src, dst]).astype(np.int64))
        for t in tensors:
            rows = scr[t].shape[0]
            for a in range(0, n, rows):
                b = min(n, a + rows)
                buf = scr[t][: b - a]
                torch.index_select(eng[t], 0, idx[a:b], out=buf)
                eng[t].index_copy_(0, idx[n + a:n + b], buf)


def _widest(make: Callable[[torch.dtype], tuple]):
    """(dtype, make(dtype)) for the widest integer dtype every view of ``make`` accepts (int8 always does)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        try:
            return dt, make(dt)
        except RuntimeError:  # a page size, stride or offset not a multiple of the word
            continue
    return torch.int8, make(torch.int8)
