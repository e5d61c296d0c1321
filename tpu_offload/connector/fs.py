"""The shared-filesystem tier under the TPU host tier (``shared_storage_path``).

The scheduler only asks "does a file exist for this key" (one ``stat``, no
side effects); the worker moves bytes between host slots and files with the
core ``FileTier``. A chunk's host bytes are spread over one buffer per
device shard, so they go through a small pool of preallocated contiguous
buffers: a write copies the slot out (then the slot may be reused at once),
a read fills a buffer on an I/O thread and the step loop copies it into the
slot. When every buffer is busy a write is dropped (counted) and a read
waits for the next step: bounded memory, never a block.

Modes: ``write_through`` writes every chunk when its host store completes;
``write_back`` writes a chunk when the host tier evicts it. Single process
only for now (a multi-host replica would need one namespace per process).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import numpy as np

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.layout import chunk_dir_and_path, key_hex
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint

log = logging.getLogger(__name__)


def fingerprint(vllm_config, kv_cache_config, blocks_per_chunk: int) -> LayoutFingerprint:
    """The same on both sides: built from vLLM's config and KV spec only."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        raise ConfigError("shared_storage_path needs the engine's KV-cache spec")
    spec = groups[0].kv_cache_spec
    tp = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    return LayoutFingerprint(
        model=str(vllm_config.model_config.model), dtype=str(spec.dtype),
        block_size=vllm_config.cache_config.block_size, blocks_per_chunk=blocks_per_chunk,
        num_layers=sum(len(g.layer_names) for g in groups), kv_heads_per_rank=spec.num_kv_heads,
        head_dim=spec.head_size, tp_size=tp, engine="tpu-inference",
    )


def salted(fp: LayoutFingerprint, salt: str) -> LayoutFingerprint:
    """The namespace after a reset: KV written before it (old weights) is never found again."""
    return fp if not salt else dataclasses.replace(fp, cache_salt=f"{fp.cache_salt}reset:{salt}")


class FsLookup:
    """Scheduler side: file existence only (the worker verifies on read).

    Another instance may delete a file at any time, so a file seen in a step
    is remembered until the step's metadata is built: the lookup and the
    allocation that follows it must agree. A file gone by the time it is read
    is a load error, recomputed.
    """

    def __init__(self, cfg: OffloadConfig, fp: LayoutFingerprint):
        self._root = os.path.abspath(cfg.shared_storage_path)
        self._fp = fp
        self.ns_dir = os.path.join(self._root, fp.namespace())
        self._seen: set[ChunkKey] = set()

    def reset(self, salt: str) -> None:
        """Look only in the namespace salted with ``salt`` from now on."""
        self.ns_dir = os.path.join(self._root, salted(self._fp, salt).namespace())
        self._seen.clear()

    def contains(self, key: ChunkKey) -> bool:
        if key in self._seen:
            return True
        if os.path.exists(chunk_dir_and_path(self.ns_dir, key_hex(key))[1]):
            self._seen.add(key)
            return True
        return False

    def new_step(self) -> None:
        self._seen.clear()


class FsMover:
    """Worker side: host slot <-> file through preallocated contiguous buffers."""

    def __init__(self, cfg: OffloadConfig, fp: LayoutFingerprint, engine, metrics=None, buffers: int = 8):
        self.engine = engine
        self.write_back = cfg.fs_write_mode == "write_back"
        nbytes = sum(v.size for v in engine.row_views(0))  # this process's bytes of one chunk
        self._cfg, self._fp, self._nbytes, self._metrics = cfg, fp, nbytes, metrics
        self.tier = FileTier.from_config(cfg, fp, nbytes, metrics)
        self._bufs = [np.empty(nbytes, dtype=np.uint8) for _ in range(buffers)]
        self._free = list(range(buffers))
        self._lock = threading.Lock()
        self._reads: list[tuple[int, int, int, bool]] = []  # (op_id, slot, buf, ok) finished on I/O threads
        self._writing: list = []  # (WriteTicket, buf) in flight
        self.dropped_writes = 0

    def reset(self, salt: str) -> None:
        """Read and write only the namespace salted with ``salt`` from now on.

        The old tier finishes its queued writes (into the old namespace) and
        closes on a thread, so the step loop never waits on the filesystem.
        """
        old, self.tier = self.tier, FileTier.from_config(self._cfg, salted(self._fp, salt), self._nbytes,
                                                         self._metrics)
        threading.Thread(target=old.close, kwargs={"timeout": 60}, name="tpu-offload-fs-close", daemon=True).start()

    # ---- writes ------------------------------------------------------------
    def write(self, key: ChunkKey, slot: int) -> bool:
        """Copy the slot out and queue its file write; False if dropped."""
        buf = self._take()
        if buf is None:
            self.dropped_writes += 1
            return False
        out, off = self._bufs[buf], 0
        for view in self.engine.row_views(slot):
            out[off : off + view.size] = view
            off += view.size
        ticket = self.tier.submit_write(key, out)
        if ticket is None:
            self._give(buf)
            self.dropped_writes += 1
            return False
        self._writing.append((ticket, buf))  # the buffer comes back when the write ends
        return True

    # ---- reads -------------------------------------------------------------
    def read(self, op_id: int, key: ChunkKey, slot: int) -> bool:
        """Queue a file read for ``slot``; False if no buffer is free (retry later)."""
        buf = self._take()
        if buf is None:
            return False

        def done(ok: bool, op_id=op_id, slot=slot, buf=buf):
            with self._lock:
                self._reads.append((op_id, slot, buf, ok))

        if not self.tier.submit_read(key, self._bufs[buf], done):
            done(False)
        return True

    def finished_reads(self) -> list[tuple[int, int, bool]]:
        """Copy finished reads into their slots (step loop thread). (op_id, slot, ok) each."""
        with self._lock:
            reads, self._reads = self._reads, []
        out = []
        for op_id, slot, buf, ok in reads:
            if ok:
                src, off = self._bufs[buf], 0
                for view in self.engine.row_views(slot):
                    view[:] = src[off : off + view.size]
                    off += view.size
            self._give(buf)
            out.append((op_id, slot, ok))
        return out

    # ---- buffers -------------------------------------------------------------
    def _take(self) -> int | None:
        if self._writing:
            still = []
            for ticket, buf in self._writing:
                if ticket.done():
                    self._give(buf)
                else:
                    still.append((ticket, buf))
            self._writing = still
        with self._lock:
            return self._free.pop() if self._free else None

    def _give(self, buf: int) -> None:
        with self._lock:
            self._free.append(buf)

    def close(self) -> None:
        self.tier.flush(timeout=30)
        self.tier.close(timeout=30)
