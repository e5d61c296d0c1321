"""Backend-neutral core: keys, config, chunk manager, host pool, metrics, tiers.

Imports neither jax nor torch, so the scheduler process and tools stay light.
"""

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint, chunk_keys_from_block_hashes, make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import ChunkEvent, ChunkManager, Lookup, Medium, StoreAllocation, TierStats
from tpu_offload.core.pool import HostChunkPool
from tpu_offload.core.slots import SlotAllocator

__all__ = [
    "ChunkEvent", "ChunkKey", "ChunkManager", "ConfigError", "HostChunkPool", "LayoutFingerprint",
    "Lookup", "LRUChunkManager", "Medium", "OffloadConfig", "SlotAllocator", "StoreAllocation",
    "TierStats", "chunk_keys_from_block_hashes", "make_chunk_key",
]
