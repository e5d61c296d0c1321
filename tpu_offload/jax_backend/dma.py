"""Gather and scatter as DMAs: one Pallas TPU kernel per pass, no TensorCore loop over blocks.

A pass moves many blocks of every layer between the paged caches and
staging. As XLA ops that is a ``while`` loop of per-block, per-layer
``dynamic_(update_)slice`` ops: 64,000 sequential small copies for 1,000
blocks of a 64-layer model, each a few hundred ns to µs on the TensorCore.
Here the kernel instead *starts* one DMA for every (layer, run of adjacent
blocks) and then waits for them all: the DMA engines move the bytes, the
kernel only issues descriptors (a scalar loop over runs inside Mosaic, not
an HLO loop). Runs are coalesced on the host (``coalesce``): blocks that are
adjacent in both the cache and staging are one DMA.

The block ids arrive as scalar-prefetch operands (SMEM): (run count, source
starts, destination starts, lengths). One kernel source serves the TPU
(compiled by Mosaic) and CPU tests (``interpret=pltpu.InterpretParams()``:
DMAs and semaphores emulated, bit for bit).

Replicas (repeated KV heads, MLA's copies) keep one ``1/replicas`` slice of
a block each (layout.py). The gather DMAs just that slice. The scatter
rebuilds whole blocks from every replica's slice: the ring of ``ppermute``s
runs once per pass on the whole staging buffer (``replicas - 1`` shifts,
each followed by one kernel that writes the received slices), never per
block.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Scalar-prefetch operands: run count (1,), source starts, destination starts, lengths, slice offset (1,)
N_SCALARS = 5


def coalesce(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Runs ``(src_start, dst_start, length)`` of block moves ``src[i] -> dst[i]``, in order:
    a move continues the previous run when both its source and destination follow it."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [src.size]]))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def run_operands(runs: np.ndarray, capacity: int, cols: int = 3) -> tuple[np.ndarray, ...]:
    """The kernel's scalar operands for ``runs``, padded to ``capacity`` entries (one compiled
    shape for every pass): (count (1,), then one vector per column of ``runs``: here source starts,
    destination starts, lengths; the direct kernel's four columns too)."""
    n = len(runs)
    if n > capacity:
        raise ValueError(f"{n} runs exceed the kernel's capacity of {capacity}")
    out = [np.array([n], dtype=np.int32)]
    for col in range(cols):
        v = np.zeros(capacity, dtype=np.int32)
        v[:n] = runs[:, col] if n else v[:0]
        out.append(v)
    return tuple(out)


def _interpret(platform: str):
    return pltpu.InterpretParams() if platform == "cpu" else False


def _sliced(ref, rows, split):
    """``ref.at[rows]``, and within each block only ``split = (dim, offset, size)`` along that block dim."""
    if split is None:
        return ref.at[rows]
    dim, offset, size = split
    full = ref.shape[1:]
    idx = (rows,) + tuple(pl.ds(offset, size) if d == dim else pl.ds(0, n) for d, n in enumerate(full))
    return ref.at[idx]


def gather_call(num_layers: int, staging_shape, dtype, platform: str, split: tuple[int, int] | None = None):
    """A function ``(n, src, dst, length, offset, *caches, staging) -> staging`` for one device's
    shards: for every run i < n[0] and layer l, ``caches[l][src[i] : src[i] + length[i]]``
    (only the slice ``offset[0] : offset[0] + size`` of block dim ``split = (dim, size)``) into
    ``staging[dst[i] : ..., l]``. One DMA per (run, layer), one semaphore per layer."""
    L = num_layers

    def kernel(n_ref, src_ref, dst_ref, len_ref, off_ref, *refs):
        caches, out, sems = refs[:L], refs[L + 1], refs[-1]

        def copy(i, li):
            rows = pl.ds(src_ref[i], len_ref[i])
            part = None if split is None else (split[0], off_ref[0], split[1])
            return pltpu.make_async_copy(_sliced(caches[li], rows, part), out.at[pl.ds(dst_ref[i], len_ref[i]), li],
                                         sems.at[li])

        start_then_wait(n_ref, L, copy)

    out_shape = jax.ShapeDtypeStruct(staging_shape, dtype)
    run = _dma_call(kernel, out_shape, pl.BlockSpec(memory_space=pl.ANY), {N_SCALARS + L: 0}, L + 1, L,
                    platform)  # staging in place

    def call(n, src, dst, length, offset, caches, staging):
        return run(n, src, dst, length, offset, *caches, staging)

    return call


def scatter_call(num_layers: int, cache_shape, dtype, platform: str, split: tuple[int, int] | None = None):
    """A function ``(n, src, dst, length, offset, source, *caches) -> caches``: for every run
    i < n[0] and layer l, ``source[src[i] : src[i] + length[i], l]`` into ``caches[l][dst[i] : ...]``
    (into the slice ``offset[0] : offset[0] + size`` of block dim ``split = (dim, size)`` when
    ``source`` holds one replica's slices). The caches are written in place."""
    L = num_layers

    def kernel(n_ref, src_ref, dst_ref, len_ref, off_ref, *refs):
        source, outs, sems = refs[0], refs[1 + L: 1 + 2 * L], refs[1 + 2 * L]

        def copy(i, li):
            rows = pl.ds(dst_ref[i], len_ref[i])
            part = None if split is None else (split[0], off_ref[0], split[1])
            return pltpu.make_async_copy(source.at[pl.ds(src_ref[i], len_ref[i]), li],
                                         _sliced(outs[li], rows, part), sems.at[li])

        start_then_wait(n_ref, L, copy)

    out_shape = tuple(jax.ShapeDtypeStruct(cache_shape, dtype) for _ in range(L))

    run = _dma_call(kernel, out_shape, tuple(pl.BlockSpec(memory_space=pl.ANY) for _ in range(L)),
                    {N_SCALARS + 1 + li: li for li in range(L)}, L + 1, L, platform)  # every cache, in place

    def call(n, src, dst, length, offset, source, caches):
        return run(n, src, dst, length, offset, source, *caches)

    return call


def _dma_call(kernel, out_shape, out_specs, aliases: dict[int, int], num_inputs: int, num_layers: int,
              platform: str):
    """The ``pallas_call`` both directions share: the scalars prefetched, every array left in HBM
    (``pl.ANY``: the kernel only starts DMAs), one DMA semaphore per layer, outputs aliased."""
    return pl.pallas_call(
        kernel, out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_SCALARS, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_inputs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.SemaphoreType.DMA((num_layers,))]),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=_interpret(platform),
    )


def start_then_wait(n_ref, num_layers: int, copy):
    """Start every (run, layer) DMA, then wait for each: all are in flight together."""

    @pl.loop(0, n_ref[0])
    def _start(i):
        for li in range(num_layers):
            copy(i, li).start()

    @pl.loop(0, n_ref[0])
    def _wait(i):
        for li in range(num_layers):
            copy(i, li).wait()
