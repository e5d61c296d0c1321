"""The four compiled programs that move KV, and the shape buckets they use.

* ``gather``  paged caches -> staging (donates staging): one step's blocks, all layers.
* ``scatter`` staging -> paged caches (donates the caches).

Both run per device (``shard_map``) on its own shards; the only traffic
between devices is the scatter's rebuild of replicated heads (see layout.py).
* ``store``   staging -> host slabs (donates the slabs): one batched D2H.
* ``load``    host slabs -> staging (donates staging): one batched H2D.

``gather``/``scatter`` take a block-id vector whose length is a bucket
(powers of two up to the staging size); ``store``/``load`` loop over a
dynamic chunk count, so they compile once. Every program is compiled ahead
of time (``lower().compile()``): a call with an unexpected shape raises
instead of silently recompiling mid-serving.
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


def make_buckets(staging_blocks: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Powers of two up to ``staging_blocks``, plus ``staging_blocks`` and any extras below it."""
    out = {staging_blocks}
    b = 1
    while b < staging_blocks:
        out.add(b)
        b *= 2
    out.update(x for x in extra if 0 < x <= staging_blocks)
    return tuple(sorted(out))


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} blocks exceed the staging buffer ({buckets[-1]} blocks)")


class Programs:
    """Builds and caches the compiled transfer programs for one layout."""

    def __init__(self, layout: KVLayout, *, staging_blocks: int, blocks_per_chunk: int,
                 slab_rows: tuple[int, ...], memory_kind: str, buckets: tuple[int, ...]):
        self.layout = layout
        self.staging_blocks = staging_blocks
        self.bpc = blocks_per_chunk
        self.staging_chunks = staging_blocks // blocks_per_chunk
        self.slab_rows = slab_rows
        self.memory_kind = memory_kind
        self.buckets = buckets
        self.compiles = 0  # programs compiled so far (tests assert it stops growing)
        self._cache: dict[tuple, Callable] = {}
        self._lock = threading.Lock()
        g0 = layout.groups
        self._staging_sh = tuple(layout.staging_sharding(g) for g in g0)
        self._slab_sh = tuple(layout.slab_sharding(g, memory_kind) for g in g0)
        self._slab_dev_sh = tuple(layout.slab_sharding(g, "device") for g in g0)
        self._cache_sh = tuple(tuple(g.cache_sharding for _ in g.layers) for g in g0)  # the runner's own
        self._cache_in_sh = tuple(layout.sharding(*g.cache_spec) for g in g0)  # the same on program_mesh
        self._rep = layout.replicated()

    # ---- abstract values ----------------------------------------------
    def _caches_aval(self):
        return tuple(
            tuple(jax.ShapeDtypeStruct((self.layout.num_blocks, *g.block_shape), g.dtype, sharding=s)
                  for _ in g.layers)
            for g, s in zip(self.layout.groups, self._cache_in_sh)
        )

    def _staging_aval(self):
        return tuple(
            jax.ShapeDtypeStruct(g.staging_shape(self.staging_blocks), g.bits, sharding=s)
            for g, s in zip(self.layout.groups, self._staging_sh)
        )

    def _slabs_aval(self):
        return tuple(
            tuple(jax.ShapeDtypeStruct(g.slab_shape(r, self.bpc), g.bits, sharding=s) for r in self.slab_rows)
            for g, s in zip(self.layout.groups, self._slab_sh)
        )

    def _ints(self, n: int):
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._rep)

    # ---- public: compiled programs --------------------------------------
    def gather(self, n: int) -> Callable:
        return self._get(("gather", n), self._build_gather, n)

    def scatter(self, n: int) -> Callable:
        return self._get(("scatter", n), self._build_scatter, n)

    def store(self) -> Callable:
        return self._get(("store",), self._build_store)

    def load(self) -> Callable:
        return self._get(("load",), self._build_load)

    def precompile(self) -> None:
        for n in self.buckets:
            self.gather(n)
            self.scatter(n)
        self.store()
        self.load()

    def scratch_bytes(self) -> int:
        """Per-device temporary HBM of the largest transfer program (compiles those programs)."""
        top = self.buckets[-1]
        progs = (self.gather(top), self.scatter(top), self.store(), self.load())
        return max(int(p.memory_analysis().temp_size_in_bytes) for p in progs)

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

    def _build_gather(self, n: int):
        groups = self.layout.groups

        def gather_local(caches, staging, ids):
            out = []
            for g, layers, st in zip(groups, caches, staging):
                rows = jnp.stack([lax.bitcast_convert_type(c, g.bits)[ids].reshape(n, g.local_elems)
                                  for c in layers], axis=1)  # (n, layers, local_elems)
                if g.replicas > 1:  # keep only this device's slice of a head its replicas also hold
                    j = lax.axis_index(g.head_axes) % g.replicas
                    rows = lax.dynamic_slice_in_dim(rows, j * g.piece, g.piece, axis=2)
                out.append(lax.dynamic_update_slice_in_dim(st, rows, 0, axis=0))
            return tuple(out)

        body = self._local(gather_local, (self._cache_specs(), self._staging_specs(), P()), self._staging_specs())
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=self._staging_sh)
        return jitted.lower(self._caches_aval(), self._staging_aval(), self._ints(n)).compile()

    def _build_scatter(self, n: int):
        groups = self.layout.groups

        def scatter_local(caches, staging, ids):
            out = []
            for g, layers, st in zip(groups, caches, staging):
                rows = st[:n]  # (n, layers, piece)
                if g.replicas > 1:
                    rows = _gather_replicas(rows, g)  # (n, layers, local_elems)
                rows = lax.bitcast_convert_type(rows, g.dtype)
                out.append(tuple(
                    c.at[ids].set(rows[:, i].reshape(n, *g.local_block_shape), mode="drop", unique_indices=True)
                    for i, c in enumerate(layers)
                ))
            return tuple(out), jnp.sum(ids >= 0, dtype=jnp.int32)

        body = self._local(scatter_local, (self._cache_specs(), self._staging_specs(), P()), (self._cache_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(self._cache_sh, self._rep))
        return jitted.lower(self._caches_aval(), self._staging_aval(), self._ints(n)).compile()

    def _cache_specs(self):
        return tuple(tuple(P(*g.cache_spec) for _ in g.layers) for g in self.layout.groups)

    def _staging_specs(self):
        return tuple(P(*self.layout.staging_spec(g)) for g in self.layout.groups)

    def _build_store(self):
        bpc, groups = self.bpc, self.layout.groups
        slab_sh, k = self._slab_sh, len(self.slab_rows)

        def store(slabs, staging, rows, src, bounds):
            slabs = [list(per_group) for per_group in slabs]
            done = jnp.int32(0)
            for s in range(k):
                def body(j, carry, s=s):
                    sl, cnt = carry
                    new = []
                    for gi, g in enumerate(groups):
                        chunk = lax.dynamic_slice_in_dim(staging[gi], src[j] * bpc, bpc, axis=0)[None]
                        chunk = jax.device_put(chunk, slab_sh[gi])
                        new.append(lax.dynamic_update_slice_in_dim(sl[gi], chunk, rows[j], axis=0))
                    return tuple(new), cnt + 1

                cur = tuple(slabs[gi][s] for gi in range(len(groups)))
                cur, done = lax.fori_loop(bounds[s], bounds[s + 1], body, (cur, done))
                for gi in range(len(groups)):
                    slabs[gi][s] = cur[gi]
            return tuple(tuple(x) for x in slabs), done

        jitted = jax.jit(store, donate_argnums=(0,), out_shardings=(slab_sh_tree(slab_sh, k), self._rep))
        c = self.staging_chunks
        return jitted.lower(self._slabs_aval(), self._staging_aval(), self._ints(c), self._ints(c),
                            self._ints(k + 1)).compile()

    def _build_load(self):
        bpc, groups = self.bpc, self.layout.groups
        st_sh, dev_sh, k = self._staging_sh, self._slab_dev_sh, len(self.slab_rows)

        def load(staging, slabs, rows, dst, bounds):
            staging = tuple(staging)
            done = jnp.int32(0)
            for s in range(k):
                def body(j, carry, s=s):
                    st, cnt = carry
                    new = []
                    for gi, g in enumerate(groups):
                        chunk = lax.dynamic_slice_in_dim(slabs[gi][s], rows[j], 1, axis=0)
                        chunk = jax.device_put(chunk, dev_sh[gi])[0]
                        new.append(lax.dynamic_update_slice_in_dim(st[gi], chunk, dst[j] * bpc, axis=0))
                    return tuple(new), cnt + 1

                staging, done = lax.fori_loop(bounds[s], bounds[s + 1], body, (staging, done))
            return staging, done

        jitted = jax.jit(load, donate_argnums=(0,), out_shardings=(st_sh, self._rep))
        c = self.staging_chunks
        return jitted.lower(self._staging_aval(), self._slabs_aval(), self._ints(c), self._ints(c),
                            self._ints(k + 1)).compile()

    # ---- allocation -------------------------------------------------------
    def alloc_staging(self):
        return self._alloc(self._staging_aval())

    def alloc_slabs(self):
        return self._alloc(self._slabs_aval())

    @staticmethod
    def _alloc(avals):
        """Zero-filled buffers made where they live (no host-side numpy copy)."""
        shardings = jax.tree.map(lambda a: a.sharding, avals)
        make = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals), out_shardings=shardings)
        return make()


def _gather_replicas(piece, g):
    """Rebuild a device's whole head shard from the ``replicas`` devices that each kept a slice.

    Replicas are consecutive shards of the head axes; ``replicas - 1`` ring
    shifts inside each group move only the missing slices (a full all-gather
    over the head axes would move every group's bytes to every device).
    """
    r, h = g.replicas, g.head_shards
    j = lax.axis_index(g.head_axes) % r
    received = [piece]  # received[k] is the slice of replica (j - k) mod r
    for k in range(1, r):
        perm = [(i, i // r * r + (i % r + k) % r) for i in range(h)]
        received.append(lax.ppermute(piece, g.head_axes, perm))
    stacked = jnp.stack(received)  # (r, n, layers, piece)
    ordered = jnp.take(stacked, (j - jnp.arange(r)) % r, axis=0)  # by replica index
    n, layers, size = piece.shape
    return jnp.moveaxis(ordered, 0, 2).reshape(n, layers, r * size)


def slab_sh_tree(slab_sh, k: int):
    return tuple(tuple(s for _ in range(k)) for s in slab_sh)


def ints(values, n: int, fill: int) -> np.ndarray:
    """An int32 vector of length ``n``: ``values`` then ``fill``."""
    out = np.full(n, fill, dtype=np.int32)
    out[: len(values)] = values
    return out
