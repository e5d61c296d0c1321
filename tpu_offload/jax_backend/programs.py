"""The four compiled programs that move KV.

* ``gather``  paged caches -> staging (donates staging): one step's blocks, all layers.
* ``scatter`` staging -> paged caches (donates the caches).

Both run per device (``shard_map``) on its own shards; the only traffic
between devices is the scatter's rebuild of replicated heads (see layout.py).
Under DP attention each rank moves its own blocks between its own devices
and its own host memory; only a load into another rank crosses (ranks.py).
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
from jax.sharding import NamedSharding, PartitionSpec as P

from tpu_offload.jax_backend import direct_dma, dma, host_dma, ranks, xla_kernel
from tpu_offload.jax_backend.collectives import bits, collectives_as_bits, ring
from tpu_offload.jax_backend.layout import KVLayout, _divided

KERNELS = ("dma", "loop", "xla")
# Why the host copies stay the loop programs by default on TPU, where host_dma.py's kernels compile to 3x
# per pass (tests/tpu_compiler/test_host_copy_kernel.py): their slabs are u8 (32, 128) tiles, and a zero
# row broadcast in host memory comes out in the (8, 128) tile, so the slab allocator relays the whole tier
# through HBM (94 GB per device for the 720 GiB Qwen3-32B tier on TPU7x; the direct path's allocator
# alike), which the start-up HBM check refuses.
HOST_COPY_DEFAULT = ("the default: its u8 4 KiB-tiled slabs cannot yet be zero-filled without relaying the "
                     "tier through HBM")


class Programs:
    """Builds and caches the compiled transfer programs for one layout."""

    def __init__(self, layout: KVLayout, *, staging_blocks: int, blocks_per_chunk: int,
                 slab_rows: tuple[int, ...], memory_kind: str, kernel: str | None = None,
                 host_copy: str | None = None):
        """``kernel``: how gather/scatter move blocks: ``dma`` (the Pallas kernel; interpreted on CPU)
        or ``loop`` (XLA ops, one block per trip). Default: ``dma`` on TPU, ``loop`` elsewhere.
        ``host_copy``: how store/load move chunks between staging and the slabs: ``dma`` (host_dma.py, TPU
        only, refused with the reason where it cannot run) or ``loop`` (the default, ``HOST_COPY_DEFAULT``)."""
        self.layout = layout
        self.platform = layout.program_mesh.devices.flat[0].platform
        self.ranks = layout.ranks
        if (staging_blocks // blocks_per_chunk) % self.ranks or any(r % self.ranks for r in slab_rows):
            raise ValueError(f"{staging_blocks} staging blocks and slabs of {list(slab_rows)} chunks under "
                             f"{self.ranks} attention-DP ranks: each rank stages and stores its own chunks, so "
                             f"both must divide into {self.ranks} equal shares (engine.plan_transfers rounds them)")
        if kernel is None:
            kernel = default_kernel(self.platform, layout)
        if kernel not in KERNELS:
            raise ValueError(f"transfer kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        if kernel == "xla" and not xla_kernel.supported(layout):
            raise ValueError("transfer kernel 'xla': needs every block whole on each device (no replica "
                             "slices, no attention-DP ranks); use 'loop' (TPU_OFFLOAD_TRANSFER_KERNEL=loop)")
        if kernel == "dma" and self.platform == "tpu" and not dma_sliceable(layout):
            raise ValueError("transfer kernel 'dma': a replica's slice of a block lies along a tiled dimension "
                             f"(block shapes {[g.block_shape for g in layout.groups]}), which a TPU DMA cannot "
                             "address; use the 'loop' kernel (TPU_OFFLOAD_TRANSFER_KERNEL=loop)")
        self.kernel = kernel
        # the host copies (store/load): DMA kernels on TPU where asked (host_dma.py), else the loop programs, and why
        self.host_copy_why = host_dma.supported(layout, self.platform) if kernel != "xla" else "the xla kernel"
        if host_copy not in (None, "dma", "loop"):
            raise ValueError(f"host copy {host_copy!r}: expected 'dma' or 'loop'")
        if host_copy == "dma" and self.host_copy_why is not None:
            raise ValueError(f"host copy 'dma' (host_dma.py) cannot serve this KV cache: {self.host_copy_why}")
        self.host_copy = host_copy or "loop"
        if self.host_copy == "loop" and self.host_copy_why is None:
            self.host_copy_why = HOST_COPY_DEFAULT
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
        self.share_chunks = self.staging_chunks // self.ranks  # staging chunks each attention-DP rank owns
        self.cross_chunks = ranks.cross_chunks(self.share_chunks)  # chunks a load carries per rank pair and pass

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
        """Per group, a slab of ``rows`` slots: u8 4 KiB tiles where the host copies are DMA kernels (the direct
        path's type, ``direct_dma.tiled_slab_aval``), else the cache's dtype, one chunk per row."""
        if self.host_copy == "dma":
            return tuple(direct_dma.tiled_slab_aval(self.layout, g, rows, self.bpc, self.memory_kind)
                         for g in self.layout.groups)
        return tuple(jax.ShapeDtypeStruct(g.slab_shape(rows, self.bpc), g.dtype, sharding=s)
                     for g, s in zip(self.layout.groups, self._slab_sh))

    def _slabs_aval(self):
        per_size = [self._slab_aval(r) for r in self.slab_rows]
        return tuple(tuple(s[gi] for s in per_size) for gi in range(len(self.layout.groups)))

    def _ints(self, n: int):
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._rep)

    def _group_ints(self, n: int):
        """One index vector per group: each group moves its own blocks (a sliding-window group fewer)."""
        return tuple(self._ints(n) for _ in self.layout.groups)

    # ---- public: compiled programs --------------------------------------
    def gather(self) -> Callable:
        """(caches, staging, *block_args(moves, "gather")) -> staging: per group g, block ids[g][i]
        to staging position pos[g][i]."""
        if self.kernel == "xla":
            return self._get(("gather",), xla_kernel.build_gather, self)
        build = self._build_gather_dma if self.kernel == "dma" else self._build_gather
        return self._get(("gather",), build)

    def scatter(self) -> Callable:
        """(caches, staging, *block_args(moves, "scatter")) -> (caches, done): per group g,
        staging[pos[g][i]] to block ids[g][i]."""
        if self.kernel == "xla":
            return self._get(("scatter",), xla_kernel.build_scatter, self)
        build = self._build_scatter_dma if self.kernel == "dma" else self._build_scatter
        return self._get(("scatter",), build)

    def block_args(self, moves, name: str) -> tuple:
        """The index operands of ``gather``/``scatter`` (``name``) for ``moves``: per group, (cache
        block ids, staging positions) of the blocks it moves. Under DP attention, one row per rank, on
        its devices: its own blocks in its own numbering (ranks.py)."""
        if self.kernel == "xla":
            return xla_kernel.block_args(self, moves, name)
        if self.kernel == "loop":
            per = [self._loop_operands(g, ids, pos) for g, (ids, pos) in zip(self.layout.groups, moves)]
            return tuple(tuple(o[k] for o in per) for k in range(3))
        n, ops = self.staging_blocks, []
        for g, (ids, pos) in zip(self.layout.groups, moves):
            if g.ranks == 1:
                ops.append(dma.run_operands(self._runs(ids, pos, name), n))
            else:
                per = [dma.run_operands(self._runs(i, p, name), n // g.ranks) for i, p in self._by_rank(g, ids, pos)]
                ops.append(tuple(np.stack([o[k] for o in per]) for k in range(4)))
        return tuple(tuple(o[k] for o in ops) for k in range(4))

    def _loop_operands(self, g, ids, pos) -> tuple:
        """The loop kernel's (ids, positions, count) of one group."""
        n = self.staging_blocks
        if g.ranks == 1:
            return ints(ids, n, 0), ints(pos, n, 0), ints([len(ids)], 1, 0)
        per = self._by_rank(g, ids, pos)
        return (np.stack([ints(i, n // g.ranks, 0) for i, _ in per]), np.stack([ints(p, n // g.ranks, 0) for _, p in per]),
                np.array([[len(i)] for i, _ in per], dtype=np.int32))

    def dma_count(self, moves, name: str) -> int:
        """DMAs one ``gather``/``scatter`` call issues for ``moves`` (0 for the loop kernel): one per
        (layer, coalesced run), and the scatter's once per replica slice. Under DP attention, what one
        device of each rank issues, summed over the ranks."""
        if self.kernel != "dma":
            return 0
        total = 0
        for g, (ids, pos) in zip(self.layout.groups, moves):
            runs = sum(len(self._runs(i, p, name)) for i, p in self._by_rank(g, ids, pos))
            total += runs * len(g.layers) * (1 if name == "gather" else g.replicas)
        return total

    @staticmethod
    def _runs(ids, pos, name: str) -> np.ndarray:
        return dma.coalesce(ids, pos) if name == "gather" else dma.coalesce(pos, ids)

    def _by_rank(self, g, ids, pos) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank, (block ids, staging positions) of its blocks in its own numbering: its devices'
        cache rows (global id less the rank's first block) and its share of staging (position less the
        share's first). One rank without DP attention."""
        ids, pos = np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        if g.ranks == 1:
            return [(ids, pos)]
        per_rank, share = self.layout.num_blocks // g.ranks, self.staging_blocks // g.ranks
        rank = ids // per_rank
        bad = np.flatnonzero(pos // share != rank)
        if bad.size:
            i = bad[0]
            raise ValueError(f"block {ids[i]} (attention-DP rank {rank[i]}) at staging position {pos[i]}, in rank "
                             f"{pos[i] // share}'s share: each rank stages its own blocks on its own devices")
        return [(ids[rank == r] - r * per_rank, pos[rank == r] - r * share) for r in range(g.ranks)]

    def store(self, rows: int | None = None) -> Callable:
        """(one slab per group, staging, slab rows[g][c], staging chunks[g][c], count[groups]) -> (slabs, done).

        One program per slab *size* (all slabs but the last share one), called
        once per slab a pass touches: one program over every slab made the
        TPU compiler take 41 s for the 45 slabs of a 720 GiB tier."""
        rows = self.slab_rows[0] if rows is None else rows
        if self.ranks > 1:
            return self._get(("store", rows), lambda r: ranks.build_store(self, r), rows)
        if self.kernel == "xla":
            return self._get(("store", rows), lambda r: xla_kernel.build_store(self, r), rows)
        if self.host_copy == "dma":
            return self._get(("store", rows), self._build_store_dma, rows)
        return self._get(("store", rows), self._build_store, rows)

    def load(self, rows: int | None = None, cross: bool = False) -> Callable:
        """(staging, one slab per group, slab rows[g][c], staging chunks[g][c], count[groups]) -> (staging, done).
        ``cross``: under DP attention, the program that also carries chunks to other ranks (ranks.py)."""
        rows = self.slab_rows[0] if rows is None else rows
        if self.ranks > 1:
            return self._get(("load", rows, cross), lambda r: ranks.build_load(self, r, cross), rows)
        if self.kernel == "xla":
            return self._get(("load", rows, False), lambda r: xla_kernel.build_load(self, r), rows)
        if self.host_copy == "dma":
            return self._get(("load", rows, False), self._build_load_dma, rows)
        return self._get(("load", rows, False), self._build_load, rows)

    def store_args(self, k: int, rows: list, pos: list) -> tuple:
        """The operands after (slabs, staging) of ``store(slab_rows[k])``: per group, slab ``k``'s rows and the
        staging chunks they take."""
        if self.ranks > 1:
            per = [ranks.store_operands(self, k, r, p) for r, p in zip(rows, pos)]
            return tuple(tuple(o[i] for o in per) for i in range(3))
        if self.kernel == "xla":
            return xla_kernel.host_args(self, rows, pos)
        c = self.staging_chunks
        if self.host_copy == "dma":  # per group the kernel's runs: (count, chunk starts, row starts, lengths)
            per = [host_dma.run_operands(p, r, c) for r, p in zip(rows, pos)]
            return tuple(tuple(o[i] for o in per) for i in range(4))
        return (tuple(ints(r, c, 0) for r in rows), tuple(ints(p, c, 0) for p in pos),
                ints([len(r) for r in rows], len(rows), 0))

    def load_args(self, k: int, rows: list, pos: list) -> tuple[tuple, bool]:
        """(the operands after (staging, slabs) of ``load(slab_rows[k], cross)``, cross): as ``store_args``;
        ``cross``: some chunk loads into another rank than the one whose host memory holds it."""
        if self.ranks > 1:
            per = [ranks.load_operands(self, k, r, p) for r, p in zip(rows, pos)]
            return tuple(tuple(o[0][i] for o in per) for i in range(3)), any(c for _, c in per)
        return self.store_args(k, rows, pos), False

    def take_chunks(self) -> Callable:
        """(staging) -> per group, every staging chunk as its own array, (bpc, layers, *piece): what one
        batched ``device_put`` per pass sends to host (one program per pass, never per chunk)."""
        self._no_dp("device_put")
        return self._get(("take_chunks",), self._build_take_chunks)

    def _no_dp(self, path: str) -> None:
        if self.ranks > 1:
            raise ValueError(f"the {path} host path under {self.ranks} attention-DP ranks: a chunk lives on one "
                             "rank's devices, which no array of the whole mesh can hold; use the program path")

    def put_chunks(self, group: int = 0) -> Callable:
        """(staging of ``group``, staging_chunks chunk arrays, pos[staging_chunks]) -> that staging
        (donated): chunk k written at staging chunk pos[k]. The chunks one batched ``device_put``
        brought back; a pass with fewer repeats its first (chunk, pos) pair. One per group: a load
        brings back only the groups it needs."""
        self._no_dp("device_put")
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
        if self.ranks > 1:  # a load that carries chunks to other ranks
            out.update(load_cross=self.load(cross=True))
            if self.slab_rows[-1] != self.slab_rows[0]:
                out.update(load_cross_last=self.load(self.slab_rows[-1], cross=True))
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
                gids, gpos = _mine(g, ids[gi]), _mine(g, pos[gi])

                def body(i, st, g=g, layers=layers, gids=gids, gpos=gpos):
                    for li, c in enumerate(layers):
                        block = lax.dynamic_index_in_dim(c, gids[i], 0, keepdims=True)  # (1, *local_block_shape)
                        if g.replicas > 1:  # keep only this device's slice of the bytes its replicas also hold
                            j = lax.axis_index(g.rep_axes) % g.replicas
                            t = g.piece_shape[g.split_dim]
                            block = lax.dynamic_slice_in_dim(block, j * t, t, axis=1 + g.split_dim)
                        st = lax.dynamic_update_slice(st, block[:, None], (gpos[i], li) + (0,) * len(g.piece_shape))
                    return st

                out.append(lax.fori_loop(0, _mine(g, count[gi])[0], body, st))
            return tuple(out)

        gp = self._gp()
        body = self._local(gather_local, (self._cache_specs(), self._staging_specs(), gp, gp, gp),
                           self._staging_specs())
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=self._staging_sh)
        return jitted.lower(self._caches_aval(), self._staging_aval(), *self._loop_avals()).compile()

    def _build_scatter(self):
        groups = self.layout.groups
        as_bits = collectives_as_bits(self.layout)
        mesh_shape = dict(self.layout.mesh.shape)

        def scatter_local(caches, staging, ids, pos, count):
            caches = list(caches)
            for gi, (g, st) in enumerate(zip(groups, staging)):
                zeros = (0,) * len(g.piece_shape)
                gids, gpos, n = _mine(g, ids[gi]), _mine(g, pos[gi]), _mine(g, count[gi])[0]

                def write(offset, source, layers, g=g, zeros=zeros, gids=gids, gpos=gpos, n=n):
                    """Each block's piece of ``source`` into its cache block, at ``offset`` along the split
                    dim (a replica's slice), sliced straight out of ``source``: no copy of the row."""
                    inner = tuple(offset[0] if d == g.split_dim else 0 for d in range(len(zeros)))

                    def body(i, layers):
                        return tuple(
                            lax.dynamic_update_slice(
                                c, lax.dynamic_slice(source, (gpos[i], li, *zeros), (1, 1, *g.piece_shape))[:, 0],
                                (gids[i], *inner))
                            for li, c in enumerate(layers))

                    return lax.fori_loop(0, n, body, tuple(layers))

                layers = tuple(caches[a] for a in g.layers)
                if g.replicas > 1:  # the whole head shard: the ring runs once per pass, outside the loop
                    new = _scatter_replicas(lambda off, src, lay: write(off, src, lay), st, layers, g, as_bits,
                                            mesh_shape)
                else:
                    new = write(jnp.zeros((1,), jnp.int32), st, layers)

                for a, arr in zip(g.layers, new):
                    caches[a] = arr
            return tuple(caches), jnp.concatenate([_mine(g, c) for g, c in zip(groups, count)])

        gp = self._gp()
        body = self._local(scatter_local, (self._cache_specs(), self._staging_specs(), gp, gp, gp),
                           (self._cache_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(self._cache_sh, self._rep))
        return jitted.lower(self._caches_aval(), self._staging_aval(), *self._loop_avals()).compile()

    def _loop_avals(self):
        """The loop kernel's (ids, positions, count) per group: replicated, or one row per rank."""
        n, out = self.staging_blocks, []
        for g in self.layout.groups:
            if g.ranks == 1:
                out.append((self._ints(n), self._ints(n), self._ints(1)))
            else:
                row = lambda k: jax.ShapeDtypeStruct((g.ranks, k), jnp.int32, sharding=self.layout.sharding(g.block_axes))
                out.append((row(n // g.ranks), row(n // g.ranks), row(1)))
        return tuple(tuple(o[k] for o in out) for k in range(3))

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
        groups, platform = self.layout.groups, self.platform

        def gather_local(caches, staging, count, src, dst, length):
            out = []
            for gi, (g, st) in enumerate(zip(groups, staging)):
                layers = [caches[a] for a in g.layers]
                split, offset = _replica_split(g)
                call = dma.gather_call(len(g.layers), st.shape, st.dtype, platform, split)
                args = tuple(_mine(g, a[gi]) for a in (count, src, dst, length))
                out.append(call(*args, offset, layers, st))
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
                args = tuple(_mine(g, a[gi]) for a in (count, src, dst, length))
                split, _ = _replica_split(g)
                call = dma.scatter_call(len(g.layers), layers[0].shape, layers[0].dtype, platform, split)
                if g.replicas == 1:
                    layers = call(*args, jnp.zeros((1,), jnp.int32), st, layers)
                else:  # every replica's slices, one ring shift per replica: once per pass, never per block
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

    def _host_dma_avals(self):
        c = self.staging_chunks
        return tuple(self._group_ints(n) for n in (1, c, c, c))

    def _build_store_dma(self, rows: int):
        """(slabs, staging, count, chunk, row, length) -> (slabs, done): per group one kernel call
        (host_dma.store_call), its slab updated in place; ``done`` the groups' run counts."""
        groups, bpc, platform = self.layout.groups, self.bpc, self.platform
        slabs = self._slab_aval(rows)

        def store_local(slabs, staging, count, chunk, row, length):
            out = []
            for gi, (g, sl, st) in enumerate(zip(groups, slabs, staging)):
                call = host_dma.store_call(bpc, host_dma.chunk_tiles(g, bpc), sl.shape, platform)
                out.append(call(count[gi], chunk[gi], row[gi], length[gi], st, sl))
            return tuple(out), jnp.concatenate(count)

        specs = tuple(direct_dma.slab_spec(g) for g in groups)
        gp = tuple(P() for _ in groups)
        body = self._local(store_local, (specs, self._staging_specs(), gp, gp, gp, gp), (specs, P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(tuple(a.sharding for a in slabs), self._rep))
        return jitted.lower(slabs, self._staging_aval(), *self._host_dma_avals()).compile()

    def _build_load_dma(self, rows: int):
        """(staging, slabs, count, chunk, row, length) -> (staging, done): per group one kernel call
        (host_dma.load_call), staging written in place, the slab only read."""
        groups, bpc, platform = self.layout.groups, self.bpc, self.platform

        def load_local(staging, slabs, count, chunk, row, length):
            out = []
            for gi, (g, sl, st) in enumerate(zip(groups, slabs, staging)):
                call = host_dma.load_call(bpc, host_dma.chunk_tiles(g, bpc), st.shape, st.dtype, platform)
                out.append(call(count[gi], chunk[gi], row[gi], length[gi], sl, st))
            return tuple(out), jnp.concatenate(count)

        specs = tuple(direct_dma.slab_spec(g) for g in groups)
        gp = tuple(P() for _ in groups)
        body = self._local(load_local, (self._staging_specs(), specs, gp, gp, gp, gp), (self._staging_specs(), P()))
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=(self._staging_sh, self._rep))
        return jitted.lower(self._staging_aval(), self._slab_aval(rows), *self._host_dma_avals()).compile()

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
                    one = NamedSharding(a.sharding.mesh, P(None, *a.sharding.spec[1:]), memory_kind=a.sharding.memory_kind)
                    row = jax.device_put(jnp.zeros((1, *a.shape[1:]), a.dtype), one)  # rows split over DP ranks
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


def _mine(g, x):
    """A group's operand inside ``shard_map``: under DP attention its rank's row (the local (1, k))."""
    return x[0] if g.ranks > 1 else x


def _replica_split(g):
    """(split, offset) for the DMA kernels: this device's slice of a block, ``(dim, size)``, and its
    offset along that dim as a (1,) operand; (None, 0) without replicas."""
    if g.replicas == 1:
        return None, jnp.zeros((1,), jnp.int32)
    t = g.piece_shape[g.split_dim]
    j = lax.axis_index(g.rep_axes) % g.replicas
    return (g.split_dim, t), jnp.reshape(j * t, (1,)).astype(jnp.int32)


def _scatter_replicas(write, staging, layers, g, as_bits: bool, mesh_shape):
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
    received buffer is live at a time: one staging buffer of HBM scratch. ``mesh_shape``: the mesh's
    axis sizes, in its order. Under DP attention the replicas are a rank's own copies (layout.py)."""
    axes, r, h, size = g.rep_axes, g.replicas, g.rep_size, g.piece_shape[g.split_dim]
    split_offset = lambda k: jnp.reshape(((lax.axis_index(axes) % r - k) % r) * size, (1,)).astype(jnp.int32)
    layers = write(split_offset(0), staging, layers)
    raw = lax.bitcast_convert_type(staging, bits(staging.dtype)) if as_bits else staging
    for k in range(1, r):
        raw, layers = lax.optimization_barrier((raw, tuple(layers)))
        got = lax.ppermute(raw, *ring(axes, mesh_shape, [(i, i // r * r + (i % r + k) % r) for i in range(h)]))
        got = lax.bitcast_convert_type(got, staging.dtype) if as_bits else got
        layers = write(split_offset(k), got, layers)
    return layers


def default_kernel(platform: str, layout: KVLayout | None = None) -> str:
    """``dma`` where a TPU runs it; ``xla`` on a GPU (one gather per layer, xla_kernel.py); ``loop``
    elsewhere (the DMA kernel is interpreted on CPU, slowly) and where neither can address a
    replica's slice (``dma_sliceable``, ``xla_kernel.supported``)."""
    if platform == "tpu" and (layout is None or dma_sliceable(layout)):
        return "dma"
    if platform == "gpu" and (layout is None or xla_kernel.supported(layout)):
        return "xla"
    return "loop"


def dma_sliceable(layout: KVLayout) -> bool:
    """Whether every group's replica slice lies along a dimension a TPU DMA can slice at any offset.
    HBM arrays are tiled over their last two dimensions, and a DMA's offsets there must be whole
    tiles: MLA's latent cache (4, 32, 640) per 128-token page, split 8 ways at TP 8, keeps 4 of 32
    rows, a part of an 8-row tile (the TPU compiler refuses that kernel). Under DP attention the
    kernel slices only by a rank's own copies (none at one device per rank: DeepSeek-V3 at DP 8)."""
    return all(g.replicas == 1 or g.split_dim < len(g.block_shape) - 2 for g in layout.groups)


def ints(values, n: int, fill: int) -> np.ndarray:
    """An int32 vector of length ``n``: ``values`` then ``fill``."""
    out = np.full(n, fill, dtype=np.int32)
    out[: len(values)] = values
    return out
