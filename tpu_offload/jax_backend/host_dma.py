"""The staging path's host copies as DMAs: staging <-> host slab, one Pallas kernel per (layer group, call).

The staging path (gather caches -> HBM staging -> host slab, and back) stays
where the direct kernel cannot serve a layout: replicated KV heads and MLA's
copies (the scatter's ring rebuilds whole blocks from every replica's slice,
a collective). Its host copies are the same kind of kernel as the direct
one (direct_dma.py): the slab typed ``uint8 (rows, tiles, 32, 128)`` (the
4 KiB host tile libtpu accepts at a dynamic offset), staging viewed the same
way inside the kernel (``ref.bitcast(uint8)``, reshaped to one row of tiles
per chunk), one DMA per run of consecutive staging chunks into consecutive
slab rows, every DMA started before any wait, the slab (the one host output
of a store) aliased in place, staging (a load's output) aliased in place.
A host copy then reads and writes what it moves once: no TensorCore copy, no
loop, no HBM scratch. A store pass costs gather 2x + host copy 1x of HBM
traffic, a load host copy 1x + scatter 2x.

The loop programs (``Programs._build_store``/``_build_load``: one
asynchronous copy per chunk, which the TPU compiler lowers to a TensorCore
copy fusion and a host ``dynamic-update-slice`` per trip) stay where this
kernel cannot run (``supported`` says why): off TPU (interpret mode cannot
run the ref bitcast), under attention-DP ranks (a slab's rows split over the
ranks and a load from another rank's rows crosses a ring: ranks.py), and
where a block's piece of one layer has no 4 KiB-tile view
(``direct_dma.why_not_viewable``: not whole tiles, or a minor dimension
other than the tile's 128 lanes, as MLA's latent (4, 4, 640) piece).

Staging holds per device ``(blocks, layers, *piece)``; a slab row holds one
chunk: ``blocks_per_chunk`` blocks, each every layer of the group, each layer
its piece as 4 KiB tiles: the same row width and sharding as the direct
path's slab (``direct_dma.tiled_slab_aval``), so a tier's slabs have one
type whichever of the two kernels fills them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_offload.jax_backend import dma, direct_dma

N_SCALARS = 4  # run count (1,), staging chunk starts, slab row starts, lengths


def supported(layout, platform: str | None = None) -> str | None:
    """Why the staging path's host copies cannot be DMA kernels for ``layout`` (None: they can)."""
    platform = platform or layout.program_mesh.devices.flat[0].platform
    if platform != "tpu":
        return f"the host-copy kernel runs on TPU only, not {platform} (interpret mode cannot run its u8 view)"
    if layout.ranks > 1:
        return ("attention-DP ranks: a slab's rows split over the ranks and a load from another rank's rows "
                "crosses their ring (ranks.py)")
    for g in layout.groups:
        why = direct_dma.why_not_viewable(g.piece_shape, g.dtype, lanes=True)
        if why is not None:
            return why
    return None


def chunk_tiles(g, blocks_per_chunk: int) -> int:
    """4 KiB tiles of one device's share of one chunk (a slab row): every block, every layer of ``g``."""
    return blocks_per_chunk * len(g.layers) * direct_dma.tiles_per_block(g.piece_shape, g.dtype)


def _staging_view(ref, blocks_per_chunk: int, tiles: int):
    """A staging ref ``(blocks, layers, *piece)`` as u8 tiles, one row per chunk: ``(chunks, tiles, 32, 128)``."""
    if np.dtype(ref.dtype) != np.uint8:
        ref = ref.bitcast(jnp.uint8)
    return ref.reshape(ref.shape[0] // blocks_per_chunk, tiles, *direct_dma.TILE)


def run_operands(chunks, rows, capacity: int) -> tuple[np.ndarray, ...]:
    """The kernel's scalar operands for moves ``staging chunk chunks[i] <-> slab row rows[i]``: runs where
    both are consecutive, padded to ``capacity``: (count (1,), chunk starts, row starts, lengths)."""
    return dma.run_operands(dma.coalesce(chunks, rows), capacity)


def store_call(blocks_per_chunk: int, tiles: int, slab_shape, platform: str = "tpu"):
    """``(n, chunk, row, length, staging, slab) -> slab``: for every run i < n[0], staging chunks
    ``chunk[i] : chunk[i] + length[i]`` into slab rows ``row[i] : ...``, one DMA each, all started before
    any wait; the slab (the one host output) aliased in place."""

    def kernel(n_ref, chunk_ref, row_ref, len_ref, staging, _slab_in, slab, sem):
        view = _staging_view(staging, blocks_per_chunk, tiles)

        def copy(i, _):
            return pltpu.make_async_copy(view.at[pl.ds(chunk_ref[i], len_ref[i])],
                                         slab.at[pl.ds(row_ref[i], len_ref[i])], sem.at[0])

        dma.start_then_wait(n_ref, 1, copy)

    return _call(kernel, jax.ShapeDtypeStruct(slab_shape, jnp.uint8), pl.BlockSpec(memory_space=pl.HOST),
                 [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.HOST)], {N_SCALARS + 1: 0},
                 platform)


def load_call(blocks_per_chunk: int, tiles: int, staging_shape, dtype, platform: str = "tpu"):
    """``(n, chunk, row, length, slab, staging) -> staging``: for every run i < n[0], slab rows
    ``row[i] : row[i] + length[i]`` into staging chunks ``chunk[i] : ...``, one DMA each; staging (an HBM
    output) written in place, the slab only read."""

    def kernel(n_ref, chunk_ref, row_ref, len_ref, slab, _staging_in, staging, sem):
        view = _staging_view(staging, blocks_per_chunk, tiles)

        def copy(i, _):
            return pltpu.make_async_copy(slab.at[pl.ds(row_ref[i], len_ref[i])],
                                         view.at[pl.ds(chunk_ref[i], len_ref[i])], sem.at[0])

        dma.start_then_wait(n_ref, 1, copy)

    return _call(kernel, jax.ShapeDtypeStruct(staging_shape, dtype), pl.BlockSpec(memory_space=pl.ANY),
                 [pl.BlockSpec(memory_space=pl.HOST), pl.BlockSpec(memory_space=pl.ANY)], {N_SCALARS + 1: 0},
                 platform)


def _call(kernel, out_shape, out_specs, in_specs, aliases, platform: str):
    if platform != "tpu":
        raise ValueError(f"the host-copy kernel runs on TPU only (its u8 view of staging is a TPU bitcast that "
                         f"interpret mode cannot run), not on {platform!r}; elsewhere the loop programs run")
    return pl.pallas_call(
        kernel, out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_SCALARS, grid=(1,), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
    )
