"""Turns the manager's chunk events into vLLM KV events (medium "CPU").

llm-d's precise prefix scorer keys on *block* hashes, so a chunk event fans
out to the chunk's constituent block hashes, with its tokens and parent hash
(the self-describing payload vLLM's own offloading connector sends). The
payload is captured when the store is planned (the request is alive then) and
reduced to the block hashes once stored, so removals can name the same
blocks. Memory stays bounded by the tier's chunk count.
"""

from __future__ import annotations

from tpu_offload.connector import compat
from tpu_offload.core.keys import ChunkKey, key_block_hash, key_group


class EventTranslator:
    def __init__(self, block_size: int, blocks_per_chunk: int):
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self._pending: dict[ChunkKey, tuple] = {}  # planned stores: full payload
        self._stored: dict[ChunkKey, tuple] = {}  # in the tier: block hashes only

    def record(self, key: ChunkKey, request, chunk_idx: int) -> None:
        first = chunk_idx * self.bpc
        hashes = tuple(request.block_hashes[first : first + self.bpc])
        parent = request.block_hashes[first - 1] if first > 0 else None
        tokens = tuple(request.all_token_ids[first * self.block_size : (first + self.bpc) * self.block_size])
        self._pending[key] = (hashes, parent, tokens, compat.lora_of(request))

    def translate(self, chunk_events) -> list:
        out = []
        for ev in chunk_events:
            if ev.removed:
                hashes = []
                for key in ev.keys:
                    hashes.extend(self._stored.pop(key, None) or (key_block_hash(key),))
                    self._pending.pop(key, None)
                out.append(compat.BlockRemoved(
                    block_hashes=[compat.maybe_convert_block_hash(h) for h in hashes], medium=compat.MEDIUM_CPU,
                ))
                continue
            for key in ev.keys:
                payload = self._pending.pop(key, None)
                if payload is None:  # stored without a planned payload (should not happen): key-only event
                    hashes, parent, tokens, (lora_id, lora_name) = (key_block_hash(key),), None, (), (None, None)
                else:
                    hashes, parent, tokens, (lora_id, lora_name) = payload
                self._stored[key] = hashes
                out.append(compat.BlockStored(
                    block_hashes=[compat.maybe_convert_block_hash(h) for h in hashes],
                    parent_block_hash=compat.maybe_convert_block_hash(parent) if parent is not None else None,
                    token_ids=list(tokens),
                    block_size=self.block_size,
                    lora_id=lora_id,
                    medium=compat.MEDIUM_CPU,
                    lora_name=lora_name,
                    group_idx=key_group(key),
                ))
        return out

    def forget(self, key: ChunkKey) -> None:
        """A planned store that failed: drop its payload."""
        self._pending.pop(key, None)

    def reset(self) -> None:
        self._pending.clear()
