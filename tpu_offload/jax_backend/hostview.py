"""Byte views of this process's shards of a host-memory slab, and checksums.

Host-kind (``pinned_host``/``unpinned_host``) buffers are plain CPU memory, so
a shard's bytes can be read in place from its buffer pointer: no copy of the
slab, no device round trip. Only used for the optional per-chunk checksum (and
by tests to corrupt host bytes the way a bad DIMM or a stray write would).
The caller must not hold a view across a transfer that writes the same row.
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np
import xxhash


def shard_bytes(shard: jax.Array) -> np.ndarray:
    """The shard's whole buffer as a writable uint8 view."""
    n = shard.on_device_size_in_bytes()
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(shard.unsafe_buffer_pointer()))


def row_views(slab: jax.Array, row: int) -> list[np.ndarray]:
    """Bytes of ``row`` in each shard this process holds. The slot-major dim is split only under DP
    attention (a rank's rows on its devices); a shard without the row gives nothing."""
    rows = slab.shape[0]
    out = []
    for shard in sorted(slab.addressable_shards, key=lambda s: s.device.id):
        first, stop, _ = shard.index[0].indices(rows)
        if not first <= row < stop:
            continue
        buf = shard_bytes(shard.data)
        stride = buf.size // (stop - first)
        out.append(buf[(row - first) * stride : (row - first + 1) * stride])
    return out


def array_views(a: jax.Array) -> list[np.ndarray]:
    """Bytes of each shard this process holds of a host-kind array (device_put path: one chunk)."""
    return [shard_bytes(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def row_checksum(slabs: list[jax.Array], row: int) -> int:
    """xxh3-64 over the row's bytes in every group's slab and every local shard."""
    return views_checksum([view for slab in slabs for view in row_views(slab, row)])


def views_checksum(views: list[np.ndarray]) -> int:
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest()
