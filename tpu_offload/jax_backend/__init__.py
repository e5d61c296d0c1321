"""JAX data path: HBM staging buffer, host-memory slabs, compiled transfers.

Imported only on the worker side (it imports jax); the scheduler side and
``tpu_offload.core`` never need it.
"""

from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.layout import KVLayout, LayerGroup

__all__ = ["KVLayout", "LayerGroup", "LoadChunk", "StoreChunk", "TransferEngine"]
