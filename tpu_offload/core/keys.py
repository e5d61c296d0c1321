"""Chunk keys and the layout fingerprint that namespaces everything we store.

A chunk key is vLLM's ``OffloadKey`` shape: the chained hash of the chunk's
*last* block followed by the KV-group index as 4 big-endian bytes. Because
block hashes chain over the whole prefix, the key identifies the full prefix
up to the chunk end, so equal keys mean equal KV for an equal layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import NewType, Sequence

ChunkKey = NewType("ChunkKey", bytes)

_GROUP_BYTES = 4


def make_chunk_key(block_hash: bytes, group_idx: int = 0) -> ChunkKey:
    if not 0 <= group_idx < 2**32:
        raise ValueError(f"group_idx {group_idx} out of range [0, 2**32)")
    return ChunkKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big"))


def key_block_hash(key: ChunkKey) -> bytes:
    return key[:-_GROUP_BYTES]


def key_group(key: ChunkKey) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


def chunk_keys_from_block_hashes(
    block_hashes: Sequence[bytes], blocks_per_chunk: int, group_idx: int = 0
) -> list[ChunkKey]:
    """One key per *full* chunk: the hash of every ``blocks_per_chunk``-th block."""
    return [
        make_chunk_key(block_hashes[i], group_idx)
        for i in range(blocks_per_chunk - 1, len(block_hashes), blocks_per_chunk)
    ]


@dataclasses.dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that makes two chunks with one key hold different bytes.

    Stored data from a different fingerprint must never be served, so the
    fingerprint names the storage namespace and is checked on every file read.
    """

    model: str
    dtype: str
    block_size: int
    blocks_per_chunk: int
    num_layers: int
    kv_heads_per_rank: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""
    engine: str = ""

    def digest(self) -> bytes:
        """16 bytes, stable across processes and Python versions."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=16).digest()

    def namespace(self) -> str:
        """Directory-safe name: readable model prefix plus the digest."""
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model).strip("._") or "model"
        return f"{model[:64]}-{self.digest().hex()}"
