"""Page copies of every KV tensor of a piece as one list of (engine offset, staging offset, length).

The index path (``StagedCopier._move``) launches a gather and a copy per KV tensor per piece: with
64 layers that is 128 launches, enqueued from the one Python thread that also enqueues the other
direction's lane, so a store and a load submitted together wait on each other's enqueue time. The
fused path plans the piece's pages once, on the host, as flat int64 arrays, and moves them all with
one kernel launch (``fused_kernel``, Triton, imported only when chosen).

What the kernel computes, for each page ``i`` of a piece, in words of ``word`` bytes counted from
the start of the piece's staging half (``base``; an engine page may lie below it: offsets are signed)::

    engine  = (data_ptr(tensor t) + block * row_stride(t) - base) / word
    staging = (row * stride + offset(t) + sub * page(t)) / word
    copy words[i] words: engine -> staging (store) or staging -> engine (load)

Addresses relative to a pointer argument, not cast from integers, let Triton see their alignment:
when every address, stride and page is a multiple of 16 bytes (``vec``), it moves 16 bytes per
access. ``ReferenceMover`` does the same with one ``memmove`` per page on CPU memory; the engine's
CPU tests run the whole staged path through it and compare bytes with the index path. The kernel
only assumes what the canonical KV tensors guarantee: each engine block's page is contiguous
(``stride(1) == 1``) and starts ``stride(0)`` bytes after the previous one.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from gpu_offload._log import get_logger
from gpu_offload.torch_backend.layout import HostLayout

logger = get_logger(__name__)

GATHERS = ("auto", "index", "fused")
# "auto" picks the fused gather on CUDA from this many KV tensors up. Measured on an H200 (2026-11-28,
# gpu_transfer_cuda_fused*.json): with 64 tensors, a store and a load at once reach 0.78-0.86 of a
# two-stream memcpy fused against 0.57-0.65 indexed (one way equal within noise); with 8 tensors the
# two are within noise of each other (0.69-0.81 against 0.71-0.79), so the simpler path stays there.
FUSED_MIN_TENSORS = 32


def auto_gather(engine: Sequence[torch.Tensor]) -> str:
    """The gather "auto" means for these engine tensors: "fused" on CUDA from ``FUSED_MIN_TENSORS``
    tensors up (the per-tensor launches then cost more host time than the piece's memcpy), else "index"."""
    on_cuda = bool(engine) and engine[0].device.type == "cuda"
    return "fused" if on_cuda and len(engine) >= FUSED_MIN_TENSORS else "index"
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
# Grid rows per page are capped by CUDA's gridDim.y (65,535 tiles of TILE_BYTES: pages up to 512 MiB).
TILE_BYTES = 8 << 10
MAX_TILES = 65535


class PageAddresses:
    """Per-tensor engine base addresses and row strides, and the widest word every address allows.

    ``staging_bases``: the data pointers of the staging halves (their alignment limits the word too).
    Raises ValueError when an engine tensor's pages are not contiguous rows (the caller falls back).
    """

    def __init__(self, engine: Sequence[torch.Tensor], layout: HostLayout, stride: int,
                 staging_bases: Sequence[int]):
        for i, t in enumerate(engine):
            if t.dim() != 2 or t.element_size() != 1 or (t.shape[1] > 1 and t.stride(1) != 1):
                raise ValueError(f"engine tensor {i}: pages are not contiguous int8 rows "
                                 f"(shape {tuple(t.shape)}, strides {t.stride()})")
        self.layout = layout
        self.stride = int(stride)
        self.base = np.array([t.data_ptr() for t in engine], dtype=np.int64)
        self.row = np.array([t.stride(0) for t in engine], dtype=np.int64)
        self.page = np.array(layout.page_bytes, dtype=np.int64)
        self.offset = np.array(layout.offsets, dtype=np.int64)
        self.staging_bases = np.array([int(b) for b in staging_bases], dtype=np.int64)
        values = [*self.base.tolist(), *self.row.tolist(), *self.page.tolist(), *self.offset.tolist(),
                  self.stride, *self.staging_bases.tolist()]
        self.word = next(w for w in (8, 4, 2, 1) if all(v % w == 0 for v in values))
        self.vec = 16 // self.word if all(v % 16 == 0 for v in values) else 1  # words per 16-byte access
        self.dtype = WORD_DTYPES[self.word]
        self.max_words = int(self.page.max()) // self.word
        self.tile_words = max(1, TILE_BYTES // self.word)
        if -(-self.max_words // self.tile_words) > MAX_TILES:
            raise ValueError(f"a {int(self.page.max())} B page needs more than {MAX_TILES} tiles")

    def pages(self, tensors: Sequence[int], gpu: np.ndarray, rel: np.ndarray, sub: np.ndarray,
              half: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(engine offsets, staging offsets, lengths), in words from staging half ``half``'s start, of
        each (tensor, page), tensor-major. ``gpu``: engine block of each page; ``rel``: its row in the
        half; ``sub``: its sub-block in the chunk."""
        t = np.asarray(tensors, dtype=np.int64)[:, None]
        gpu, rel, sub = (np.asarray(a, dtype=np.int64)[None, :] for a in (gpu, rel, sub))
        eng = (self.base[t] - self.staging_bases[half] + gpu * self.row[t]) // self.word
        stg = (rel * self.stride + self.offset[t] + sub * self.page[t]) // self.word
        words = np.broadcast_to(self.page[t] // self.word, eng.shape)
        return eng.ravel(), stg.ravel(), words.ravel()


class ReferenceMover:
    """The kernel's work on CPU memory, one ``memmove`` per page (tests and the CPU staged path)."""

    def __init__(self, word: int):
        self.word = word

    def __call__(self, staging: torch.Tensor, eng: torch.Tensor, stg: torch.Tensor, words: torch.Tensor,
                 max_words: int, to_staging: bool) -> None:
        base, w = staging.data_ptr(), self.word
        for e, s, n in zip(eng.tolist(), stg.tolist(), words.tolist()):
            src, dst = (base + e * w, base + s * w) if to_staging else (base + s * w, base + e * w)
            ctypes.memmove(dst, src, n * w)


class TritonMover:
    """One Triton launch per piece on the current stream (the lane stream inside ``CudaPipe.device``)."""

    def __init__(self, tile_words: int, vec: int):
        from gpu_offload.torch_backend import fused_kernel  # Triton: imported only when chosen

        self._launch = fused_kernel.launcher(tile_words, vec)

    def __call__(self, staging, eng, stg, words, max_words: int, to_staging: bool) -> None:
        self._launch(staging, eng, stg, words, max_words, to_staging)


def make_mover(addresses: PageAddresses, device: torch.device):
    """The fused mover for ``device``, or None (with a warning) when it cannot run there.

    On CUDA the kernel is compiled and checked here, on a few bytes both ways (a host sync, once per
    lane): a Triton that is missing, fails to compile or copies wrong bytes leaves the index path in
    place instead of failing every transfer.
    """
    if device.type != "cuda":
        return ReferenceMover(addresses.word)
    try:
        mover = TritonMover(addresses.tile_words, addresses.vec)
        self_test(mover, device, addresses.dtype, addresses.tile_words, addresses.vec)
    except Exception as e:  # ImportError, a compile error, a CUDA error: all mean "not here"
        logger.warning("fused gather unavailable (%r); using the per-tensor index gather", e)
        return None
    return mover


def self_test(mover, device: torch.device, dtype: torch.dtype, tile_words: int, vec: int) -> None:
    """Two pages (one longer than a tile, one shorter) to a staging buffer and back; raises if wrong.

    Same word, tile and alignment as the real transfers, so it compiles exactly their kernels."""
    page = (tile_words + 3 * vec)  # words
    src = torch.randint(-100, 100, (2, page), device=device).to(dtype)
    stg = torch.zeros(2 * page + 2 * vec, dtype=dtype, device=device)
    back = torch.zeros_like(src)
    word = src.element_size()
    sizes = [page, vec]
    words = torch.tensor(sizes, dtype=torch.int64, device=device)
    off = torch.tensor([0, page + 2 * vec], dtype=torch.int64, device=device)

    def rel(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([(x[0].data_ptr() - stg.data_ptr()) // word, (x[1].data_ptr() - stg.data_ptr()) // word],
                            dtype=torch.int64, device=device)

    mover(stg, rel(src), off, words, page, True)
    mover(stg, rel(back), off, words, page, False)
    want = src.clone()
    want[1, sizes[1]:] = 0
    if not torch.equal(back, want):
        raise RuntimeError("fused gather self-test copied wrong bytes")
