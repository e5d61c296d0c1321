"""What the paged KV cache looks like, read once from the runner's arrays.

tpu-inference keeps one ``jax.Array`` per attention layer, shaped
``(num_blocks, *block_shape)`` (NHD: block_size, packed K/V heads, head_dim)
and sharded with KV heads over the model axis. Layers of one shape form a
group (hybrid models have several); every buffer we allocate is per group and
keeps the cache's sharding of the block dimensions, so each device (and each
host process) only ever touches its own head shards.

Every program is compiled against ``program_mesh``: the cache mesh's devices
and axis names with ``AxisType.Auto`` axes. tpu-inference builds Auto meshes,
``jax.make_mesh`` builds Explicit ones, and code inside ``shard_map`` sees
Manual ones; a compiled program accepts arrays from any of them (same devices,
same layout), and its outputs that go back to the runner carry the cache's own
sharding, so the runner never sees a foreign mesh.

Data moves as raw bits (a same-width unsigned dtype): XLA:CPU rewrites bf16
updates into f32 over the whole operand, which breaks in-place donation; bits
cost nothing to reinterpret on any backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits_dtype(dtype) -> np.dtype:
    itemsize = np.dtype(dtype).itemsize
    if itemsize not in _BITS:
        raise ValueError(f"unsupported KV dtype {dtype} ({itemsize} bytes per element)")
    return np.dtype(_BITS[itemsize])


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block shape, dtype and sharding."""

    layers: tuple[int, ...]  # indices into runner.kv_caches
    block_shape: tuple[int, ...]  # cache.shape[1:]
    dtype: np.dtype
    block_spec: tuple  # PartitionSpec entries of the block dims
    cache_sharding: NamedSharding

    @property
    def bits(self) -> np.dtype:
        return bits_dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across this group's layers, all shards."""
        return math.prod(self.block_shape) * np.dtype(self.dtype).itemsize * len(self.layers)

    def staging_shape(self, blocks: int) -> tuple[int, ...]:
        return (blocks, len(self.layers), *self.block_shape)

    def slab_shape(self, rows: int, blocks_per_chunk: int) -> tuple[int, ...]:
        return (rows, blocks_per_chunk, len(self.layers), *self.block_shape)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    mesh: Mesh
    num_blocks: int
    num_layers: int
    groups: tuple[LayerGroup, ...]

    @classmethod
    def from_caches(cls, kv_caches: Sequence[jax.Array], mesh: Mesh | None = None) -> "KVLayout":
        if not kv_caches:
            raise ValueError("the runner has no KV caches to offload")
        first = kv_caches[0]
        sharding = first.sharding
        if mesh is None:
            if not isinstance(sharding, NamedSharding):
                raise ValueError(f"KV cache sharding {sharding!r} is not a NamedSharding; pass the mesh")
            mesh = sharding.mesh
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
            spec = _block_spec(s, cache.ndim)
            key = (tuple(cache.shape[1:]), np.dtype(cache.dtype), spec)
            by_key.setdefault(key, []).append(i)
            shardings.setdefault(key, s if isinstance(s, NamedSharding) else NamedSharding(mesh, PartitionSpec()))
        groups = tuple(
            LayerGroup(
                layers=tuple(layers),
                block_shape=key[0],
                dtype=key[1],
                block_spec=key[2],
                cache_sharding=shardings[key],
            )
            for key, layers in sorted(by_key.items(), key=lambda kv: kv[1][0])
        )
        return cls(mesh=mesh, num_blocks=num_blocks, num_layers=len(kv_caches), groups=groups)

    # ---- shardings ------------------------------------------------------
    @property
    def program_mesh(self) -> Mesh:
        return auto_mesh(self.mesh)

    def sharding(self, *spec, memory_kind: str = "device") -> NamedSharding:
        return NamedSharding(self.program_mesh, PartitionSpec(*spec), memory_kind=memory_kind)

    def staging_sharding(self, g: LayerGroup) -> NamedSharding:
        return self.sharding(None, None, *g.block_spec)

    def slab_sharding(self, g: LayerGroup, memory_kind: str) -> NamedSharding:
        return self.sharding(None, None, None, *g.block_spec, memory_kind=memory_kind)

    def replicated(self) -> NamedSharding:
        return self.sharding()

    # ---- sizes ----------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """One block across all layers and shards (what a chunk stores per block)."""
        return sum(g.block_bytes for g in self.groups)

    def device_block_bytes(self) -> int:
        """The largest per-device share of one block (sizes staging per device)."""
        return sum(_per_device_bytes(g.block_bytes, g.block_spec, self.mesh) for g in self.groups)


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


def _block_spec(sharding, ndim: int) -> tuple:
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return tuple(_freeze(s) for s in spec[1:ndim])
    return (None,) * (ndim - 1)


def _freeze(entry):
    return tuple(entry) if isinstance(entry, list) else entry


def _per_device_bytes(total: int, spec: tuple, mesh: Mesh) -> int:
    split = 1
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None:
                split *= mesh.shape[axis]
    return -(-total // split)
