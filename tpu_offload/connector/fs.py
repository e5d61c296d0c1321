"""The shared-filesystem tier under the TPU host tier (``shared_storage_path``).

The scheduler only asks "does a file exist for this key" (one ``stat``, no
side effects); the worker moves bytes between host slots and files with the
core ``FileTier``. A chunk's host bytes are spread over one buffer per
device shard, so they go through a small pool of preallocated contiguous
buffers: a write copies the slot out (then the slot may be reused at once),
a read fills a buffer on an I/O thread and the step loop copies it into the
slot. When every buffer is busy a write waits in a queue (one entry per
slot) and a read waits for the next step: bounded memory, never a block.

Tenants: every lookup, write and read takes the request's ``cache_salt``
(``salt``, carried in the scheduler's orders): with the tier's secret, files
are named, signed and verified with keys derived from the secret and that
salt (``core/fs/auth.py``), as on vLLM; b"" is the deployment's own keys.

Modes: ``write_through`` writes every chunk when its host store completes;
``write_back`` keeps a stored chunk only in host RAM ("dirty") until the
first of: ``fs_write_back_lag_s`` has passed (a background thread queues it,
so an idle engine still publishes it), the host tier evicts it, or shutdown
(``close`` writes every dirty chunk), as vLLM's ``FileLink`` does. A chunk
the lag already wrote is not written again when it is evicted. Single
process only for now (a multi-host replica would need one namespace per
process).

Threads: the step loop and the write-back thread share the write side
(queue, buffers, dirty slots) under one lock, so the thread never copies a
slot that the step loop is about to fill: ``overwrite`` takes the lock and
forgets the slot before any store or promotion into it is dispatched.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import numpy as np

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.lag import LagDrain
from tpu_offload.core.fs.journal import FileJournal
from tpu_offload.core.fs import kdfsalt
from tpu_offload.core.fs.auth import Names
from tpu_offload.core.fs.deadline import BoundedCalls
from tpu_offload.core.fs.layout import published_stat
from tpu_offload.core.fs.reset import bind_weights, reset_salt as _reset_salt, salted  # noqa: F401  (salted: re-exported)
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint

log = logging.getLogger(__name__)

_BUFFER_BYTES_CAP = 1 << 30  # host RAM for the copy buffers, on top of the host tier
_WARN_EVERY_S = 60.0


def fingerprint(vllm_config, kv_cache_config, blocks_per_chunk: int) -> LayoutFingerprint:
    """The same on both sides: built from vLLM's config and KV spec only."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        raise ConfigError("shared_storage_path needs the engine's KV-cache spec")
    from tpu_offload.connector.sizing import first_spec

    spec = first_spec(groups[0].kv_cache_spec)  # what the scheduler's config holds too
    tp = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    fp = LayoutFingerprint(
        model=str(vllm_config.model_config.model), dtype=str(spec.dtype),
        block_size=vllm_config.cache_config.block_size, blocks_per_chunk=blocks_per_chunk,
        num_layers=sum(len(g.layer_names) for g in groups), kv_heads_per_rank=spec.num_kv_heads,
        head_dim=spec.head_size, tp_size=tp, engine="tpu-inference",
    )
    # The weights too (model revision, fs_reset_epoch_file): files and a snapshot of older weights under the same
    # model name are never found. Both sides read the same config, so they agree.
    return bind_weights(fp, _epoch_file(vllm_config), getattr(vllm_config.model_config, "revision", None))


def _epoch_file(vllm_config) -> str | None:
    """``fs_reset_epoch_file`` as the config has it (kv_connector_extra_config, else the environment)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    path = extra.get("fs_reset_epoch_file") if isinstance(extra, dict) else None
    return path or os.environ.get("TPU_OFFLOAD_FS_RESET_EPOCH_FILE") or None


def reset_salt(cfg: OffloadConfig, previous: str) -> str:
    """The namespace salt after a reset (``core/fs/reset.py``), from ``fs_reset_epoch_file``."""
    return _reset_salt(cfg.fs_reset_epoch_file, previous)


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
        # names as the worker's tier has them: the same secret, salted with the same salt file in the root
        self._auth = (kdfsalt.auth_for_root(cfg.fs_secret, self._root, dir_mode=cfg.fs_dir_mode)
                      if cfg.fs_secret else None)
        self.names = Names(self._root, fp, self._auth)
        self.ns_dir = self.names.ns_dir
        self._seen: set[tuple[ChunkKey, bytes]] = set()
        # the scheduler thread never waits longer than fs_io_timeout_s on a hung mount: a miss instead
        self._bounded = BoundedCalls(cfg.fs_io_timeout_s, name="fs-lookup-stat") if cfg.fs_io_timeout_s else None

    def reset(self, salt: str) -> None:
        """Look only in the namespace salted with ``salt`` from now on."""
        self.names = Names(self._root, salted(self._fp, salt), self._auth)
        self.ns_dir = self.names.ns_dir
        self._seen.clear()

    def contains(self, key: ChunkKey, salt: bytes = b"") -> bool:
        """``salt``: the request's ``cache_salt`` (with a secret, each tenant's files have their own names)."""
        if (key, salt) in self._seen:
            return True
        # Never os.path.exists: it follows a symlink planted at the key or on the way, and counts a FIFO.
        khex = self.names.file_id(key, salt).hex()
        st = published_stat(self.ns_dir, khex) if self._bounded is None else \
            self._bounded.call(published_stat, self.ns_dir, khex)
        if st is not None:
            self._seen.add((key, salt))
            return True
        return False

    def new_step(self) -> None:
        self._seen.clear()


class FsMover:
    """Worker side: host slot <-> file through preallocated contiguous buffers.

    A write is queued by slot (at most one per slot, so the queue is bounded
    by the host tier) and copied out as buffers free up. The worker calls
    ``overwrite`` before anything writes into a slot: a queued write of that
    slot is copied now if a buffer is free, else dropped, so a file never gets
    the slot's next bytes. Every drop is counted (``drops``, the worker stats
    and ``tpu_offload_fs_dropped_writes``) and logged, rate-limited.
    """

    def __init__(self, cfg: OffloadConfig, fp: LayoutFingerprint, engine, metrics=None, buffers: int | None = None):
        self.engine = engine
        self.write_back = cfg.fs_write_mode == "write_back"
        nbytes = sum(v.size for v in engine.row_views(0))  # this process's bytes of one chunk
        self._cfg, self._fp, self._nbytes, self._metrics = cfg, fp, nbytes, metrics
        self.tier = FileTier.from_config(cfg, fp, nbytes, metrics)
        # Reported to the scheduler, also without KV events: a published file clears its "failed to load" mark.
        self.tier.journal = FileJournal()
        n = buffers if buffers is not None else buffer_count(cfg, nbytes)
        self._bufs = [np.empty(nbytes, dtype=np.uint8) for _ in range(n)]
        self._free = list(range(n))
        self._lock = threading.Lock()
        self._reads: list[tuple[int, int, int, bool]] = []  # (op_id, slot, buf, ok) finished on I/O threads
        self._writing: list = []  # (WriteTicket, buf) in flight
        # slot -> (key, the request's cache_salt), FIFO
        self._pending: collections.OrderedDict[int, tuple[ChunkKey, bytes]] = collections.OrderedDict()
        self.drops: collections.Counter[str] = collections.Counter()
        self._drops_taken = 0
        self._warned_at = -1e9
        self._wlock = threading.RLock()  # the write side: step loop and write-back thread
        # write_back: slot -> (key, salt, when its store completed), oldest first; and slots whose
        # current bytes the lag already queued (an eviction does not write them again)
        self._dirty: collections.OrderedDict[int, tuple[ChunkKey, bytes, float]] = collections.OrderedDict()
        self._clean: dict[int, ChunkKey] = {}
        self.lag_writes = self.shutdown_writes = 0
        self.write_back_lag_s = cfg.fs_write_back_lag_s if self.write_back else None
        self._drainer = None
        if self.write_back_lag_s is not None:
            self._drainer = LagDrain(lambda lag: self.drain(older_than=lag), self.write_back_lag_s,
                                     "tpu-offload-fs-write-back", has_work=lambda: bool(self._pending or self._dirty))

    @property
    def dropped_writes(self) -> int:
        return sum(self.drops.values())

    def take_drops(self) -> int:
        """Drops since the last call (for the per-step worker stats)."""
        total = self.dropped_writes
        new, self._drops_taken = total - self._drops_taken, total
        return new

    def reset(self, salt: str) -> None:
        """Read and write only the namespace salted with ``salt`` from now on.

        The old tier finishes its queued writes (into the old namespace) and
        closes on a thread, so the step loop never waits on the filesystem.
        Writes still waiting for a buffer hold KV of the old weights: discarded.
        """
        with self._wlock:
            if self._pending or self._dirty:
                log.info("tpu_offload: cache reset: %d queued and %d write-back file writes of old KV discarded",
                         len(self._pending), len(self._dirty))
            self._pending.clear()
            self._dirty.clear()
            self._clean.clear()
        old, self.tier = self.tier, FileTier.from_config(self._cfg, salted(self._fp, salt), self._nbytes,
                                                         self._metrics)
        self.tier.journal, old.journal = old.journal, None  # the old namespace is retracted as a whole
        # KV of the old weights is never read again: its files go, or every reset would leak a namespace.
        threading.Thread(target=old.retire, kwargs={"timeout": 60}, name="tpu-offload-fs-retire", daemon=True).start()

    def lease(self, renews, leases) -> None:
        """The scheduler's session leases of one step: renewals first, then the prefixes of finished requests."""
        self.tier.apply_lease_orders(renews, leases)

    # ---- writes ------------------------------------------------------------
    def write(self, key: ChunkKey, slot: int, salt: bytes = b"") -> None:
        """Queue the slot's file write (named and signed for ``salt``); copied out now or on a later ``pump``."""
        slot = int(slot)
        with self._wlock:
            self._pending.pop(slot, None)
            self._pending[slot] = (key, bytes(salt))
            self.pump()

    def stored(self, key: ChunkKey, slot: int, salt: bytes = b"") -> None:
        """A store into ``slot`` completed: write it now (write_through) or within the lag (write_back)."""
        if not self.write_back:
            self.write(key, slot, salt)
            return
        with self._wlock:
            slot = int(slot)
            self._clean.pop(slot, None)
            self._dirty.pop(slot, None)
            self._dirty[slot] = (key, bytes(salt), time.monotonic())
        if self.write_back_lag_s == 0 and self._drainer is not None:
            self._drainer.poke()

    def evicted(self, key: ChunkKey, slot: int, salt: bytes = b"") -> None:
        """The host tier evicted the chunk in ``slot`` (write_back): write it unless the lag already did."""
        with self._wlock:
            slot = int(slot)
            dirty = self._dirty.pop(slot, None)
            if dirty is None and self._clean.get(slot) == key:
                return  # written (or queued) since its store
            self._clean.pop(slot, None)
            self.write(key, slot, dirty[1] if dirty is not None and dirty[0] == key else salt)

    @property
    def dirty_chunks(self) -> int:
        """write_back chunks only in host RAM so far."""
        return len(self._dirty)

    def drain(self, older_than: float | None, why: str = "lag") -> int:
        """Queue the writes of dirty chunks stored at least ``older_than`` seconds ago (None: all), oldest first."""
        queued = 0
        with self._wlock:
            cutoff = None if older_than is None else time.monotonic() - older_than
            while self._dirty:
                slot, (key, salt, t0) = next(iter(self._dirty.items()))
                if cutoff is not None and t0 > cutoff:
                    break
                del self._dirty[slot]
                self._pending.pop(slot, None)
                self._pending[slot] = (key, salt)
                self._clean[slot] = key
                queued += 1
            if why == "shutdown":
                self.shutdown_writes += queued
            else:
                self.lag_writes += queued
            if self._pending:  # these and any still waiting for a buffer (an idle engine pumps nothing)
                self.pump()
        return queued

    def pending_writes(self) -> int:
        return len(self._pending)

    def pump(self) -> None:
        """Copy queued writes into free buffers, oldest first (step loop and write-back threads)."""
        with self._wlock:
            while self._pending:
                buf = self._take()
                if buf is None:
                    return
                slot, (key, salt) = self._pending.popitem(last=False)
                self._copy_out(key, slot, buf, salt)

    def overwrite(self, slots) -> None:
        """``slots`` are about to get new bytes: write their queued chunks now or drop them."""
        with self._wlock:
            if self._dirty or self._clean:
                for slot in slots:
                    self._clean.pop(int(slot), None)
                    if self._dirty.pop(int(slot), None) is not None:  # evicted with no write-back order
                        self._drop("slot_reused", 1)
            if self._pending:
                self._overwrite_pending(slots)

    def _overwrite_pending(self, slots) -> None:
        for slot in slots:
            queued = self._pending.pop(int(slot), None)
            if queued is None:
                continue
            buf = self._take()
            if buf is None:
                self._drop("slot_reused", 1)
            else:
                self._copy_out(queued[0], int(slot), buf, queued[1])

    def _copy_out(self, key: ChunkKey, slot: int, buf: int, salt: bytes = b"") -> None:
        if not self.engine.valid[slot]:  # dropped from the host tier since it was queued
            self._give(buf)
            self._drop("slot_invalid", 1)
            return
        out, off = self._bufs[buf], 0
        for view in self.engine.row_views(slot):
            out[off : off + view.size] = view
            off += view.size
        ticket = self.tier.submit_write(key, out, salt)
        if ticket is None:  # the tier refused it (read-only, closed): it counts its own metric
            self._give(buf)
            self._drop(f"tier_{self.tier.state.value}", 1, counted=True)
            return
        self._writing.append((ticket, buf))  # the buffer comes back when the write ends

    def count_drop(self, reason: str) -> None:
        """A write the worker could not even queue (the chunk's host bytes never arrived)."""
        self._drop(reason, 1)

    def _drop(self, reason: str, n: int, counted: bool = False) -> None:
        self.drops[reason] += n
        if not counted:
            self.tier.fs_metrics.for_tier(self.tier.name).dropped(reason, n)
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("tpu_offload: file tier write dropped (%s); %d dropped so far %s: the shared directory "
                        "lacks those chunks", reason, self.dropped_writes, dict(self.drops))

    # ---- reads -------------------------------------------------------------
    def read(self, op_id: int, key: ChunkKey, slot: int, salt: bytes = b"", deadline_s: float | None = None) -> bool:
        """Queue a file read for ``slot`` (verified with ``salt``'s keys); False if no buffer is free (retry later).

        ``deadline_s``: the load's hedge (``core/costs.py``): past it the read is reported failed."""
        with self._wlock:
            buf = self._take()
        if buf is None:
            return False

        def done(ok: bool, op_id=op_id, slot=slot, buf=buf):
            with self._lock:
                self._reads.append((op_id, slot, buf, ok))

        if not self.tier.submit_read(key, self._bufs[buf], done, salt, deadline_s=deadline_s):
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

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued and every write_back chunk (bounded by ``timeout``), then flush and close the tier."""
        deadline = time.monotonic() + timeout
        if self._drainer is not None:
            self._drainer.stop(timeout)
        self.drain(older_than=None, why="shutdown")
        while self._pending and time.monotonic() < deadline:
            self.pump()
            time.sleep(0.001)
        if self._pending:
            self._drop("shutdown", len(self._pending))
            self._pending.clear()
        self.tier.flush(timeout=max(0.0, deadline - time.monotonic()))
        self.tier.close(timeout=30)


def buffer_count(cfg: OffloadConfig, chunk_bytes: int) -> int:
    """Two buffers per I/O thread keep every thread busy; never more than the tier's queue or the byte cap."""
    return max(1, min(cfg.fs_queue_depth, 2 * cfg.fs_threads, _BUFFER_BYTES_CAP // max(1, chunk_bytes)))
