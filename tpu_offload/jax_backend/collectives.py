"""The collectives' small print: ring pairs in mesh order, and where bytes must cross as raw bits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def ring(axes: tuple, mesh_shape: dict, pairs: list) -> tuple:
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


def bits(dtype):
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def collectives_as_bits(layout) -> bool:
    """The one place the CPU and TPU programs differ. XLA:CPU's collective-permute of bf16 goes
    through f32 and quiets NaN payloads (0x7fbf -> 0x7fc0), so on CPU the replicas' slices cross
    as raw bits (one block's slice, never a cache). On TPU the permute is a plain DMA, and the
    extra reinterpretation would cost the scatter 1x more HBM traffic (the TPU compiler's figure)."""
    return layout.program_mesh.devices.flat[0].platform == "cpu"
