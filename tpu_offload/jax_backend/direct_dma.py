"""Host copies as DMAs straight between the paged caches and the host tier: the TPU's direct kernel.

The ``program`` host path moves a pass twice: gather (caches -> HBM staging),
then a host copy (staging -> host slab): a compiled loop of one asynchronous
copy per chunk, a TensorCore copy fusion and a host ``dynamic-update-slice``
per trip, or where asked the same kind of kernel as this one (host_dma.py:
store 3x, load 3x what the pass moves in HBM). Here
one Pallas kernel per call starts a DMA for every (run, layer) between a
cache and the host slab, then waits for them all: no staging, no TensorCore
copy, no HBM scratch, the slab updated in place, 2x.

libtpu refuses a Pallas DMA into host memory at a dynamic offset unless the
host array's tile is 4 KiB (``LLO_CHECK multiplier_in_bytes % word_size``
keys on it: a bf16 slab's (16, 128) tile is 512 bytes). So the host slab is
typed ``uint8 (rows, tiles, 32, 128)``: a (32, 128) u8 tile is 4 KiB. Inside
the kernel each cache is viewed the same way, ``ref.bitcast(uint8)``
reshaped to ``(blocks, tiles, 32, 128)``. Which byte of a block lands where
in its 4 KiB tiles is the compiler's business; a store then a load through
the same view is the identity whatever that mapping, which is what the
start-up round trip (``TransferEngine.check_direct``) checks bit for bit on a chip.
Interpret mode cannot run the ref bitcast, so CPU never runs this kernel.

Two rules from the compiler: one host output per ``pallas_call`` (two or
more aliased host outputs abort it, ``host_offload_utils.cc:98``), so a
store is one kernel per (layer group, slab); and the block ids arrive as
scalar-prefetch operands, runs coalesced on the host where both the cache
blocks and the slab rows are consecutive (``coalesce``).

A slab row holds one slot: ``blocks_per_chunk`` blocks, each every layer of
the group, each layer ``tiles`` 4 KiB tiles of this device's shard (the
same order as the ``program`` path's slab rows: (block, layer, piece)).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_offload.jax_backend import dma

TILE = (32, 128)  # u8: 4 KiB, the host tile libtpu accepts at a dynamic offset
TILE_BYTES = TILE[0] * TILE[1]
N_SCALARS = 5  # run count (1,), cache block starts, slab row starts, lengths, block within the chunk


def tiles_per_block(piece_shape, dtype) -> int:
    """4 KiB tiles in one device's piece of one block and layer (its bytes must be whole tiles)."""
    nbytes = math.prod(piece_shape) * np.dtype(dtype).itemsize
    if nbytes % TILE_BYTES:
        raise ValueError(f"a block piece of {piece_shape} {np.dtype(dtype).name} is {nbytes} bytes, "
                         f"not a whole number of {TILE_BYTES}-byte tiles")
    return nbytes // TILE_BYTES


def viewable(piece_shape, dtype) -> bool:
    """Whether a cache's blocks can be viewed as whole u8 tiles: their bytes whole tiles, and the
    bitcast to u8 defined (a second-minor dimension, a dtype of 8 bits or more)."""
    return why_not_viewable(piece_shape, dtype) is None


def why_not_viewable(piece_shape, dtype, lanes: bool = False) -> str | None:
    """``viewable``'s reason, in words (None: viewable). ``lanes``: also the minor dimension the tile's 128
    lanes (Mosaic reshapes a ref only with its minormost dimension unchanged: MLA's (4, 4, 640) piece is
    whole tiles, 20 KiB, yet its staging refuses the view; the staging path's host copies check it)."""
    nbytes = math.prod(piece_shape) * np.dtype(dtype).itemsize
    what = f"a block piece of {tuple(piece_shape)} {np.dtype(dtype).name}"
    if len(piece_shape) < 2 or np.dtype(dtype).itemsize < 1:
        return f"{what} has no u8 view (it needs a second-minor dimension and 8-bit or wider elements)"
    if nbytes % TILE_BYTES:
        return f"{what} is {nbytes} bytes, not whole {TILE_BYTES}-byte tiles"
    if lanes and piece_shape[-1] != TILE[1]:
        return (f"{what} has a minor dimension of {piece_shape[-1]}, not {TILE[1]}: Mosaic reshapes a ref "
                f"into ({TILE[0]}, {TILE[1]}) tiles only with its minormost dimension unchanged")
    return None


def _view(ref, tiles: int):
    """A cache ref ``(blocks, *piece)`` as u8 tiles ``(blocks, tiles, 32, 128)``."""
    if np.dtype(ref.dtype) != np.uint8:
        ref = ref.bitcast(jnp.uint8)
    return ref.reshape(ref.shape[0], tiles, *TILE)


def coalesce(blocks, rows, cols) -> np.ndarray:
    """Runs ``(block, row, length, col)`` of moves ``cache block blocks[i] <-> slab row rows[i], block cols[i]
    of the chunk``, in order: a move continues the previous run when its block and row both follow it and its
    column is the same (with one-block chunks, every run of consecutive blocks into consecutive slots)."""
    b, r, c = (np.asarray(x, dtype=np.int64) for x in (blocks, rows, cols))
    if b.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(b) != 1) | (np.diff(r) != 1) | (np.diff(c) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [b.size]]))
    return np.stack([b[starts], r[starts], lengths, c[starts]], axis=1)


def run_operands(runs: np.ndarray, capacity: int) -> tuple[np.ndarray, ...]:
    """The kernel's scalar operands for ``runs`` (``coalesce``), padded to ``capacity`` entries (one compiled
    shape for every call): (count (1,), blocks, rows, lengths, cols)."""
    return dma.run_operands(runs, capacity, cols=4)


def _slab_part(slab, row_ref, len_ref, col_ref, i, li, num_layers: int, tiles: int):
    """Rows ``row[i] : row[i] + length[i]`` of the slab, the tiles of block ``col[i]`` of the chunk, layer ``li``."""
    return slab.at[pl.ds(row_ref[i], len_ref[i]), pl.ds((col_ref[i] * num_layers + li) * tiles, tiles)]


def store_call(num_layers: int, tiles: int, slab_shape, platform: str = "tpu"):
    """``(n, block, row, length, col, *caches, slab) -> slab``: for every run i < n[0] and layer l, cache
    blocks ``block[i] : block[i] + length[i]`` of layer l into slab rows ``row[i] : ...``, at block ``col[i]``
    of the chunk, layer l's tiles. One DMA per (run, layer), all started before any wait; the slab (the one
    host output) aliased in place."""
    L = num_layers

    def kernel(n_ref, blk_ref, row_ref, len_ref, col_ref, *refs):
        caches, slab, sems = refs[:L], refs[L + 1], refs[-1]

        def copy(i, li):
            return pltpu.make_async_copy(_view(caches[li], tiles).at[pl.ds(blk_ref[i], len_ref[i])],
                                         _slab_part(slab, row_ref, len_ref, col_ref, i, li, L, tiles), sems.at[li])

        dma.start_then_wait(n_ref, L, copy)

    return _call(kernel, jax.ShapeDtypeStruct(slab_shape, jnp.uint8), pl.BlockSpec(memory_space=pl.HOST),
                 [pl.BlockSpec(memory_space=pl.ANY)] * L + [pl.BlockSpec(memory_space=pl.HOST)],
                 {N_SCALARS + L: 0}, L, platform)


def load_call(num_layers: int, tiles: int, cache_shape, dtype, platform: str = "tpu"):
    """``(n, block, row, length, col, slab, *caches) -> caches``: for every run i < n[0] and layer l, slab rows
    ``row[i] : row[i] + length[i]`` (block ``col[i]`` of the chunk, layer l's tiles) into cache blocks
    ``block[i] : ...`` of layer l, every cache written in place (HBM outputs; the slab is only read)."""
    L = num_layers

    def kernel(n_ref, blk_ref, row_ref, len_ref, col_ref, *refs):
        slab, caches, sems = refs[0], refs[1 + L: 1 + 2 * L], refs[-1]

        def copy(i, li):
            return pltpu.make_async_copy(_slab_part(slab, row_ref, len_ref, col_ref, i, li, L, tiles),
                                         _view(caches[li], tiles).at[pl.ds(blk_ref[i], len_ref[i])], sems.at[li])

        dma.start_then_wait(n_ref, L, copy)

    out_shape = tuple(jax.ShapeDtypeStruct(cache_shape, dtype) for _ in range(L))
    return _call(kernel, out_shape, tuple(pl.BlockSpec(memory_space=pl.ANY) for _ in range(L)),
                 [pl.BlockSpec(memory_space=pl.HOST)] + [pl.BlockSpec(memory_space=pl.ANY)] * L,
                 {N_SCALARS + 1 + li: li for li in range(L)}, L, platform)


def _call(kernel, out_shape, out_specs, in_specs, aliases, num_layers: int, platform: str):
    if platform != "tpu":
        raise ValueError(f"the direct host kernel runs on TPU only (its u8 view of the caches is a TPU "
                         f"bitcast that interpret mode cannot run), not on {platform!r}; tests on CPU use "
                         f"stand_in_call")
    return pl.pallas_call(
        kernel, out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_SCALARS, grid=(1,), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.SemaphoreType.DMA((num_layers,))]),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
    )


def stand_in_call(direction: str, num_layers: int, tiles: int):
    """What the kernel does, in XLA ops on u8 views (``bitcast_convert_type``), for CPU tests of the engine's
    bookkeeping (slots, rows, runs, calls): never the TPU's bytes or cost, and no path picks it by itself.
    Same operands as ``store_call``/``load_call``."""
    from jax import lax
    L = num_layers

    def view(c):
        return lax.bitcast_convert_type(c, jnp.uint8).reshape(c.shape[0], tiles, *TILE)

    def store(n, blk, row, length, col, *refs):
        caches, slab = refs[:L], refs[L]
        views = [view(c) for c in caches]

        def per_block(j, slab):  # one block of a run at a time: runs have dynamic lengths
            i = jnp.searchsorted(jnp.cumsum(length), j, side="right")
            off = j - (jnp.cumsum(length)[i] - length[i])
            for li, v in enumerate(views):
                part = jax.device_put(lax.dynamic_slice_in_dim(v, blk[i] + off, 1, axis=0), jax.memory.Space.Host)
                slab = lax.dynamic_update_slice(slab, part, (row[i] + off, (col[i] * L + li) * tiles, 0, 0))
            return slab

        return lax.fori_loop(0, jnp.sum(jnp.where(jnp.arange(length.size) < n[0], length, 0)), per_block, slab)

    def load(n, blk, row, length, col, slab, *caches):
        def per_block(j, views):
            i = jnp.searchsorted(jnp.cumsum(length), j, side="right")
            off = j - (jnp.cumsum(length)[i] - length[i])
            def part(li):
                x = lax.dynamic_slice(slab, (row[i] + off, (col[i] * L + li) * tiles, 0, 0), (1, tiles, *TILE))
                return jax.device_put(x, jax.memory.Space.Device)

            return tuple(lax.dynamic_update_slice_in_dim(v, part(li), blk[i] + off, axis=0)
                         for li, v in enumerate(views))

        total = jnp.sum(jnp.where(jnp.arange(length.size) < n[0], length, 0))
        views = lax.fori_loop(0, total, per_block, tuple(view(c) for c in caches))

        def back(v, c):
            k = c.dtype.itemsize
            return lax.bitcast_convert_type(v.reshape(*c.shape, k) if k > 1 else v.reshape(c.shape), c.dtype)

        return tuple(back(v, c) for v, c in zip(views, caches))

    return store if direction == "store" else load


# ---- the compiled programs of one layout --------------------------------------------------------
def supported(layout, platform: str | None = None) -> str | None:
    """Why the direct path cannot serve ``layout`` (None: it can). It needs a TPU, every block whole on its
    devices (no replica slices, no attention-DP ranks), one id list (no windowed groups) and blocks whose
    bytes are whole 4 KiB tiles."""
    platform = platform or layout.program_mesh.devices.flat[0].platform
    if platform != "tpu":
        return f"it runs on TPU only, not {platform}"
    if layout.kv_groups != 1:
        return "sliding-window layers in their own groups"
    for g in layout.groups:
        if g.replicas != 1 or g.ranks != 1:
            return "replicated KV heads, MLA copies or attention-DP ranks"
        why = why_not_viewable(g.piece_shape, g.dtype)
        if why is not None:
            return why
    return None


def slab_spec(g):
    """A tiled slab's spec: its rows whole on every device, the tiles of a row split over the cache's shard axes."""
    from jax.sharding import PartitionSpec as P
    return P(None, tuple(g.shard_axes) or None, None, None)


def tiled_slab_aval(layout, g, rows: int, blocks_per_chunk: int, memory_kind: str):
    """Group ``g``'s slab of ``rows`` slots as u8 4 KiB tiles: (rows, devices x bpc x layers x tiles, 32, 128),
    each device's part of a row its own (block, layer, tiles) bytes. One type for both kernels that fill a
    tier's slabs: the direct kernel (from the caches) and the staging path's host copies (host_dma.py)."""
    from jax.sharding import NamedSharding
    width = g.shards * blocks_per_chunk * len(g.layers) * tiles_per_block(g.piece_shape, g.dtype)
    sh = NamedSharding(layout.program_mesh, slab_spec(g), memory_kind=memory_kind)
    return jax.ShapeDtypeStruct((rows, width, *TILE), jnp.uint8, sharding=sh)


class DirectPrograms:
    """The direct path's programs for one layout: per (layer group, slab size), a store (the group's caches
    -> one slab, the slab donated) and a load (one slab -> the group's caches, donated), each one kernel
    call. ``capacity``: the most runs one call takes (a pass's blocks)."""

    def __init__(self, layout, *, blocks_per_chunk: int, slab_rows: tuple[int, ...], memory_kind: str,
                 capacity: int, platform: str | None = None):
        self.layout = layout
        self.platform = platform or layout.program_mesh.devices.flat[0].platform
        self.bpc = blocks_per_chunk
        self.slab_rows = tuple(slab_rows)
        self.memory_kind = memory_kind
        self.capacity = capacity
        self.tiles = tuple(tiles_per_block(g.piece_shape, g.dtype) for g in layout.groups)
        self.compiles = 0
        self._cache: dict[tuple, object] = {}

    # ---- shapes -------------------------------------------------------------------------
    def slab_spec(self, g):
        return slab_spec(g)

    def slab_aval(self, gi: int, rows: int, memory_kind: str | None = None):
        """Group ``gi``'s slab of ``rows`` slots (``tiled_slab_aval``)."""
        return tiled_slab_aval(self.layout, self.layout.groups[gi], rows, self.bpc, memory_kind or self.memory_kind)

    def _cache_avals(self, g):
        from jax.sharding import NamedSharding, PartitionSpec as P
        sh = NamedSharding(self.layout.program_mesh, P(*g.cache_spec))
        return tuple(jax.ShapeDtypeStruct((self.layout.num_blocks, *g.block_shape), g.dtype, sharding=sh)
                     for _ in g.layers)

    def _ints(self, n: int):
        from jax.sharding import NamedSharding, PartitionSpec as P
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(self.layout.program_mesh, P()))

    def _scalar_avals(self):
        return (self._ints(1),) + (self._ints(self.capacity),) * 4

    # ---- operands -----------------------------------------------------------------------
    def operands(self, blocks, rows, cols) -> tuple[np.ndarray, ...]:
        """The scalar operands of one call moving cache block ``blocks[i]`` <-> (slab row ``rows[i]``, block
        ``cols[i]`` of its chunk)."""
        return run_operands(coalesce(blocks, rows, cols), self.capacity)

    def dma_count(self, gi: int, blocks, rows, cols) -> int:
        """DMAs one call issues: one per (run, layer)."""
        return len(coalesce(blocks, rows, cols)) * len(self.layout.groups[gi].layers)

    # ---- programs -----------------------------------------------------------------------
    def store(self, gi: int, rows: int | None = None):
        """(the group's caches, its slab, *operands) -> slab (donated, updated in place)."""
        rows = self.slab_rows[0] if rows is None else rows
        return self._get(("store", gi, rows), self._build_store, gi, rows)

    def load(self, gi: int, rows: int | None = None):
        """(the group's caches (donated), its slab, *operands) -> caches."""
        rows = self.slab_rows[0] if rows is None else rows
        return self._get(("load", gi, rows), self._build_load, gi, rows)

    def all_programs(self) -> dict:
        out = {}
        for gi in range(len(self.layout.groups)):
            for rows in sorted(set(self.slab_rows)):
                out[f"direct_store_{gi}_{rows}"] = self.store(gi, rows)
                out[f"direct_load_{gi}_{rows}"] = self.load(gi, rows)
        out["direct_alloc_slabs"] = self._get(("alloc",), self._build_allocator)
        return out

    def _get(self, key, build, *args):
        fn = self._cache.get(key)
        if fn is None:
            fn = self._cache[key] = build(*args)
            self.compiles += 1
        return fn

    def _local(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.layout.program_mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _specs(self, g):
        from jax.sharding import PartitionSpec as P
        return tuple(P(*g.cache_spec) for _ in g.layers), self.slab_spec(g), (P(),) * N_SCALARS

    def _build_store(self, gi: int, rows: int):
        g, tiles, platform = self.layout.groups[gi], self.tiles[gi], self.platform
        L = len(g.layers)

        def store_local(caches, slab, *scalars):
            if platform != "tpu":
                return stand_in_call("store", L, tiles)(*scalars, *caches, slab)
            return store_call(L, tiles, slab.shape, platform)(*scalars, *caches, slab)

        cs, ss, ints = self._specs(g)
        slab = self.slab_aval(gi, rows)
        body = self._local(store_local, (cs, ss, *ints), ss)
        jitted = jax.jit(body, donate_argnums=(1,), out_shardings=slab.sharding)
        return jitted.lower(self._cache_avals(g), slab, *self._scalar_avals()).compile()

    def _build_load(self, gi: int, rows: int):
        g, tiles, platform = self.layout.groups[gi], self.tiles[gi], self.platform
        L = len(g.layers)

        def load_local(caches, slab, *scalars):
            if platform != "tpu":
                return stand_in_call("load", L, tiles)(*scalars, slab, *caches)
            return load_call(L, tiles, caches[0].shape, caches[0].dtype, platform)(*scalars, slab, *caches)

        cs, ss, ints = self._specs(g)
        caches = self._cache_avals(g)
        body = self._local(load_local, (cs, ss, *ints), cs)
        jitted = jax.jit(body, donate_argnums=(0,), out_shardings=tuple(c.sharding for c in caches))
        return jitted.lower(caches, self.slab_aval(gi, rows), *self._scalar_avals()).compile()

    # ---- allocation -----------------------------------------------------------------------
    def alloc_slabs(self) -> tuple:
        """Per group, its zero-filled u8 slabs (one per slab size in ``slab_rows``), made where they live."""
        return self._get(("alloc",), self._build_allocator)()

    def _build_allocator(self):
        """One zero row put to host memory and broadcast there: no HBM the size of a slab (as
        ``Programs._build_slab_allocator``)."""
        from jax.sharding import NamedSharding, PartitionSpec as P
        avals = tuple(tuple(self.slab_aval(gi, r) for r in self.slab_rows) for gi in range(len(self.layout.groups)))

        def make():
            out = []
            for per_group in avals:
                group = []
                for a in per_group:
                    one = NamedSharding(a.sharding.mesh, P(None, *a.sharding.spec[1:]),
                                        memory_kind=a.sharding.memory_kind)
                    row = jax.device_put(jnp.zeros((1, *a.shape[1:]), a.dtype), one)
                    group.append(jnp.broadcast_to(row, a.shape))
                out.append(tuple(group))
            return tuple(out)

        return jax.jit(make, out_shardings=jax.tree.map(lambda a: a.sharding, avals)).lower().compile()
