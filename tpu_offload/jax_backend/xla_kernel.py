"""Gather and scatter as one XLA gather/scatter per layer, host copies by runs: the kernel for GPUs.

The Pallas DMA kernel needs a TPU, and the ``loop`` kernel moves one block per
trip of a device-side loop: on a GPU every trip is a kernel per layer plus a
round trip to the host to test the loop's condition, so a 32-block pass of a
64-layer model runs about 2,000 tiny kernels (a third of the link, measured on
an H200). Here a pass is one gather (or scatter) per layer, which XLA fuses.

A pass fills a prefix of staging, so the programs work on a bucket: the
next power of ``BASE`` at or above the prefix (at most the staging size).
``gather`` takes, for every staging position of the bucket, the block that
goes there (position order; a hole takes block 0, bytes no load reads) and
writes the bucket with one ``dynamic_update_slice`` at 0. ``scatter`` reads
the bucket and writes each block to its cache row; padded entries point past
the cache and are dropped. Every program reads and writes what its pass moves,
at most ``BASE`` times over and at HBM speed. Each bucket is its own program,
all compiled ahead of time: log_BASE(staging) programs per direction. Only layouts whose blocks live whole on each device
(no replica slices, no attention-DP ranks) use it; others keep ``loop``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

BASE = 4


def supported(layout) -> bool:
    return all(g.replicas == 1 and g.ranks == 1 for g in layout.groups)


def buckets(staging_blocks: int) -> tuple[int, ...]:
    """The pass sizes programs are compiled for: 1, BASE, BASE**2, ... below the staging size, then it."""
    out, b = [], 1
    while b < staging_blocks:
        out.append(b)
        b *= BASE
    return (*out, staging_blocks)


def bucket_of(n: int, sizes: tuple[int, ...]) -> int:
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"a pass of {n} blocks exceeds the staging buffer's {sizes[-1]}")


class Bucketed:
    """One compiled program per bucket, chosen by the length of the index vectors it is called with."""

    def __init__(self, build: Callable[[int], Callable], sizes: tuple[int, ...]):
        self.sizes = sizes
        self._by_size = {b: build(b) for b in sizes}  # ahead of time: nothing compiles while serving

    def __call__(self, caches, staging, *index):
        return self._by_size[len(index[0][0])](caches, staging, *index)

    def memory_analysis(self):
        """The largest bucket's: the most HBM any pass of this program takes."""
        return self._by_size[self.sizes[-1]].memory_analysis()

    def cost_analysis(self):
        """The largest bucket's (the self-check's figures read it as they read any compiled program)."""
        return self._by_size[self.sizes[-1]].cost_analysis()

    @property
    def programs(self) -> dict[int, Callable]:
        return dict(self._by_size)


def block_args(programs, moves, name: str) -> tuple:
    """``gather``: per group, the block id for each staging position of the bucket (0 where none goes).
    ``scatter``: per group (block ids, staging positions), padded with ids past the cache (dropped)."""
    end = max((int(np.max(p)) + 1 for _, p in moves if len(p)), default=1)
    size = bucket_of(end, buckets(programs.staging_blocks))
    if name == "gather":
        out = []
        for ids, pos in moves:
            by_pos = np.zeros(size, dtype=np.int32)
            by_pos[np.asarray(pos, dtype=np.int64)] = ids
            out.append(by_pos)
        return (tuple(out),)
    fill = programs.layout.num_blocks
    return tuple(_padded(i, size, fill) for i, _ in moves), tuple(_padded(p, size, 0) for _, p in moves)


def _padded(values, n: int, fill: int) -> np.ndarray:
    out = np.full(n, fill, dtype=np.int32)
    out[: len(values)] = values
    return out


def build_gather(programs) -> Bucketed:
    groups = programs.layout.groups

    def gather_local(caches, staging, by_pos):
        out = []
        for gi, (g, st) in enumerate(zip(groups, staging)):
            blocks = jnp.stack([jnp.take(caches[a], by_pos[gi], axis=0, mode="clip") for a in g.layers], axis=1)
            out.append(lax.dynamic_update_slice_in_dim(st, blocks, 0, axis=0))
        return tuple(out)

    def build(size: int):
        idx = tuple(P() for _ in groups)
        body = programs._local(gather_local, (programs._cache_specs(), programs._staging_specs(), idx),
                               programs._staging_specs())
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=programs._staging_sh)
        return jitted.lower(programs._caches_aval(), programs._staging_aval(), programs._group_ints(size)).compile()

    return Bucketed(build, buckets(programs.staging_blocks))


def build_scatter(programs) -> Bucketed:
    groups = programs.layout.groups

    def scatter_local(caches, staging, ids, pos):
        caches = list(caches)
        for gi, (g, st) in enumerate(zip(groups, staging)):
            rows = jnp.take(st, pos[gi], axis=0, mode="clip")  # (bucket, layers, *block)
            for li, a in enumerate(g.layers):
                caches[a] = caches[a].at[ids[gi]].set(rows[:, li], mode="drop")
        return tuple(caches), jnp.stack([i[0] for i in ids])  # "done": ready when the program is

    def build(size: int):
        idx = tuple(P() for _ in groups)
        body = programs._local(scatter_local, (programs._cache_specs(), programs._staging_specs(), idx, idx),
                               (programs._cache_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(programs._cache_sh, programs._rep))
        ints = programs._group_ints(size)
        return jitted.lower(programs._caches_aval(), programs._staging_aval(), ints, ints).compile()

    return Bucketed(build, buckets(programs.staging_blocks))


# ---- host copies: runs of chunks, one DMA per piece -----------------------------------------------
# The loop programs copy one chunk per trip; on a GPU a trip also costs a round trip to the host to test
# the loop's condition. Chunks adjacent in both staging and the slab (the LRU hands out free slots in
# order) go as one piece of a power-of-two chunk count, up to PIECE_BYTES per device: one loop per
# piece size, so a pass of 1,000 adjacent chunks is a few dozen DMAs, and scattered ones one each.
PIECE_BYTES = 32 << 20


def run_sizes(programs) -> tuple[int, ...]:
    """Chunk counts of a piece, largest first: powers of two, at most PIECE_BYTES of the largest group."""
    chunk = max(g.piece_bytes for g in programs.layout.groups) * programs.bpc
    cap = max(1, min(PIECE_BYTES // chunk, programs.staging_chunks))
    sizes, s = [], 1
    while s <= cap:
        sizes.append(s)
        s *= 2
    return tuple(reversed(sizes))


def split_runs(rows, pos, sizes: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Per piece size, the (slab rows, staging chunks) where pieces of that size start."""
    rows, pos = np.asarray(rows, dtype=np.int64), np.asarray(pos, dtype=np.int64)
    order = np.argsort(pos, kind="stable")
    rows, pos = rows[order], pos[order]
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in sizes]
    brk = np.flatnonzero((np.diff(rows) != 1) | (np.diff(pos) != 1)) + 1
    for r, p in zip(np.split(rows, brk), np.split(pos, brk)):
        i, n = 0, len(r)
        while i < n:
            k = next(k for k, s in enumerate(sizes) if s <= n - i)
            out[k][0].append(int(r[i]))
            out[k][1].append(int(p[i]))
            i += sizes[k]
    return out


def host_args(programs, rows: list, pos: list) -> tuple:
    """(rows[g][size], staging chunks[g][size], count[g * sizes + size]) for ``store``/``load``."""
    sizes, c = run_sizes(programs), programs.staging_chunks
    per = [split_runs(r, p, sizes) for r, p in zip(rows, pos)]
    return (tuple(tuple(_padded(rr, c, 0) for rr, _ in g) for g in per),
            tuple(tuple(_padded(pp, c, 0) for _, pp in g) for g in per),
            np.array([len(rr) for g in per for rr, _ in g], dtype=np.int32))


def _host_avals(programs):
    sizes, c = run_sizes(programs), programs.staging_chunks
    per = tuple(tuple(programs._ints(c) for _ in sizes) for _ in programs.layout.groups)
    return per, per, programs._ints(len(sizes) * len(programs.layout.groups))


def build_store(programs, rows: int):
    sizes, bpc, slab_sh = run_sizes(programs), programs.bpc, programs._slab_sh

    def store(slabs, staging, row, src, count):
        out = []
        for gi, sl in enumerate(slabs):
            for k, s in enumerate(sizes):
                def body(j, sl, gi=gi, k=k, s=s):
                    piece = lax.dynamic_slice_in_dim(staging[gi], src[gi][k][j] * bpc, s * bpc, axis=0)
                    piece = jax.device_put(piece.reshape((s, bpc) + piece.shape[1:]), slab_sh[gi])
                    return lax.dynamic_update_slice_in_dim(sl, piece, row[gi][k][j], axis=0)

                sl = lax.fori_loop(0, count[gi * len(sizes) + k], body, sl)
            out.append(sl)
        return tuple(out), count

    jitted = jax.jit(store, donate_argnums=(0,), out_shardings=(tuple(slab_sh), programs._rep))
    return jitted.lower(programs._slab_aval(rows), programs._staging_aval(), *_host_avals(programs)).compile()


def build_load(programs, rows: int):
    sizes, bpc = run_sizes(programs), programs.bpc
    st_sh, dev_sh = programs._staging_sh, programs._slab_dev_sh

    def load(staging, slabs, row, dst, count):
        out = []
        for gi, (st, sl) in enumerate(zip(staging, slabs)):
            for k, s in enumerate(sizes):
                def body(j, st, gi=gi, k=k, s=s, sl=sl):
                    piece = jax.device_put(lax.dynamic_slice_in_dim(sl, row[gi][k][j], s, axis=0), dev_sh[gi])
                    piece = piece.reshape((s * bpc,) + piece.shape[2:])
                    return lax.dynamic_update_slice_in_dim(st, piece, dst[gi][k][j] * bpc, axis=0)

                st = lax.fori_loop(0, count[gi * len(sizes) + k], body, st)
            out.append(st)
        return tuple(out), count

    jitted = jax.jit(load, donate_argnums=(0,), out_shardings=(st_sh, programs._rep))
    return jitted.lower(programs._staging_aval(), programs._slab_aval(rows), *_host_avals(programs)).compile()
