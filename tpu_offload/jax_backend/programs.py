"""The four compiled programs that move KV.

* ``gather``  paged caches -> staging (donates staging): one step's blocks, all layers.
* ``scatter`` staging -> paged caches (donates the caches).

Both run per device (``shard_map``) on its own shards; the only traffic
between devices is the scatter's rebuild of replicated heads (see layout.py).
* ``store``   staging -> host slabs (donates the slabs): one batched D2H.
* ``load``    host slabs -> staging (donates staging): one batched H2D.

Every program loops over a dynamic count (blocks or chunks) and moves one
whole block (or chunk) per trip with ``dynamic_slice``/``dynamic_update_slice``
in the cache's own dtype and block shape. That is what the TPU compiler
turns into in-place copies: a vectorised ``cache.at[ids].set`` or a gather of
bits-reinterpreted, flattened blocks made it copy every layer's whole cache
(13.8 GB of scratch for 16 blocks of Qwen3-32B on TPU7x; 1,000 did not fit).
A loop's program does not grow with the block count, so each of the four
compiles once, at any staging size. Every program is compiled ahead of time
(``lower().compile()``): a call with an unexpected shape raises instead of
silently recompiling mid-serving.
"""

from __future__ import annotations

import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpu_offload.jax_backend.layout import KVLayout


class Programs:
    """Builds and caches the compiled transfer programs for one layout."""

    def __init__(self, layout: KVLayout, *, staging_blocks: int, blocks_per_chunk: int,
                 slab_rows: tuple[int, ...], memory_kind: str):
        self.layout = layout
        self.staging_blocks = staging_blocks
        self.bpc = blocks_per_chunk
        self.staging_chunks = staging_blocks // blocks_per_chunk
        self.slab_rows = slab_rows
        self.memory_kind = memory_kind
        self.compiles = 0  # programs compiled so far (tests assert it stops growing)
        self._cache: dict[tuple, Callable] = {}
        self._lock = threading.Lock()
        g0 = layout.groups
        self._staging_sh = tuple(layout.staging_sharding(g) for g in g0)
        self._slab_sh = tuple(layout.slab_sharding(g, memory_kind) for g in g0)
        self._slab_dev_sh = tuple(layout.slab_sharding(g, "device") for g in g0)
        self.chunk_sh = tuple(layout.staging_sharding(g) for g in g0)  # one chunk on HBM (device_put path)
        self.host_chunk_sh = tuple(layout.sharding(*layout.staging_spec(g), memory_kind=memory_kind) for g in g0)
        # Programs take the runner's caches as one flat tuple (an array may hold layers of several groups).
        self._arrays = _arrays(layout)  # per cache array: the group that describes its shape and sharding
        self._cache_sh = tuple(g.cache_sharding for g in self._arrays)  # the runner's own
        self._cache_in_sh = tuple(layout.sharding(*g.cache_spec) for g in self._arrays)  # the same on program_mesh
        self._rep = layout.replicated()

    # ---- abstract values ----------------------------------------------
    def _caches_aval(self):
        return tuple(jax.ShapeDtypeStruct((self.layout.num_blocks, *g.block_shape), g.dtype, sharding=s)
                     for g, s in zip(self._arrays, self._cache_in_sh))

    def _staging_aval(self):
        return tuple(
            jax.ShapeDtypeStruct(g.staging_shape(self.staging_blocks), g.dtype, sharding=s)
            for g, s in zip(self.layout.groups, self._staging_sh)
        )

    def _slab_aval(self, rows: int):
        return tuple(jax.ShapeDtypeStruct(g.slab_shape(rows, self.bpc), g.dtype, sharding=s)
                     for g, s in zip(self.layout.groups, self._slab_sh))

    def _slabs_aval(self):
        return tuple(
            tuple(jax.ShapeDtypeStruct(g.slab_shape(r, self.bpc), g.dtype, sharding=s) for r in self.slab_rows)
            for g, s in zip(self.layout.groups, self._slab_sh)
        )

    def _ints(self, n: int):
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._rep)

    def _group_ints(self, n: int):
        """One index vector per group: each group moves its own blocks (a sliding-window group fewer)."""
        return tuple(self._ints(n) for _ in self.layout.groups)

    # ---- public: compiled programs --------------------------------------
    def gather(self) -> Callable:
        """(caches, staging, src_ids[g][n], dst_pos[g][n], count[groups]) -> staging: per group g,
        block src_ids[g][i] to staging position dst_pos[g][i], for i < count[g]."""
        return self._get(("gather",), self._build_gather)

    def scatter(self) -> Callable:
        """(caches, staging, dst_ids[g][n], src_pos[g][n], count[groups]) -> (caches, done): per group g,
        staging[src_pos[g][i]] to block dst_ids[g][i]."""
        return self._get(("scatter",), self._build_scatter)

    def store(self, rows: int | None = None) -> Callable:
        """(one slab per group, staging, slab rows[g][c], staging chunks[g][c], count[groups]) -> (slabs, done).

        One program per slab *size* (all slabs but the last share one), called
        once per slab a pass touches: one program over every slab made the
        TPU compiler take 41 s for the 45 slabs of a 720 GiB tier."""
        rows = self.slab_rows[0] if rows is None else rows
        return self._get(("store", rows), self._build_store, rows)

    def load(self, rows: int | None = None) -> Callable:
        """(staging, one slab per group, slab rows[g][c], staging chunks[g][c], count[groups]) -> (staging, done)."""
        rows = self.slab_rows[0] if rows is None else rows
        return self._get(("load", rows), self._build_load, rows)

    def take_chunk(self) -> Callable:
        """(staging, pos[1]) -> one chunk per group, (bpc, layers, *piece): what ``device_put`` sends to host."""
        return self._get(("take_chunk",), self._build_take_chunk)

    def put_chunk(self, group: int = 0) -> Callable:
        """(staging of ``group``, its chunk, pos[1]) -> that staging (donated): a chunk ``device_put``
        brought back. One per group: a load brings back only the groups it needs."""
        return self._get(("put_chunk", group), self._build_put_chunk, group)

    def all_programs(self, path: str = "program") -> dict[str, Callable]:
        """Every transfer program ``path`` uses, compiled (what precompile builds and the HBM check measures)."""
        if path == "device_put":
            out = {"gather": self.gather(), "scatter": self.scatter(), "take_chunk": self.take_chunk(),
                   "put_chunk": self.put_chunk()}
            out.update({f"put_chunk_{gi}": self.put_chunk(gi) for gi in range(1, len(self.layout.groups))})
            return out
        out = {"gather": self.gather(), "scatter": self.scatter(), "store": self.store(), "load": self.load(),
               "alloc_slabs": self._slab_allocator()}
        if self.slab_rows[-1] != self.slab_rows[0]:  # the last, smaller slab
            out.update(store_last=self.store(self.slab_rows[-1]), load_last=self.load(self.slab_rows[-1]))
        return out

    def precompile(self, path: str = "program") -> None:
        self.all_programs(path)

    def scratch_bytes(self, path: str = "program") -> int:
        """Per-device temporary HBM of the largest transfer program (compiles those programs)."""
        return max(int(p.memory_analysis().temp_size_in_bytes) for p in self.all_programs(path).values())

    def _get(self, key, build, *args):
        fn = self._cache.get(key)
        if fn is None:
            with self._lock:
                fn = self._cache.get(key)
                if fn is None:
                    fn = build(*args)
                    self._cache[key] = fn
                    self.compiles += 1
        return fn

    # ---- builders -------------------------------------------------------
    def _local(self, body, in_specs, out_specs):
        """``body`` on each device's own shards (no implicit resharding, ever)."""
        return jax.shard_map(body, mesh=self.layout.program_mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _build_gather(self):
        groups = self.layout.groups

        def gather_local(caches, staging, ids, pos, count):
            out = []
            for gi, (g, st) in enumerate(zip(groups, staging)):
                layers = [caches[a] for a in g.layers]

                def body(i, st, g=g, gi=gi, layers=layers):
                    for li, c in enumerate(layers):
                        block = _read_block(c, g, ids[gi][i])  # (1, *local_block_shape)
                        if g.replicas > 1:  # keep only this device's slice of the bytes its replicas also hold
                            j = lax.axis_index(g.rep_axes) % g.replicas
                            t = g.piece_shape[g.split_dim]
                            block = lax.dynamic_slice_in_dim(block, j * t, t, axis=1 + g.split_dim)
                        st = lax.dynamic_update_slice(st, block[:, None], (pos[gi][i], li) + (0,) * len(g.piece_shape))
                    return st

                out.append(lax.fori_loop(0, count[gi], body, st))
            return tuple(out)

        gp = tuple(P() for _ in groups)
        body = self._local(gather_local, (self._cache_specs(), self._staging_specs(), gp, gp, P()),
                           self._staging_specs())
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=self._staging_sh)
        n = self.staging_blocks
        return jitted.lower(self._caches_aval(), self._staging_aval(), self._group_ints(n), self._group_ints(n),
                            self._ints(len(groups))).compile()

    def _build_scatter(self):
        groups = self.layout.groups
        as_bits = collectives_as_bits(self.layout)

        def scatter_local(caches, staging, ids, pos, count):
            caches = list(caches)
            for gi, (g, st) in enumerate(zip(groups, staging)):
                zeros = (0,) * len(g.piece_shape)

                def body(i, layers, g=g, gi=gi, st=st, zeros=zeros):
                    if g.replicas > 1:  # the whole head shard, from the slices this device's replicas kept
                        row = lax.dynamic_index_in_dim(st, pos[gi][i], 0, keepdims=True)  # (1, layers, *piece_shape)
                        new = list(layers)
                        for piece, offset in _replica_slices(row, g, as_bits):
                            at = tuple(offset if d == g.split_dim else 0 for d in range(len(zeros)))
                            new = [_write_block(c, g, ids[gi][i], piece[:, li], at) for li, c in enumerate(new)]
                        return tuple(new)
                    # slice each layer's block straight out of staging: no copy of the row
                    return tuple(
                        lax.dynamic_update_slice(
                            c, lax.dynamic_slice(st, (pos[gi][i], li, *zeros), (1, 1, *g.piece_shape))[:, 0],
                            (ids[gi][i],) + zeros)
                        for li, c in enumerate(layers))

                new = lax.fori_loop(0, count[gi], body, tuple(caches[a] for a in g.layers))
                for a, arr in zip(g.layers, new):
                    caches[a] = arr
            return tuple(caches), count

        gp = tuple(P() for _ in groups)
        body = self._local(scatter_local, (self._cache_specs(), self._staging_specs(), gp, gp, P()),
                           (self._cache_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(self._cache_sh, self._rep))
        n = self.staging_blocks
        return jitted.lower(self._caches_aval(), self._staging_aval(), self._group_ints(n), self._group_ints(n),
                            self._ints(len(groups))).compile()

    def _cache_specs(self):
        return tuple(P(*g.cache_spec) for g in self._arrays)

    def _staging_specs(self):
        return tuple(P(*self.layout.staging_spec(g)) for g in self.layout.groups)

    def _build_store(self, rows: int):
        bpc, groups = self.bpc, self.layout.groups
        slab_sh = self._slab_sh

        def store(slabs, staging, row, src, count):
            out = []
            for gi, sl in enumerate(slabs):
                def body(j, sl, gi=gi):
                    chunk = lax.dynamic_slice_in_dim(staging[gi], src[gi][j] * bpc, bpc, axis=0)[None]
                    chunk = jax.device_put(chunk, slab_sh[gi])
                    return lax.dynamic_update_slice_in_dim(sl, chunk, row[gi][j], axis=0)

                out.append(lax.fori_loop(0, count[gi], body, sl))
            return tuple(out), count

        jitted = jax.jit(store, donate_argnums=(0,), out_shardings=(tuple(slab_sh), self._rep))
        c = self.staging_chunks
        return jitted.lower(self._slab_aval(rows), self._staging_aval(), self._group_ints(c), self._group_ints(c),
                            self._ints(len(groups))).compile()

    def _build_load(self, rows: int):
        bpc, groups = self.bpc, self.layout.groups
        st_sh, dev_sh = self._staging_sh, self._slab_dev_sh

        def load(staging, slabs, row, dst, count):
            out = []
            for gi, (st, sl) in enumerate(zip(staging, slabs)):
                def body(j, st, gi=gi, sl=sl):
                    chunk = lax.dynamic_slice_in_dim(sl, row[gi][j], 1, axis=0)
                    chunk = jax.device_put(chunk, dev_sh[gi])[0]
                    return lax.dynamic_update_slice_in_dim(st, chunk, dst[gi][j] * bpc, axis=0)

                out.append(lax.fori_loop(0, count[gi], body, st))
            return tuple(out), count

        jitted = jax.jit(load, donate_argnums=(0,), out_shardings=(st_sh, self._rep))
        c = self.staging_chunks
        return jitted.lower(self._staging_aval(), self._slab_aval(rows), self._group_ints(c), self._group_ints(c),
                            self._ints(len(groups))).compile()

    def host_chunk_avals(self):
        return tuple(jax.ShapeDtypeStruct(g.staging_shape(self.bpc), g.dtype, sharding=s)
                     for g, s in zip(self.layout.groups, self.host_chunk_sh))

    def _chunk_aval(self):
        return tuple(jax.ShapeDtypeStruct(g.staging_shape(self.bpc), g.dtype, sharding=s)
                     for g, s in zip(self.layout.groups, self.chunk_sh))

    def _build_take_chunk(self):
        bpc = self.bpc

        def take(staging, pos):
            return tuple(lax.dynamic_slice_in_dim(st, pos[0] * bpc, bpc, axis=0) for st in staging)

        return jax.jit(take, out_shardings=self.chunk_sh).lower(self._staging_aval(), self._ints(1)).compile()

    def _build_put_chunk(self, group: int):
        bpc = self.bpc

        def put(staging, chunk, pos):
            return lax.dynamic_update_slice_in_dim(staging, chunk, pos[0] * bpc, axis=0)

        jitted = jax.jit(put, donate_argnums=(0,), out_shardings=self._staging_sh[group])
        return jitted.lower(self._staging_aval()[group], self._chunk_aval()[group], self._ints(1)).compile()

    # ---- allocation -------------------------------------------------------
    def alloc_staging(self):
        avals = self._staging_aval()
        make = jax.jit(lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in avals),
                       out_shardings=tuple(a.sharding for a in avals))
        return make()

    def alloc_slabs(self):
        return self._slab_allocator()()

    def _slab_allocator(self):
        return self._get(("alloc_slabs",), self._build_slab_allocator)

    def _build_slab_allocator(self):
        """Zero-filled host slabs made where they live: one zero row put to host memory and broadcast
        there, so no HBM (a plain ``jnp.zeros`` with a host out-sharding fills the whole slab on HBM
        first: 2 GiB of scratch per device for one 16 GiB slab on TPU7x) and no numpy copy."""
        avals = self._slabs_aval()

        def make():
            out = []
            for per_group in avals:
                group = []
                for a in per_group:
                    row = jax.device_put(jnp.zeros((1, *a.shape[1:]), a.dtype), a.sharding)
                    group.append(jnp.broadcast_to(row, a.shape))
                out.append(tuple(group))
            return tuple(out)

        shardings = jax.tree.map(lambda a: a.sharding, avals)
        return jax.jit(make, out_shardings=shardings).lower().compile()


def _arrays(layout: KVLayout) -> tuple:
    """Per runner cache array, the first group holding it (every group that holds it sees the same array)."""
    by_array: dict[int, object] = {}
    for g in layout.groups:
        for a in g.layers:
            by_array.setdefault(a, g)
    if sorted(by_array) != list(range(layout.num_layers)):
        raise ValueError(f"the layout's groups cover cache arrays {sorted(by_array)}, not 0..{layout.num_layers - 1}")
    return tuple(by_array[a] for a in range(layout.num_layers))


def _local_id(c, g, block_id):
    """This device's index of global block ``block_id`` and whether it holds it. With DP attention
    (``g.block_axes``) rank r's devices hold blocks [r * n, (r + 1) * n) of the cache, n = its local rows."""
    if not g.block_axes:
        return block_id, None
    n = c.shape[0]
    local = block_id - lax.axis_index(g.block_axes) * n
    return jnp.clip(local, 0, n - 1), (local >= 0) & (local < n)


def _read_block(c, g, block_id):
    """(1, *local block) of global block ``block_id``, on every device. Under DP attention the owning
    rank's bytes reach the other ranks by an integer all-reduce with zeros: exact for any dtype."""
    local, mine = _local_id(c, g, block_id)
    block = lax.dynamic_index_in_dim(c, local, 0, keepdims=True)
    if mine is None:
        return block
    bits = lax.bitcast_convert_type(block, _bits(block.dtype))
    bits = lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), g.block_axes)
    return lax.bitcast_convert_type(bits, block.dtype)


def _write_block(c, g, block_id, piece, at):
    """``c`` with ``piece`` at global block ``block_id`` (offsets ``at`` inside it); under DP attention
    only the owning rank's devices change."""
    local, mine = _local_id(c, g, block_id)
    at = (local, *at)
    if mine is not None:
        piece = jnp.where(mine, piece, lax.dynamic_slice(c, at, piece.shape))
    return lax.dynamic_update_slice(c, piece, at)


def _replica_slices(piece, g, as_bits: bool):
    """The ``replicas`` slices of this device's shard of one block, with their offsets along ``split_dim``.

    Replicas are consecutive shards of the head axes (repeated heads) or the
    devices along the axes MLA's latent cache is copied over, and each kept
    one slice (see layout.py); ``replicas - 1`` ring shifts inside each group move only
    the missing slices (a full all-gather over the head axes would move every
    group's bytes to every device). Each slice is written at its own dynamic
    offset, so nothing is reordered or concatenated on the device.
    """
    r, h = g.replicas, g.rep_size
    j = lax.axis_index(g.rep_axes) % r
    t = g.piece_shape[g.split_dim]
    raw = lax.bitcast_convert_type(piece, _bits(piece.dtype)) if as_bits else piece
    out = [(piece, j * t)]  # received from k shifts back: the slice of replica (j - k) mod r
    for k in range(1, r):
        perm = [(i, i // r * r + (i % r + k) % r) for i in range(h)]
        got = lax.ppermute(raw, g.rep_axes, perm)
        got = lax.bitcast_convert_type(got, piece.dtype) if as_bits else got
        out.append((got, ((j - k) % r) * t))
    return out


def _bits(dtype):
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def collectives_as_bits(layout: KVLayout) -> bool:
    """The one place the CPU and TPU programs differ. XLA:CPU's collective-permute of bf16 goes
    through f32 and quiets NaN payloads (0x7fbf -> 0x7fc0), so on CPU the replicas' slices cross
    as raw bits (one block's slice, never a cache). On TPU the permute is a plain DMA, and the
    extra reinterpretation would cost the scatter 1x more HBM traffic (the TPU compiler's figure)."""
    return layout.program_mesh.devices.flat[0].platform == "cpu"


def ints(values, n: int, fill: int) -> np.ndarray:
    """An int32 vector of length ``n``: ``values`` then ``fill``."""
    out = np.full(n, fill, dtype=np.int32)
    out[: len(values)] = values
    return out
