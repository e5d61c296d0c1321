"""The Triton kernel behind ``fused_gather``: every page of a piece, all KV tensors, one launch.

Grid ``(pages, tiles)``: program ``(i, j)`` copies words ``[j * TILE, (j + 1) * TILE)`` of page ``i``
(masked past the page's own size, so pages of different sizes share a launch). Engine addresses are
absolute byte addresses (``data_ptr``) cast to a pointer of the word type; staging addresses are a
base address plus a byte offset. All offsets are int64: a staging half and an engine tensor can both
exceed 2 GiB. Every address is a multiple of the word (``PageAddresses.word`` checks it).

Imported only when the fused gather is chosen; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


# ``staging_base`` differs per staging half: not specializing on its alignment keeps one compile per
# direction (the descriptor arrays are 16-byte aligned by ``StagedCopier``, so they never vary).
@triton.jit(do_not_specialize=["staging_base"])
def _copy_pages(eng_ptr, stg_off_ptr, words_ptr, staging_base, TO_STAGING: tl.constexpr,
                WORD: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0)
    n = tl.load(words_ptr + i)  # int64: words of this page
    first = tl.program_id(1).to(tl.int64) * TILE
    offs = first + tl.arange(0, TILE).to(tl.int64)
    mask = offs < n
    eng = tl.load(eng_ptr + i).to(tl.pointer_type(WORD))
    stg = (tl.load(stg_off_ptr + i) + staging_base).to(tl.pointer_type(WORD))
    if TO_STAGING:
        tl.store(stg + offs, tl.load(eng + offs, mask=mask), mask=mask)
    else:
        tl.store(eng + offs, tl.load(stg + offs, mask=mask), mask=mask)


def launcher(word: int, tile_words: int):
    """A function launching the kernel for ``word``-byte words, ``tile_words`` words per program."""
    dtype = _WORDS[word]

    def launch(eng, stg, words, max_words: int, staging_base: int, to_staging: bool) -> None:
        n = eng.numel()
        if n == 0:
            return
        grid = (n, triton.cdiv(max_words, tile_words))
        _copy_pages[grid](eng, stg, words, staging_base, TO_STAGING=to_staging, WORD=dtype, TILE=tile_words)

    return launch
