"""Turns the tiers' chunk events into vLLM KV events (media "CPU" and "STORAGE").

llm-d's precise prefix scorer keys on *block* hashes, so a chunk event fans
out to the chunk's constituent block hashes, with its tokens and parent hash
(the self-describing payload vLLM's own offloading connector sends). The
payload is captured when the store is planned (the request is alive then) and
kept, tokens as int32, while the chunk is in the host tier or announced in the
file tier, so removals name the same blocks. Tokens cost 4 bytes per token
against the KV's kilobytes, so this stays small next to the tiers themselves.

The file tier (``files``): the worker reports files it published or removed
(``FileJournal``, in the worker report); a published chunk is announced
``STORAGE``, a removed one retracted. A write-back file lands after its
chunk left the host tier, so the payloads of recently evicted chunks are
kept a while (``LEAVING``). At most ``max_files`` chunks are announced; past
that the oldest is retracted (the router under-counts, never over-counts).
"""

from __future__ import annotations

import collections

import numpy as np

from tpu_offload.connector import compat
from tpu_offload.core.keys import ChunkKey, key_block_hash, key_group

MEDIUM_STORAGE = "STORAGE"
LEAVING = 4096  # payloads kept after a host eviction, for a file that lands later
MAX_FILES = 1 << 18


class EventTranslator:
    def __init__(self, block_size: int, blocks_per_chunk: int, max_files: int = MAX_FILES):
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.max_files = max_files
        self._pending: dict[ChunkKey, tuple] = {}  # planned stores
        self._payload: dict[ChunkKey, tuple] = {}  # in the host tier or announced in files
        self._cpu: set[ChunkKey] = set()
        self._files: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()  # announced, oldest first
        self._leaving: collections.OrderedDict[ChunkKey, tuple] = collections.OrderedDict()
        self._out: list = []  # file-tier events since the last translate
        self.partial_file_events = 0  # announced without tokens (payload long gone)

    def record(self, key: ChunkKey, request, chunk_idx: int) -> None:
        first = chunk_idx * self.bpc
        hashes = tuple(request.block_hashes[first : first + self.bpc])
        parent = request.block_hashes[first - 1] if first > 0 else None
        tokens = np.asarray(request.all_token_ids[first * self.block_size : (first + self.bpc) * self.block_size],
                            dtype=np.int32)
        self._pending[key] = (hashes, parent, tokens, compat.lora_of(request))

    def translate(self, chunk_events) -> list:
        out = []
        for ev in chunk_events:
            if ev.removed:
                hashes = []
                for key in ev.keys:
                    payload = self._payload.get(key)
                    hashes.extend(payload[0] if payload else (key_block_hash(key),))
                    self._pending.pop(key, None)
                    self._cpu.discard(key)
                    if key not in self._files:
                        self._payload.pop(key, None)
                        if payload is not None:
                            self._leave(key, payload)
                out.append(self._removed(hashes, compat.MEDIUM_CPU))
                continue
            for key in ev.keys:
                payload = self._pending.pop(key, None) or self._payload.get(key) or self._leaving.pop(key, None)
                if payload is None:  # stored without a planned payload (should not happen): key-only event
                    payload = ((key_block_hash(key),), None, np.zeros(0, np.int32), (None, None))
                self._payload[key] = payload
                self._cpu.add(key)
                out.append(self._stored(key, payload, compat.MEDIUM_CPU))
        out.extend(self._out)
        self._out = []
        return out

    # ---- the file tier ------------------------------------------------------------
    def files(self, published, removed) -> None:
        """Files the worker published / removed this step (announced at the next ``translate``)."""
        for key in published:
            if key in self._files:
                continue
            payload = self._payload.get(key) or self._leaving.pop(key, None) or self._pending.get(key)
            if payload is None:
                self.partial_file_events += 1
                payload = ((key_block_hash(key),), None, np.zeros(0, np.int32), (None, None))
            self._payload[key] = payload
            self._files[key] = None
            self._out.append(self._stored(key, payload, MEDIUM_STORAGE))
            if len(self._files) > self.max_files:
                self._retract(next(iter(self._files)))
        for key in removed:
            if key in self._files:
                self._retract(key)

    def _retract(self, key: ChunkKey) -> None:
        del self._files[key]
        payload = self._payload[key] if key in self._cpu else self._payload.pop(key)
        self._out.append(self._removed(list(payload[0]), MEDIUM_STORAGE))

    def _leave(self, key: ChunkKey, payload: tuple) -> None:
        self._leaving[key] = payload
        if len(self._leaving) > LEAVING:
            self._leaving.popitem(last=False)

    # ---- vLLM event types ----------------------------------------------------------
    def _stored(self, key: ChunkKey, payload: tuple, medium: str):
        hashes, parent, tokens, (lora_id, lora_name) = payload
        return compat.BlockStored(
            block_hashes=[compat.maybe_convert_block_hash(h) for h in hashes],
            parent_block_hash=compat.maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=tokens.tolist(),
            block_size=self.block_size,
            lora_id=lora_id,
            medium=medium,
            lora_name=lora_name,
            group_idx=key_group(key),
        )

    @staticmethod
    def _removed(hashes: list, medium: str):
        return compat.BlockRemoved(block_hashes=[compat.maybe_convert_block_hash(h) for h in hashes], medium=medium)

    def forget(self, key: ChunkKey) -> None:
        """A planned store that failed: drop its payload."""
        self._pending.pop(key, None)

    def reset(self) -> None:
        """The file tier moves to a fresh namespace: every announced file is retracted."""
        for key in list(self._files):
            self._retract(key)
        self._pending.clear()
        self._leaving.clear()
