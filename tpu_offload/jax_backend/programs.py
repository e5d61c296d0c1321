"""The four compiled programs that move KV.

* ``gather``  paged caches -> staging (donates staging): one step's blocks, all layers.
* ``scatter`` staging -> paged caches (donates the caches).

Both run per device (``shard_map``) on its own shards; the only traffic
between devices is the scatter's rebuild of replicated heads (see layout.py).
* ``store``   staging -> host slabs (donates the slabs): one batched D2H.
* ``load``    host slabs -> staging (donates staging): one batched H2D.

On TPU, ``gather`` and ``scatter`` are Pallas kernels of DMAs (dma.py): one
DMA per (layer, run of adjacent blocks), all in flight at once, no
TensorCore loop over blocks. The ``loop`` kernel below is what CPU runs by
default (the DMA kernel runs there too, in TPU interpret mode, for tests).

The ``loop`` programs and store/load loop over a dynamic count (blocks or chunks) and move one
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

from tpu_offload.jax_backend import dma
from tpu_offload.jax_backend.layout import KVLayout, _divided

KERNELS = ("dma", "loop")


class Programs:
    """Builds and caches the compiled transfer programs for one layout."""

    def __init__(self, layout: KVLayout, *, staging_blocks: int, blocks_per_chunk: int,
                 slab_rows: tuple[int, ...], memory_kind: str, kernel: str | None = None):
        """``kernel``: how gather/scatter move blocks: ``dma`` (the Pallas kernel; interpreted on CPU)
        or ``loop`` (XLA ops, one block per trip). Default: ``dma`` on TPU, ``loop`` elsewhere."""
        self.layout = layout
        self.platform = layout.program_mesh.devices.flat[0].platform
        ranks = max(g.ranks for g in layout.groups)
        chunks = staging_blocks // blocks_per_chunk
        if kernel is None:
            kernel = default_kernel(self.platform, layout) if chunks % ranks == 0 else "loop"
        if kernel not in KERNELS:
            raise ValueError(f"transfer kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        if kernel == "dma" and chunks % ranks:
            raise ValueError(f"transfer kernel 'dma': {chunks} staging chunks do not divide over the {ranks} "
                             "attention-DP ranks (each rank stages its blocks on its own devices); set "
                             f"TPU_OFFLOAD_NUM_STAGING_BLOCKS to a multiple of {ranks * blocks_per_chunk}")
        if kernel == "dma" and self.platform == "tpu" and not dma_sliceable(layout):
            raise ValueError("transfer kernel 'dma': a replica's slice of a block lies along a tiled dimension "
                             f"(block shapes {[g.block_shape for g in layout.groups]}), which a TPU DMA cannot "
                             "address; use the 'loop' kernel (TPU_OFFLOAD_TRANSFER_KERNEL=loop)")
        self.kernel = kernel
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
        """(caches, staging, *block_args(moves, "gather")) -> staging: per group g, block ids[g][i]
        to staging position pos[g][i]."""
        build = self._build_gather_dma if self.kernel == "dma" else self._build_gather
        return self._get(("gather",), build)

    def scatter(self) -> Callable:
        """(caches, staging, *block_args(moves, "scatter")) -> (caches, done): per group g,
        staging[pos[g][i]] to block ids[g][i]."""
        build = self._build_scatter_dma if self.kernel == "dma" else self._build_scatter
        return self._get(("scatter",), build)

    def block_args(self, moves, name: str) -> tuple:
        """The index operands of ``gather``/``scatter`` (``name``) for ``moves``: per group, (cache
        block ids, staging positions) of the blocks it moves."""
        n = self.staging_blocks
        if self.kernel == "loop":
            return (tuple(ints(ids, n, 0) for ids, _ in moves), tuple(ints(pos, n, 0) for _, pos in moves),
                    ints([len(ids) for ids, _ in moves], len(moves), 0))
        ops = []
        for g, (ids, pos) in zip(self.layout.groups, moves):
            if g.ranks == 1:
                ops.append(dma.run_operands(self._runs(ids, pos, name), n))
            else:  # one row per rank: its own runs, in its devices' block ids and its share of staging
                per = [dma.run_operands(r, n // g.ranks) for r in self._rank_runs(g, ids, pos, name)]
                ops.append(tuple(np.stack([o[k] for o in per]) for k in range(4)))
        return tuple(tuple(o[k] for o in ops) for k in range(4))

    def dma_count(self, moves, name: str) -> int:
        """DMAs one ``gather``/``scatter`` call issues for ``moves`` (0 for the loop kernel): one per
        (layer, coalesced run), and the scatter's once per replica slice. Under DP attention, what one
        device of each rank issues, summed over the ranks."""
        if self.kernel != "dma":
            return 0
        total = 0
        for g, (ids, pos) in zip(self.layout.groups, moves):
            runs = sum(len(r) for r in self._rank_runs(g, ids, pos, name)) if g.ranks > 1 else \
                len(self._runs(ids, pos, name))
            reps = 1 if name == "gather" else (g.rank_replicas if g.ranks > 1 else g.replicas)
            parts = g.ranks if g.ranks > 1 and _parts(g) else 1  # a DMA per rank's part of a slice
            total += runs * len(g.layers) * reps * parts
        return total

    @staticmethod
    def _runs(ids, pos, name: str) -> np.ndarray:
        return dma.coalesce(ids, pos) if name == "gather" else dma.coalesce(pos, ids)

    def rank_chunks(self, g) -> int:
        """Staging chunks each attention-DP rank owns: rank r stages at chunks [r * k, (r + 1) * k)."""
        return self.staging_chunks // g.ranks

    def _rank_runs(self, g, ids, pos, name: str) -> list[np.ndarray]:
        """Per rank, the runs of its blocks in its own numbering: its devices' cache rows (global id less
        the rank's first block) and its share of staging (position less the share's first)."""
        ids, pos = np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        per_rank, share = self.layout.num_blocks // g.ranks, self.staging_blocks // g.ranks
        rank = ids // per_rank
        bad = np.flatnonzero(pos // share != rank)
        if bad.size:
            i = bad[0]
            raise ValueError(f"block {ids[i]} (attention-DP rank {rank[i]}) at staging position {pos[i]}, in rank "
                             f"{pos[i] // share}'s share: the DMA kernel stages each rank's blocks on its own devices")
        return [self._runs(ids[rank == r] - r * per_rank, pos[rank == r] - r * share, name) for r in range(g.ranks)]

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

    def take_chunks(self) -> Callable:
        """(staging) -> per group, every staging chunk as its own array, (bpc, layers, *piece): what one
        batched ``device_put`` per pass sends to host (one program per pass, never per chunk)."""
        return self._get(("take_chunks",), self._build_take_chunks)

    def put_chunks(self, group: int = 0) -> Callable:
        """(staging of ``group``, staging_chunks chunk arrays, pos[staging_chunks]) -> that staging
        (donated): chunk k written at staging chunk pos[k]. The chunks one batched ``device_put``
        brought back; a pass with fewer repeats its first (chunk, pos) pair. One per group: a load
        brings back only the groups it needs."""
        return self._get(("put_chunks", group), self._build_put_chunks, group)

    def all_programs(self, path: str = "program") -> dict[str, Callable]:
        """Every transfer program ``path`` uses, compiled (what precompile builds and the HBM check measures)."""
        if path == "device_put":
            out = {"gather": self.gather(), "scatter": self.scatter(), "take_chunks": self.take_chunks(),
                   "put_chunks": self.put_chunks()}
            out.update({f"put_chunks_{gi}": self.put_chunks(gi) for gi in range(1, len(self.layout.groups))})
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
        mesh_shape = dict(self.layout.mesh.shape)

        def scatter_local(caches, staging, ids, pos, count):
            caches = list(caches)
            for gi, (g, st) in enumerate(zip(groups, staging)):
                zeros = (0,) * len(g.piece_shape)

                def write(offset, source, layers, g=g, gi=gi, zeros=zeros):
                    """Each block's piece of ``source`` into its cache block, at ``offset`` along the split
                    dim (a replica's slice), sliced straight out of ``source``: no copy of the row."""
                    inner = tuple(offset[0] if d == g.split_dim else 0 for d in range(len(zeros)))

                    def body(i, layers):  # under DP attention only the owning rank's devices write
                        return tuple(
                            _write_block(
                                c, g, ids[gi][i],
                                lax.dynamic_slice(source, (pos[gi][i], li, *zeros), (1, 1, *g.piece_shape))[:, 0],
                                inner)
                            for li, c in enumerate(layers))

                    return lax.fori_loop(0, count[gi], body, tuple(layers))

                layers = tuple(caches[a] for a in g.layers)
                if g.replicas > 1:  # the whole head shard: the ring runs once per pass, outside the loop
                    new = _scatter_replicas(lambda off, src, lay: write(off, src, lay), st, layers, g, as_bits,
                                            mesh_shape)
                else:
                    new = write(jnp.zeros((1,), jnp.int32), st, layers)

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

    def _gp(self):
        """The DMA operands' specs per group: replicated, or one row per attention-DP rank on its devices."""
        return tuple(P(g.block_axes) if g.ranks > 1 else P() for g in self.layout.groups)

    def _dma_avals(self):
        n, out = self.staging_blocks, []
        for g in self.layout.groups:
            if g.ranks == 1:
                out.append((self._ints(1),) + (self._ints(n),) * 3)
            else:
                sh = self.layout.sharding(g.block_axes)
                row = lambda k: jax.ShapeDtypeStruct((g.ranks, k), jnp.int32, sharding=sh)
                out.append((row(1),) + (row(n // g.ranks),) * 3)
        return tuple(tuple(o[k] for o in out) for k in range(4))

    def _build_gather_dma(self):
        groups, platform, as_bits = self.layout.groups, self.platform, collectives_as_bits(self.layout)

        def gather_local(caches, staging, count, src, dst, length):
            out = []
            for gi, (g, st) in enumerate(zip(groups, staging)):
                layers = [caches[a] for a in g.layers]
                if g.ranks > 1:
                    out.append(_gather_ranks(g, layers, st, count[gi][0], src[gi][0], dst[gi][0], length[gi][0],
                                             platform, as_bits))
                    continue
                split, offset = _replica_split(g)
                call = dma.gather_call(len(g.layers), st.shape, st.dtype, platform, split)
                out.append(call(count[gi], src[gi], dst[gi], length[gi], offset, layers, st))
            return tuple(out)

        gp = self._gp()
        body = self._local(gather_local, (self._cache_specs(), self._staging_specs(), gp, gp, gp, gp),
                           self._staging_specs())
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=self._staging_sh)
        return jitted.lower(self._caches_aval(), self._staging_aval(), *self._dma_avals()).compile()

    def _build_scatter_dma(self):
        groups, platform = self.layout.groups, self.platform
        as_bits = collectives_as_bits(self.layout)
        mesh_shape = dict(self.layout.mesh.shape)

        def scatter_local(caches, staging, count, src, dst, length):
            caches = list(caches)
            counts = []
            for gi, (g, st) in enumerate(zip(groups, staging)):
                layers = [caches[a] for a in g.layers]
                args = (count[gi], src[gi], dst[gi], length[gi])
                if g.ranks > 1:  # this rank's blocks back from every device's slices: one all-to-all per pass
                    args = tuple(a[0] for a in args)
                    st = _to_ranks(g, st, as_bits)
                    size = g.local_block_shape[g.split_dim] // g.rank_replicas  # a copy's slice
                    if _parts(g):
                        split, parts = (g.split_dim, size // g.ranks), g.ranks
                    else:
                        split, parts = (None if g.rank_replicas == 1 else (g.split_dim, size)), 1
                    call = dma.scatter_call(len(g.layers), layers[0].shape, layers[0].dtype, platform, split, parts)
                    if g.rank_replicas == 1:
                        layers = call(*args, jnp.zeros((1,), jnp.int32), st, layers)
                    else:  # and the rank's copies' slices, one ring shift per copy
                        layers = _scatter_replicas(lambda off, src, lay: call(*args, off, src, lay), st, layers, g,
                                                   as_bits, mesh_shape,
                                                   ring=(g.rank_axes, g.rank_replicas, g.rank_replicas, size))
                elif g.replicas == 1:
                    call = dma.scatter_call(len(g.layers), layers[0].shape, layers[0].dtype, platform)
                    layers = call(*args, jnp.zeros((1,), jnp.int32), st, layers)
                else:  # every replica's slices, one ring shift per replica: once per pass, never per block
                    split, _ = _replica_split(g)
                    call = dma.scatter_call(len(g.layers), layers[0].shape, layers[0].dtype, platform, split)
                    layers = _scatter_replicas(lambda off, src, lay: call(*args, off, src, lay), st, layers, g,
                                               as_bits, mesh_shape)
                counts.append(args[0])
                for a, arr in zip(g.layers, layers):
                    caches[a] = arr
            return tuple(caches), jnp.concatenate(counts)

        gp = self._gp()
        body = self._local(scatter_local, (self._cache_specs(), self._staging_specs(), gp, gp, gp, gp),
                           (self._cache_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(self._cache_sh, self._rep))
        return jitted.lower(self._caches_aval(), self._staging_aval(), *self._dma_avals()).compile()

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

    def _build_take_chunks(self):
        bpc, k = self.bpc, self.staging_chunks

        def take(staging):
            return tuple(tuple(lax.slice_in_dim(st, i * bpc, (i + 1) * bpc, axis=0) for i in range(k)) for st in staging)

        out_sh = tuple((sh,) * k for sh in self.chunk_sh)
        return jax.jit(take, out_shardings=out_sh).lower(self._staging_aval()).compile()

    def _build_put_chunks(self, group: int):
        bpc, k = self.bpc, self.staging_chunks

        def put(staging, chunks, pos):
            for i, chunk in enumerate(chunks):
                staging = lax.dynamic_update_slice_in_dim(staging, chunk, pos[i] * bpc, axis=0)
            return staging

        jitted = jax.jit(put, donate_argnums=(0,), out_shardings=self._staging_sh[group])
        return jitted.lower(self._staging_aval()[group], (self._chunk_aval()[group],) * k, self._ints(k)).compile()

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


def _replica_split(g):
    """(split, offset) for the DMA kernels: this device's slice of a block, ``(dim, size)``, and its
    offset along that dim as a (1,) operand; (None, 0) without replicas."""
    if g.replicas == 1:
        return None, jnp.zeros((1,), jnp.int32)
    t = g.piece_shape[g.split_dim]
    j = lax.axis_index(g.rep_axes) % g.replicas
    return (g.split_dim, t), jnp.reshape(j * t, (1,)).astype(jnp.int32)


def _gather_ranks(g, layers, staging, n, src, dst, length, platform: str, as_bits: bool):
    """DP attention's gather on one device: its rank's blocks (its copy's slice of each, when a rank's
    devices hold copies) DMA'd into a buffer of the rank's share of staging, then one all-to-all over
    the ranks spreads every block's slices to their places in staging (piece index: copy major, rank
    minor, layout.py): rank r's blocks land at staging positions [r * share, (r + 1) * share).

    Where the slices lie along an untiled dimension (``_parts``), the DMAs write each rank's part to
    its own leading index, the layout the all-to-all sends as it is; else the kernel copies whole
    (copy-sliced) blocks and XLA relays them for the all-to-all (one more buffer and HBM pass)."""
    m, d = g.rank_replicas, g.ranks
    size = g.local_block_shape[g.split_dim] // m  # this copy's slice of a block
    offset = jnp.reshape(lax.axis_index(g.rank_axes) * size if m > 1 else 0, (1,)).astype(jnp.int32)
    share = (staging.shape[0] // d, len(g.layers))
    if _parts(g):
        call = dma.gather_call(len(g.layers), (d, *share, *g.piece_shape), staging.dtype, platform,
                               (g.split_dim, size // d), fresh=True, parts=d)
        split, concat = 0, 0
    else:
        split = None if m == 1 else (g.split_dim, size)
        call = dma.gather_call(len(g.layers), (*share, *_divided(g.local_block_shape, g.split_dim, m)),
                               staging.dtype, platform, split, fresh=True)
        split, concat = 2 + g.split_dim, 0
    mine = call(n, src, dst, length, offset, layers)
    raw = lax.bitcast_convert_type(mine, _bits(mine.dtype)) if as_bits else mine
    out = lax.all_to_all(raw, g.block_axes, split, concat, tiled=True)
    out = lax.bitcast_convert_type(out, staging.dtype) if as_bits else out
    return jnp.reshape(out, staging.shape)


def _to_ranks(g, staging, as_bits: bool):
    """The inverse of ``_gather_ranks``'s all-to-all: each rank's share of staging on that rank's devices,
    as the parts of its copy's slice of each block (``_parts``: one leading index per part) or whole."""
    raw = lax.bitcast_convert_type(staging, _bits(staging.dtype)) if as_bits else staging
    if _parts(g):
        raw = jnp.reshape(raw, (g.ranks, staging.shape[0] // g.ranks, *staging.shape[1:]))
        out = lax.all_to_all(raw, g.block_axes, 0, 0, tiled=True)
    else:
        out = lax.all_to_all(raw, g.block_axes, 0, 2 + g.split_dim, tiled=True)
    return lax.bitcast_convert_type(out, staging.dtype) if as_bits else out


def _parts(g) -> bool:
    """Whether a DP group's slices lie along an untiled block dimension (a DMA addresses any offset)."""
    return g.split_dim < len(g.block_shape) - 2


def _scatter_replicas(write, staging, layers, g, as_bits: bool, mesh_shape, ring=None):
    """Write every replica's slices of the pass into ``layers`` (the whole head shard, or MLA's
    whole copy), each with one ``write(offset, source, layers)``.

    Replicas are consecutive shards of the head axes (repeated heads) or the
    devices along the axes MLA's latent cache is copied over, and each kept
    one slice of every block (see layout.py). This device's own slices come
    from its staging; ``replicas - 1`` ring shifts of the whole staging buffer
    within each group of replicas bring the others (shift k: the slices of
    replica (j - k) mod r), once per pass, never per block (a full all-gather
    over the head axes would move every group's bytes to every device). Each
    shift waits (optimization barrier) for the previous write, so one
    received buffer is live at a time: one staging buffer of HBM scratch. ``ring``: (axes, replicas,
    devices along the axes, slice size) when not the group's own (a DP rank's copies). ``mesh_shape``:
    the mesh's axis sizes, in its order."""
    axes, r, h, size = ring or (g.rep_axes, g.replicas, g.rep_size, g.piece_shape[g.split_dim])
    split_offset = lambda k: jnp.reshape(((lax.axis_index(axes) % r - k) % r) * size, (1,)).astype(jnp.int32)
    layers = write(split_offset(0), staging, layers)
    raw = lax.bitcast_convert_type(staging, _bits(staging.dtype)) if as_bits else staging
    for k in range(1, r):
        raw, layers = lax.optimization_barrier((raw, tuple(layers)))
        got = lax.ppermute(raw, *_ring(axes, mesh_shape, [(i, i // r * r + (i % r + k) % r) for i in range(h)]))
        got = lax.bitcast_convert_type(got, staging.dtype) if as_bits else got
        layers = write(split_offset(k), got, layers)
    return layers


def _ring(axes: tuple, mesh_shape: dict, pairs: list) -> tuple:
    """``(axes, pairs)`` for ``ppermute``, with ``pairs`` given as linear indices over ``axes`` in
    their own order, restated over the same axes in mesh order (which ppermute requires; DP
    attention's replica axes put the ranks' axes last, layout.py)."""
    ordered = tuple(a for a in mesh_shape if a in axes)
    if ordered == tuple(axes):
        return axes, pairs
    sizes = [mesh_shape[a] for a in axes]
    coords = list(np.ndindex(*sizes))  # by linear index over ``axes``
    where = lambda c: int(np.ravel_multi_index([c[axes.index(a)] for a in ordered],
                                               [mesh_shape[a] for a in ordered]))
    return ordered, [(where(coords[i]), where(coords[j])) for i, j in pairs]


def default_kernel(platform: str, layout: KVLayout | None = None) -> str:
    """``dma`` where a TPU runs it; ``loop`` elsewhere (the DMA kernel is interpreted on CPU, slowly)
    and where a TPU DMA cannot address a replica's slice (``dma_sliceable``)."""
    return "dma" if platform == "tpu" and (layout is None or dma_sliceable(layout)) else "loop"


def dma_sliceable(layout: KVLayout) -> bool:
    """Whether every group's replica slice lies along a dimension a TPU DMA can slice at any offset.
    HBM arrays are tiled over their last two dimensions, and a DMA's offsets there must be whole
    tiles: MLA's latent cache (4, 32, 640) per 128-token page, split 8 ways at TP 8, keeps 4 of 32
    rows, a part of an 8-row tile (the TPU compiler refuses that kernel). Under DP attention the
    kernel slices only by a rank's own copies (none at one device per rank: DeepSeek-V3 at DP 8);
    the all-to-all over the ranks does the rest."""
    return all((g.rank_replicas if g.ranks > 1 else g.replicas) == 1 or g.split_dim < len(g.block_shape) - 2
               for g in layout.groups)


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
