"""The Triton kernel behind ``fused_gather``: every page of a piece, all KV tensors, one launch.

Grid ``(pages, tiles)``: program ``(i, j)`` copies words ``[j * TILE, (j + 1) * TILE)`` of page ``i``
(masked past the page's own size, so pages of different sizes share a launch). Both sides are
addressed from the staging half's pointer (typed in the transfer's word) plus a signed int64 word
offset: an engine tensor may lie below the staging buffer, and either may exceed 2 GiB. With
``VEC > 1`` every offset and length is a multiple of ``VEC`` words (16 bytes; ``PageAddresses.vec``
checks it), which lets Triton emit 16-byte loads and stores instead of one word per access.

Imported only when the fused gather is chosen; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_pages(stg_ptr, eng_off_ptr, stg_off_ptr, words_ptr, TO_STAGING: tl.constexpr, TILE: tl.constexpr,
                VEC: tl.constexpr):
    i = tl.program_id(0)
    n = tl.multiple_of(tl.load(words_ptr + i), VEC)  # int64 words of this page
    eng = tl.multiple_of(tl.load(eng_off_ptr + i), VEC)
    stg = tl.multiple_of(tl.load(stg_off_ptr + i), VEC)
    first = tl.program_id(1).to(tl.int64) * TILE
    offs = tl.max_contiguous(tl.multiple_of(first + tl.arange(0, TILE).to(tl.int64), TILE), TILE)
    mask = offs < n
    if TO_STAGING:
        tl.store(stg_ptr + stg + offs, tl.load(stg_ptr + eng + offs, mask=mask), mask=mask)
    else:
        tl.store(stg_ptr + eng + offs, tl.load(stg_ptr + stg + offs, mask=mask), mask=mask)


def launcher(tile_words: int, vec: int):
    """A function launching the kernel, ``tile_words`` words per program, ``vec`` words per access."""

    def launch(staging, eng, stg, words, max_words: int, to_staging: bool) -> None:
        n = eng.numel()
        if n == 0:
            return
        grid = (n, triton.cdiv(max_words, tile_words))
        _copy_pages[grid](staging, eng, stg, words, TO_STAGING=to_staging, TILE=tile_words, VEC=vec)

    return launch
