"""The router's view: subscribe to an engine's KV events and keep what it says each tier holds.

Decodes with vLLM's own types (``vllm.distributed.kv_events.KVEventBatch``), as llm-d's
router does with the same wire format. Per medium ("GPU", "CPU", "STORAGE") the listener
keeps a reference count per block hash (the offloading connector may re-announce a hash,
and consumers are expected to count), so ``blocks(medium)`` is the set a router believes
is resident there.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict


class KVEventListener:
    def __init__(self, endpoint: str, topic: str = ""):
        """``endpoint``: where the engine's publisher binds (use ``ipc://`` or ``tcp://*:N``
        on the engine side; vLLM connects instead of binding to any other tcp address)."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._refs: dict[str, Counter] = defaultdict(Counter)
        self.stored_events: Counter = Counter()  # medium -> BlockStored events
        self.removed_events: Counter = Counter()
        self.stored_blocks: Counter = Counter()  # medium -> block hashes announced stored
        self.removed_blocks: Counter = Counter()
        self.untracked_removals: Counter = Counter()  # removed without a prior store
        self.tokenless_stored: Counter = Counter()  # BlockStored without token ids (a key-only placeholder)
        self.untagged = 0  # events with no medium
        self.cleared = 0
        self.batches = 0
        self.seq_gaps = 0
        self.decode_errors = 0
        self._last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            if len(parts) != 3:
                self.decode_errors += 1
                continue
            seq = int.from_bytes(parts[1], "big", signed=True)
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.seq_gaps += 1
            self._last_seq = seq
            try:
                batch = self._decoder.decode(parts[2])
            except Exception:  # noqa: BLE001 - counted and reported, never hidden
                self.decode_errors += 1
                continue
            with self._lock:
                self.batches += 1
                for ev in batch.events:
                    self._apply(ev)

    def _apply(self, ev) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(ev, AllBlocksCleared):
            self.cleared += 1
            self._refs.clear()
            return
        medium = ev.medium
        if medium is None:
            self.untagged += 1
            medium = "?"
        refs = self._refs[medium]
        if isinstance(ev, BlockStored):
            self.stored_events[medium] += 1
            self.stored_blocks[medium] += len(ev.block_hashes)
            if not ev.token_ids:
                self.tokenless_stored[medium] += 1
            for h in ev.block_hashes:
                refs[_hkey(h)] += 1
        elif isinstance(ev, BlockRemoved):
            self.removed_events[medium] += 1
            self.removed_blocks[medium] += len(ev.block_hashes)
            for h in ev.block_hashes:
                k = _hkey(h)
                if refs[k] <= 0:
                    self.untracked_removals[medium] += 1
                    refs.pop(k, None)
                elif refs[k] == 1:
                    del refs[k]
                else:
                    refs[k] -= 1

    def blocks(self, medium: str) -> set:
        """Block hashes the events say are resident in ``medium`` now."""
        with self._lock:
            return {h for h, n in self._refs.get(medium, {}).items() if n > 0}

    def summary(self) -> dict:
        with self._lock:
            media = sorted(set(self.stored_events) | set(self.removed_events))
            return {
                "batches": self.batches, "seq_gaps": self.seq_gaps, "decode_errors": self.decode_errors,
                "untagged_events": self.untagged, "all_cleared": self.cleared,
                "by_medium": {m: {
                    "stored_events": self.stored_events[m], "removed_events": self.removed_events[m],
                    "stored_blocks": self.stored_blocks[m], "removed_blocks": self.removed_blocks[m],
                    "untracked_removals": self.untracked_removals[m],
                    "tokenless_stored_events": self.tokenless_stored[m],
                    "resident_blocks": sum(1 for n in self._refs.get(m, {}).values() if n > 0),
                } for m in media},
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def _hkey(h) -> bytes | int:
    """Block hashes arrive as bytes or int (vLLM's ``ExternalBlockHash``)."""
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h
