"""What the paged KV cache looks like, read once from the runner's arrays.

tpu-inference keeps one ``jax.Array`` per attention layer, shaped
``(num_blocks, *block_shape)`` (NHD: block_size, packed K/V heads, head_dim)
and sharded with KV heads over the model axis. Layers of one shape form a
group (hybrid models have several), and so do layers addressed by their own
block ids: sliding-window layers in "window" mode move only the blocks of
their window (``connector/windows.py``), so they get groups of their own.

Our buffers (staging, host slabs) hold, per device, its own shard of each
block in the cache's native block shape and dtype (a "piece"), so every
device, and every host process, only ever touches its own head shards and the
TPU compiler moves whole tiles (no relayout, no bits reinterpretation: both
made it copy every layer's whole cache on TPU7x). When TP exceeds the
model's KV heads, tpu-inference repeats each head over ``replicas``
consecutive shards of the head axes; those devices then hold identical
bytes, so each keeps only a ``1/replicas`` slice of the block's tokens and
the host tier holds every distinct head once (the model's real KV size).
MLA's latent cache has no head axis at all: tpu-inference keeps the whole
of it on every device of the model axis (``P(BATCH, KV_CONTEXT)``). Those
devices also hold identical bytes, so the same rule applies over the axes
the cache is not split on: each keeps a ``1/replicas`` slice of every block
(along the first block dimension that divides), and the host tier holds the
latent cache once, sharded over those devices.

Under DP attention the cache's block dimension is split over the ranks, and
our buffers split theirs the same way: a rank's blocks stay on its devices,
in its share of staging and its rows of the host slabs (ranks.py).

Every program is compiled against ``program_mesh``: the cache mesh's devices
and axis names with ``AxisType.Auto`` axes. tpu-inference builds Auto meshes,
``jax.make_mesh`` builds Explicit ones, and code inside ``shard_map`` sees
Manual ones; a compiled program accepts arrays from any of them (same devices,
same layout), and its outputs that go back to the runner carry the cache's own
sharding, so the runner never sees a foreign mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

HEAD_DIM = 1  # index of the KV-head dimension in block_shape (cache dim 2), in every layout we accept
TOKEN_DIM = 0  # replicas split a block along its tokens


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block shape, dtype and sharding."""

    layers: tuple[int, ...]  # indices into runner.kv_caches
    block_shape: tuple[int, ...]  # cache.shape[1:]
    dtype: np.dtype
    cache_spec: tuple  # the cache's PartitionSpec entries, block dim first
    cache_sharding: NamedSharding
    local_block_shape: tuple[int, ...]  # one device's shard of a block
    shard_axes: tuple[str, ...]  # mesh axes the cache is split over, in spec order
    shards: int  # devices holding distinct-or-replicated pieces: product of shard_axes sizes
    head_axes: tuple[str, ...]  # mesh axes of the KV-head dimension
    head_shards: int  # product of their sizes
    replicas: int = 1  # devices holding identical bytes of a block (repeated heads, or MLA's copies)
    split_dim: int = TOKEN_DIM  # the block dimension replicas split among themselves
    replica_axes: tuple[str, ...] = ()  # MLA: the mesh axes its copies lie along (empty: the head axes)
    kv_group: int = 0  # which of a chunk's id lists addresses these layers (LoadChunk.ids): 0 all, 1 windowed
    block_axes: tuple[str, ...] = ()  # DP attention: mesh axes the block dimension is split over (ranks)

    ranks: int = 1  # DP attention: ranks the blocks are split over (the product of block_axes' sizes)

    @property
    def local_elems(self) -> int:
        return math.prod(self.local_block_shape)

    @property
    def piece(self) -> int:
        """Elements of one block and layer each device keeps."""
        return self.local_elems // self.replicas

    @property
    def width(self) -> int:
        """Global length of the flattened per-block dimension of our buffers."""
        return self.shards * self.piece

    @property
    def block_bytes(self) -> int:
        """Distinct bytes of one block across this group's layers and all devices."""
        return self.width * np.dtype(self.dtype).itemsize * len(self.layers)

    @property
    def replicated_block_bytes(self) -> int:
        """What the cache itself holds per block (heads repeated ``replicas`` times)."""
        return math.prod(self.block_shape) * np.dtype(self.dtype).itemsize * len(self.layers)

    @property
    def piece_bytes(self) -> int:
        """One device's piece of one block, all this group's layers (on the devices that hold the block)."""
        return self.piece * np.dtype(self.dtype).itemsize * len(self.layers)

    @property
    def device_block_bytes(self) -> int:
        """One device's share of a block in our buffers, averaged over staging: the piece, but under DP
        attention a device holds pieces of its own rank's blocks only (1 in ``ranks`` of a pass)."""
        return self.piece_bytes // self.ranks

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """One device's piece of a block: its shard, its replica's slice of it."""
        return _divided(self.local_block_shape, self.split_dim, self.replicas)

    @property
    def global_piece_shape(self) -> tuple[int, ...]:
        """The pieces of all devices as one array, laid out like the cache's block (MLA's replicas
        tile the split dimension; repeated heads' pieces sit at their heads' places)."""
        return self.block_shape if self.replica_axes else _divided(self.block_shape, self.split_dim, self.replicas)

    @property
    def piece_spec(self) -> tuple:
        """Sharding of the pieces' dimensions: the cache's, plus MLA's replica axes on the split dimension."""
        spec = list(self.cache_spec[1:]) + [None] * (len(self.block_shape) + 1 - len(self.cache_spec))
        if self.replica_axes:
            spec[self.split_dim] = self.replica_axes if len(self.replica_axes) > 1 else self.replica_axes[0]
        return tuple(spec[: len(self.block_shape)])

    @property
    def rep_axes(self) -> tuple[str, ...]:
        """Mesh axes along which a block's replicas sit (for the ring that reassembles them)."""
        return self.replica_axes or self.head_axes

    @property
    def rep_size(self) -> int:
        return self.replicas if self.replica_axes else self.head_shards

    def staging_shape(self, blocks: int) -> tuple[int, ...]:
        return (blocks, len(self.layers), *self.global_piece_shape)

    def slab_shape(self, rows: int, blocks_per_chunk: int) -> tuple[int, ...]:
        return (rows, blocks_per_chunk, len(self.layers), *self.global_piece_shape)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    mesh: Mesh
    num_blocks: int
    num_layers: int
    groups: tuple[LayerGroup, ...]

    @classmethod
    def from_caches(cls, kv_caches: Sequence[jax.Array], mesh: Mesh | None = None,
                    head_replicas: int = 1, kv_groups: Sequence[Sequence[int]] | None = None) -> "KVLayout":
        """``head_replicas``: how many times tpu-inference repeated each KV head
        (padded heads / the model's heads; 1 when TP does not exceed the heads).

        ``kv_groups[i]``: the id lists that address array ``i``'s blocks
        (default ``(0,)``: the request's block ids). Sliding-window layers
        stored by their window are ``(1,)``. An array in several lists (as
        vLLM's hybrid KV-cache manager lays out layers of different groups in
        one tensor) is in one of our groups per list."""
        if not kv_caches:
            raise ValueError("the runner has no KV caches to offload")
        first = kv_caches[0]
        if mesh is None:
            if not isinstance(first.sharding, NamedSharding):
                raise ValueError(f"KV cache sharding {first.sharding!r} is not a NamedSharding; pass the mesh")
            mesh = first.sharding.mesh
        num_blocks = first.shape[0]
        by_key: dict[tuple, list[int]] = {}
        shardings: dict[tuple, NamedSharding] = {}
        for i, cache in enumerate(kv_caches):
            if cache.shape[0] != num_blocks:
                raise ValueError(
                    f"layer {i} has {cache.shape[0]} blocks, layer 0 has {num_blocks}; "
                    "all layers must share one block table"
                )
            s = cache.sharding
            spec = _spec(s, cache.ndim)
            for kv_group in (kv_groups[i] if kv_groups is not None else (0,)):
                key = (int(kv_group), tuple(cache.shape[1:]), np.dtype(cache.dtype), spec)
                by_key.setdefault(key, []).append(i)
                shardings.setdefault(key, s if isinstance(s, NamedSharding) else NamedSharding(mesh, PartitionSpec()))
        groups = tuple(
            _group(mesh, key, tuple(layers), shardings[key], num_blocks, head_replicas)
            for key, layers in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[1][0]))
        )
        return cls(mesh=mesh, num_blocks=num_blocks, num_layers=len(kv_caches), groups=groups)

    # ---- shardings ------------------------------------------------------
    @property
    def program_mesh(self) -> Mesh:
        return auto_mesh(self.mesh)

    def sharding(self, *spec, memory_kind: str = "device") -> NamedSharding:
        return NamedSharding(self.program_mesh, PartitionSpec(*spec), memory_kind=memory_kind)

    def staging_sharding(self, g: LayerGroup) -> NamedSharding:
        return self.sharding(*self.staging_spec(g))

    def slab_sharding(self, g: LayerGroup, memory_kind: str) -> NamedSharding:
        """(slot row, block in chunk, layer, *piece): under DP attention the rows over the ranks, so a
        rank's partition of the slots (connector/dp.py) lives in its own devices' host memory."""
        return self.sharding(block_entry(g), None, None, *g.piece_spec, memory_kind=memory_kind)

    @staticmethod
    def staging_spec(g: LayerGroup) -> tuple:
        """(block, layer, *the pieces' spec for a block's own dims); under DP attention the staging
        blocks split over the ranks: rank r stages its own blocks, on its own devices."""
        return (block_entry(g), None, *g.piece_spec)

    def replicated(self) -> NamedSharding:
        return self.sharding()

    # ---- sizes ----------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Distinct bytes of one block across all layers and devices (what a chunk stores per block)."""
        return sum(g.block_bytes for g in self.groups)

    @property
    def replicated_block_bytes(self) -> int:
        return sum(g.replicated_block_bytes for g in self.groups)

    @property
    def ranks(self) -> int:
        """Attention-DP ranks (1 without DP attention); every group's caches split their blocks alike."""
        return max(g.ranks for g in self.groups)

    @property
    def kv_groups(self) -> int:
        """Id lists a chunk carries for these layers (2 with sliding-window layers in "window" mode)."""
        return 1 + max(g.kv_group for g in self.groups)

    def device_block_bytes(self) -> int:
        """One device's share of a block in our buffers (sizes staging per device)."""
        return sum(g.device_block_bytes for g in self.groups)


_AUTO_MESHES: dict = {}


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``AxisType.Auto`` (the same object if it already is)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    key = (mesh.axis_names, tuple(d.id for d in mesh.devices.flat), mesh.devices.shape)
    out = _AUTO_MESHES.get(key)
    if out is None:
        out = _AUTO_MESHES[key] = Mesh(mesh.devices, mesh.axis_names,
                                       axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return out


def _group(mesh: Mesh, key: tuple, layers: tuple, sharding: NamedSharding, num_blocks: int,
           head_replicas: int) -> LayerGroup:
    kv_group, block_shape, dtype, spec = key
    block_axes = tuple(a for a in _axes(spec[0]) if mesh.shape[a] > 1)
    split = math.prod(mesh.shape[a] for a in block_axes)
    if split > 1 and head_replicas > 1:
        raise ValueError(
            f"the KV cache's block dimension is split over mesh axes {block_axes} (data-parallel attention) "
            f"and its KV heads are repeated {head_replicas} times: not supported together")
    # DP attention splits the block dimension over ranks: a block lives on its rank's devices only, and
    # stays there: staging and the host slabs split over the ranks the same way (rank-local), so storing a
    # block moves it between one rank's devices and their host memory, never between ranks.
    copies = tuple(a for a in mesh.axis_names if a in replicated_axes(mesh, spec))
    local = list(block_shape)
    shard_axes: list[str] = []
    for dim, entry in enumerate(spec[1:]):
        axes = _axes(entry)
        ways = math.prod(mesh.shape[a] for a in axes)
        if local[dim] % ways:
            raise ValueError(f"KV cache dim {dim + 1} of size {local[dim]} is not divisible by its {ways} shards")
        local[dim] //= ways
        shard_axes += axes
    head_axes = _axes(spec[1 + HEAD_DIM]) if len(spec) > 1 + HEAD_DIM else ()
    head_shards = math.prod(mesh.shape[a] for a in head_axes)
    split_dim, replicas = TOKEN_DIM, max(1, head_replicas)
    if copies:  # MLA: a whole copy on every device along these axes; each keeps a slice of it
        if head_replicas > 1:
            raise ValueError(f"a KV cache both replicated over mesh axes {list(copies)} and with repeated heads")
        replicas = math.prod(mesh.shape[a] for a in copies)
        # the replicas' axes go on a dim no mesh axis (of size > 1) splits, the most major that divides
        free = [d for d in range(len(local)) if all(mesh.shape[a] == 1 for a in _axes(spec[1 + d]))]
        split_dim = next((d for d in free if local[d] % replicas == 0), None)
        if split_dim is None:
            raise ValueError(
                f"the KV cache (block shape {block_shape}) is replicated over mesh axes {list(copies)} "
                f"({replicas} identical copies, as tpu-inference keeps MLA's latent cache) and no block "
                f"dimension divides into {replicas} slices: the connector would store every copy")
        shard_axes += copies
    elif head_replicas > 1 and (head_shards % head_replicas or local[TOKEN_DIM] % head_replicas):
        raise ValueError(
            f"KV heads repeated {head_replicas} times do not fit the cache layout: {head_shards} head shards over "
            f"mesh axes {head_axes}, {local[TOKEN_DIM]} tokens per device and block")
    return LayerGroup(
        layers=layers, block_shape=block_shape, dtype=dtype, cache_spec=spec, cache_sharding=sharding,
        local_block_shape=tuple(local), shard_axes=tuple(shard_axes),
        shards=math.prod(mesh.shape[a] for a in shard_axes), head_axes=head_axes, head_shards=head_shards,
        replicas=replicas, kv_group=kv_group, split_dim=split_dim, replica_axes=copies, block_axes=block_axes,
        ranks=split,
    )


def block_entry(g: LayerGroup):
    """The PartitionSpec entry of our buffers' block (or slot) dimension: the ranks' axes under DP attention."""
    if not g.block_axes:
        return None
    return g.block_axes[0] if len(g.block_axes) == 1 else g.block_axes


def _divided(shape: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return tuple(n // by if d == dim else n for d, n in enumerate(shape))


def replicated_axes(mesh: Mesh, spec) -> list[str]:
    """Mesh axes (of size > 1) a cache's spec does not split it over: every device along them holds the same bytes."""
    used = {a for entry in spec for a in _axes(entry)}
    return [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used]


def _spec(sharding, ndim: int) -> tuple:
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return tuple(_freeze(s) for s in spec[:ndim])
    return (None,) * ndim


def _freeze(entry):
    return tuple(entry) if isinstance(entry, list) else entry


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)
