"""The file tier's write path: queue, publish by rename, account, and turn read-only on a full disk.

A mixin of ``FileTier`` (tier.py), which owns the state these methods use
(index, queue, counters, keys); split out so each file reads as one path.
A write never blocks the engine: it is queued on the tier's I/O threads and
dropped (and counted by reason) when the queue is full or the tier cannot
write.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from concurrent.futures import Future

import numpy as np

from tpu_offload.core.fs import safedir
from tpu_offload.core.fs.chunkfile import identity
from tpu_offload.core.fs.deadline import WriteGuard
from tpu_offload.core.fs.fileio import byte_view
from tpu_offload.core.fs.ticket import TierState, WriteTicket, done_future
from tpu_offload.core.keys import ChunkKey

log = logging.getLogger("tpu_offload.fs")

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
DENIED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


class WritePath:
    def submit_write(self, key: ChunkKey, data: np.ndarray, salt: bytes = b"") -> WriteTicket | None:
        """Queue a write of ``data`` (a slot view, not copied); None if dropped.

        ``salt``: the request's ``cache_salt`` (with a secret, the file is
        named and signed with that tenant's keys).
        """
        mv = byte_view(data)
        if len(mv) != self.chunk_bytes:
            raise ValueError(f"chunk of {len(mv)} bytes; this tier stores {self.chunk_bytes}")
        self._fid(key)  # validates the key before anything is queued
        with self._lock:
            if self._state is TierState.READ_ONLY and self._retry_at is not None \
                    and time.monotonic() >= self._retry_at:
                self._state, self._retry_at = TierState.RW, None
                log.info("fs tier %s: retrying writes at %s", self.name, self.ns_dir)
            if self._state is not TierState.RW:
                self._drop(self._state.value, key)
                if self._state is TierState.OFF:
                    self._maybe_reopen()  # stores keep coming while the scheduler offers no file hits
                return None
            if key in self._inflight:
                self._count("writes_dedup")
                return WriteTicket(key, done_future(True))
            if self._writes >= self.queue_depth:
                self._drop("queue_full", key)
                return None
            guard = WriteGuard(self.io_timeout_s) if self.io_timeout_s else None
            try:
                fut = self._workers.submit(self._write_task, key, mv, salt, guard)
            except RuntimeError:  # closed under us
                self._drop("closed", key)
                return None
            self._writes += 1
            self._inflight[key] = fut
            fut.add_done_callback(functools.partial(self._write_done, key))
        return WriteTicket(key, fut, guard)

    def _write_done(self, key: bytes, fut: Future) -> None:
        with self._lock:
            self._writes -= 1
            if self._inflight.get(key) is fut:
                del self._inflight[key]
            if fut.cancelled():
                self._drop("cancelled")
        if self.journal is not None:
            ok = not fut.cancelled() and fut.exception() is None and fut.result() is True
            (self.journal.published if ok else self.journal.failed)(key)

    def _write_task(self, key: bytes, mv: memoryview, salt: bytes = b"", guard: WriteGuard | None = None) -> bool:
        if guard is not None:
            guard.start()
            if guard.abandoned:  # the engine took the slot back while this waited in the queue
                self._drop("timeout")
                return False
        if self._state is not TierState.RW:
            self._drop(self._state.value)
            return False
        fid = self._fid(key, remember=True, salt=salt)
        khex = fid.hex()
        replace = fid in self._suspect  # a forged or unreadable file sits there: write over it, never keep it
        ours = None if replace else self._ours.get(fid)
        t0 = time.perf_counter()
        try:
            # Kept only if it is the very file we wrote or verified: anything else there is published over.
            st = self.files.write(fid, khex, mv, keep=None if ours is None else (lambda st: identity(st) == ours),
                                  tk=self._keys(salt), publish=None if guard is None else guard.publish)
        except OSError as e:
            self._write_error(e)
            return False
        if st is not None:  # our own file is still there
            self._index.add(fid, st.st_size, disk_time=st.st_mtime)
            self._count("writes_exist")
            self._m.op("write", "exists")
            return True
        self._ours[fid] = self.files.last_identity()
        if replace and self._suspect.pop(fid, None) is not None:
            self._count("auth_replaced")
            self._m.op("write", "replaced_forged")
        dt = time.perf_counter() - t0
        self._index.add(fid, self.file_bytes)
        self._written_since_scan += self.file_bytes
        self._count("writes_ok", 1, "bytes_written", len(mv))
        self._m.write_bytes.inc(len(mv))
        self._m.write_latency.observe(dt)
        self._m.op("write", "ok")
        if self._offload_metrics is not None:
            self._offload_metrics.stored_chunks.labels(tier=self.name, **self._offload_metrics.labels).inc()
        self._after_write(fid)
        return True

    def _write_error(self, e: OSError) -> None:
        self._count("writes_failed")
        self._m.op("write", "error")
        if e.errno == errno.ETIMEDOUT:  # past fs_io_timeout_s: never published
            self._count("write_timeouts")
            self._drop("timeout")
            if "write_timeout" not in self._warned_errnos:
                self._warned_errnos.add("write_timeout")
                log.warning("fs tier %s: a write passed its deadline (fs_io_timeout_s=%gs); dropped, not "
                            "published, counted in tpu_offload_fs_dropped_writes_total{reason=\"timeout\"}",
                            self.name, self.io_timeout_s)
            return
        if isinstance(e, safedir.Replaced):  # the namespace is not ours any more: the tier is off (``_lost``)
            self._drop("unsafe_path")
            return
        if safedir.is_unsafe(e):  # a symlink or file where a fan-out directory belongs, and not moved aside
            self._drop("unsafe_path")
            if "unsafe" not in self._warned_errnos:
                self._warned_errnos.add("unsafe")
                log.warning("fs tier %s: write refused (%s): something other than a directory is on the "
                            "path below %s; symlinks are never followed", self.name, e, self.ns_dir)
        elif e.errno in SPACE_ERRNOS or e.errno == errno.EROFS or \
                (e.errno in DENIED_ERRNOS and not self._heal_ns() and not self._ns_writable()):
            self._to_read_only(e)  # the whole namespace: read-only, writes retried after readonly_retry_s
            self._drop(errno.errorcode.get(e.errno, "oserror").lower())
        elif e.errno in DENIED_ERRNOS:  # one fan-out directory (or file): that write only, the tier stays
            self._drop(errno.errorcode.get(e.errno, "oserror").lower())
            if ("denied", e.errno) not in self._warned_errnos:
                self._warned_errnos.add(("denied", e.errno))
                log.warning("fs tier %s: a write was refused (%s) in one directory under %s; that chunk is not "
                            "cached, the rest of the tier still writes", self.name, e, self.ns_dir)
        else:
            self._drop(errno.errorcode.get(e.errno, "oserror").lower())  # EIO and the like: one metric each
            if e.errno not in self._warned_errnos:
                self._warned_errnos.add(e.errno)
                log.warning("fs tier %s: write failed (%s); the chunk is not cached", self.name, e)

    def _heal_ns(self) -> bool:
        """A refused write: repair the namespace directory's mode now if that is the cause (True if it was)."""
        try:
            return self.files.ns.heal()
        except OSError:
            return False

    def _after_write(self, fid: bytes | None = None) -> None:
        if self.capacity_bytes is None:
            return
        if time.monotonic() - self._scanner.last >= self.rescan_interval_s or \
                (self.rescan_bytes is not None and self._written_since_scan >= self.rescan_bytes):
            try:
                self._rescan(block=False)  # picks up what other instances wrote
            except OSError as e:
                log.debug("fs tier %s: rescan failed: %s", self.name, e)
        self._enforce_budget(fid)

    def _enforce_budget(self, spare: bytes | None = None) -> None:
        """Our chunk files plus our temps (writes in progress) the last scan saw, within the budget.

        The temps' allowance is capped (``Rescanner.temp_cap_bytes``, a quarter
        of the budget), so no number of temp-named files, ours or not, can
        make the budget for chunks reach zero and evict everything.
        """
        allowance = self._scanner.temp_bytes
        if self._scanner.temp_cap_bytes is not None:
            allowance = min(allowance, self._scanner.temp_cap_bytes)
        budget = max(self.file_bytes, self.capacity_bytes - allowance)
        if self._index.used_bytes > budget:
            self._evict_to(budget, spare)
