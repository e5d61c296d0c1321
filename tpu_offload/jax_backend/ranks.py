"""The host tier under DP attention: each rank's chunks in its own devices' host memory.

tpu-inference's DP attention splits every cache's block dimension over the
attention-DP ranks, and each rank's scheduler owns an equal partition of the
slots (connector/dp.py). Staging and the host slabs split the same way
(layout.py): rank r stages its own blocks on its own devices and stores them
into the rows of its partition, which live in those devices' host memory. So
a store never crosses ranks, and gather and scatter are each device's own DMAs.

Only a load of another rank's chunk crosses: the load program reads every
chunk where it lives, and ``ranks - 1`` ring shifts (``ppermute`` over the
ranks' axes, shift k: rank r to rank r + k) carry the chunks bound for
another rank, once per pass. Each shift carries at most ``cross_chunks``
(a quarter of a rank's share of staging, ``CROSS_SHARE``): the TPU compiler
gives the ring 3 to 4 such buffers of scratch (filled from host memory, the
permute's output, copies), 0.75x a device's staging at DP 2 and 0.99x at DP 8
(tests/tpu_compiler), and the engine splits a larger cross-rank load over passes. A pass whose
chunks all load on their own rank runs the program without the ring.

Operands are per rank, one row each on the rank's devices (``P(block axes)``):
rows are the rank's rows of the slab, positions its share of staging.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpu_offload.jax_backend.collectives import bits, collectives_as_bits, ring
from tpu_offload.jax_backend.layout import block_entry

CROSS_SHARE = 4  # a ring shift carries at most 1/CROSS_SHARE of a rank's share of staging


def cross_chunks(share_chunks: int) -> int:
    """Chunks one ring shift carries to another rank (at least one)."""
    return max(1, share_chunks // CROSS_SHARE)


def store_operands(programs, k: int, rows, pos) -> tuple:
    """(rows, staging chunks, count) of one group's store into slab ``k``: per rank, (ranks, share) and
    (ranks, 1). ``rows``: global rows of the slab; ``pos``: staging chunks."""
    d, sc = programs.ranks, programs.share_chunks
    local = programs.slab_rows[k] // d
    rows, pos = np.asarray(rows, dtype=np.int64), np.asarray(pos, dtype=np.int64)
    rank, src = pos // sc, rows // local  # whose share of staging, whose partition of the slab
    bad = np.flatnonzero(src != rank)
    if bad.size:
        i = bad[0]
        raise ValueError(f"a chunk of attention-DP rank {rank[i]} into slab {k} row {rows[i]}, in rank {src[i]}'s "
                         "partition: each rank stores into its own partition of the slots")
    out_rows, out_pos = np.zeros((d, sc), np.int32), np.zeros((d, sc), np.int32)
    count = np.zeros((d, 1), np.int32)
    for r in range(d):
        m = rank == r
        n = count[r, 0] = m.sum()
        out_rows[r, :n] = rows[m] - r * local
        out_pos[r, :n] = pos[m] - r * sc
    return out_rows, out_pos, count


def load_operands(programs, k: int, rows, pos) -> tuple[tuple, bool]:
    """((rows, positions, counts), crosses) of one group's load from slab ``k``: rows[r, s, i] is the i-th
    row rank r sends at shift s (to rank r + s), positions[r, s, i] where rank r puts the i-th chunk
    it receives at shift s (from rank r - s), counts[r, s] = (sent, received). ``crosses``: any shift > 0."""
    d, sc = programs.ranks, programs.share_chunks
    local = programs.slab_rows[k] // d
    rows, pos = np.asarray(rows, dtype=np.int64), np.asarray(pos, dtype=np.int64)
    dst, src = pos // sc, rows // local
    shift = (dst - src) % d
    for r in range(d):
        for s in range(1, d):
            if ((src == r) & (shift == s)).sum() > programs.cross_chunks:
                raise ValueError(f"{int(((src == r) & (shift == s)).sum())} chunks from attention-DP rank {r} to rank "
                                 f"{(r + s) % d} in one pass: a ring shift carries at most {programs.cross_chunks}")
    out_rows, out_pos = np.zeros((d, d, sc), np.int32), np.zeros((d, d, sc), np.int32)
    counts = np.zeros((d, d, 2), np.int32)
    for r in range(d):
        for s in range(d):
            m = (src == r) & (shift == s)
            n = int(m.sum())
            out_rows[r, s, :n] = rows[m] - r * local
            out_pos[(r + s) % d, s, :n] = pos[m] - (r + s) % d * sc
            counts[r, s, 0] = counts[(r + s) % d, s, 1] = n
    return (out_rows, out_pos, counts), bool((shift > 0).any())


def build_store(programs, rows: int):
    """(slabs, staging, rows, positions, count) -> (slabs, count): each device copies its rank's staged
    chunks into its rows of the slab, in place; nothing crosses devices."""
    bpc, groups, layout = programs.bpc, programs.layout.groups, programs.layout

    def store_local(slabs, staging, row, src, count):
        out = []
        for gi, sl in enumerate(slabs):
            def body(j, sl, gi=gi):
                chunk = lax.dynamic_slice_in_dim(staging[gi], src[gi][0, j] * bpc, bpc, axis=0)[None]
                return lax.dynamic_update_slice_in_dim(sl, jax.device_put(chunk, jax.memory.Space.Host),
                                                       row[gi][0, j], axis=0)

            out.append(lax.fori_loop(0, count[gi][0, 0], body, sl))
        return tuple(out), jnp.concatenate([c[0] for c in count])

    rp, slab_specs = programs._gp(), _slab_specs(layout)
    body = programs._local(store_local, (slab_specs, programs._staging_specs(), rp, rp, rp),
                           (slab_specs, P(block_entry(groups[0]))))
    jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(tuple(programs._slab_sh), _rows(programs)))
    sc = programs.share_chunks
    ops = tuple(_per_rank(programs, sc) for _ in groups)
    return jitted.lower(programs._slab_aval(rows), programs._staging_aval(), ops, ops,
                        tuple(_per_rank(programs, 1) for _ in groups)).compile()


def build_load(programs, rows: int, cross: bool):
    """(staging, slabs, rows, positions, counts) -> (staging, count): each device reads the chunks its
    rows hold; those for its own rank go straight into its share of staging, the others (``cross``)
    round the ring of the ranks, one shift at a time (one received buffer live at once)."""
    bpc, layout, d = programs.bpc, programs.layout, programs.ranks
    groups, sc = layout.groups, programs.share_chunks
    as_bits = collectives_as_bits(layout)
    mesh_shape = dict(layout.mesh.shape)

    def load_local(staging, slabs, row, dst, n):
        out = []
        for gi, (st, sl) in enumerate(zip(staging, slabs)):
            g, r_, d_, n_ = groups[gi], row[gi][0], dst[gi][0], n[gi][0]

            def read(j, shift, sl=sl, r_=r_):
                return jax.device_put(lax.dynamic_slice_in_dim(sl, r_[shift, j], 1, axis=0), jax.memory.Space.Device)[0]

            def put(st, chunk, at):
                return lax.dynamic_update_slice_in_dim(st, chunk, at * bpc, axis=0)

            st = lax.fori_loop(0, n_[0, 0], lambda j, st, d_=d_: put(st, read(j, 0), d_[0, j]), st)
            for s in range(1, d if cross else 1):
                buf = jnp.zeros((programs.cross_chunks * bpc, *st.shape[1:]), st.dtype)
                buf, st = lax.optimization_barrier((buf, st))  # one shift's buffers live at a time
                buf = lax.fori_loop(0, n_[s, 0], lambda j, b, s=s: put(b, read(j, s), j), buf)
                raw = lax.bitcast_convert_type(buf, bits(buf.dtype)) if as_bits else buf
                got = lax.ppermute(raw, *ring(g.block_axes, mesh_shape, [(i, (i + s) % d) for i in range(d)]))
                got = lax.bitcast_convert_type(got, st.dtype) if as_bits else got
                st = lax.fori_loop(0, n_[s, 1], lambda j, st, s=s, got=got, d_=d_: put(
                    st, lax.dynamic_slice_in_dim(got, j * bpc, bpc, axis=0), d_[s, j]), st)
            out.append(st)
        return tuple(out), jnp.concatenate([c[0, :, 0] for c in n])

    rp, slab_specs = programs._gp(), _slab_specs(layout)
    body = programs._local(load_local, (programs._staging_specs(), slab_specs, rp, rp, rp),
                           (programs._staging_specs(), P(block_entry(groups[0]))))
    jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(programs._staging_sh, _rows(programs)))
    ops = tuple(_per_rank(programs, d, sc) for _ in groups)
    return jitted.lower(programs._staging_aval(), programs._slab_aval(rows), ops, ops,
                        tuple(_per_rank(programs, d, 2) for _ in groups)).compile()


def _slab_specs(layout) -> tuple:
    """Per group, the slabs' spec inside ``shard_map`` (rows over the ranks)."""
    return tuple(layout.slab_sharding(g, "device").spec for g in layout.groups)


def _per_rank(programs, *shape):
    return jax.ShapeDtypeStruct((programs.ranks, *shape), jnp.int32, sharding=_rows(programs))


def _rows(programs):
    """One row per rank, on its devices."""
    return programs.layout.sharding(block_entry(programs.layout.groups[0]))
