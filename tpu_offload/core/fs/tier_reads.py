"""The file tier's read path: verify every byte before it is a hit, and take bad files out of sight.

A mixin of ``FileTier`` (tier.py), which owns the state these methods use.
A read re-checks header, checksum and (with a secret) the MAC; anything
else is a miss. With ``fs_io_timeout_s`` (or a caller's ``deadline_s``: the
load decision's hedge, ``core/costs.py``) a queued read lands in a
per-thread bounce buffer and reaches the caller's slot only before its
deadline, so a read that un-hangs late never writes into a reused slot.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Callable

import numpy as np

from tpu_offload.core.fs import layout
from tpu_offload.core.fs.chunkfile import CORRUPT, ERROR, HIT, MISS, UNSAFE
from tpu_offload.core.fs.deadline import WATCHDOG
from tpu_offload.core.fs.fileio import aligned_empty, byte_view
from tpu_offload.core.fs.ticket import TierState
from tpu_offload.core.keys import ChunkKey

log = logging.getLogger("tpu_offload.fs")


class ReadPath:
    def read_into(self, key: ChunkKey, out: np.ndarray, salt: bytes = b"") -> bool:
        """Fill ``out`` with the chunk; False on a miss or a rejected file.

        On False ``out`` may hold garbage: the caller must treat it as empty.
        """
        if self._state in (TierState.OFF, TierState.CLOSED):
            self._maybe_reopen()
            return False
        mv = byte_view(out, writable=True)
        if len(mv) != self.chunk_bytes:
            raise ValueError(f"buffer of {len(mv)} bytes; this tier stores {self.chunk_bytes}")
        t0 = time.perf_counter()
        fid = self._fid(key, salt=salt)
        khex = fid.hex()
        outcome, detail = self.files.read(khex, fid, mv, self._keys(salt))
        if outcome is MISS:
            return self._miss(fid)
        if outcome is UNSAFE:
            self._count("read_not_regular")
            self._m.op("read", "not_regular")
            return self._miss(fid)
        if outcome is ERROR:
            return self._read_error(detail, fid)
        if outcome is CORRUPT:
            reason, ino = detail
            return self._reject(fid, khex, ino, reason)
        assert outcome is HIT
        self._m.read_latency.observe(time.perf_counter() - t0)
        self._m.read_bytes.inc(len(mv))
        self._m.op("read", "hit")
        self._count("reads_ok", 1, "bytes_read", len(mv))
        if self._offload_metrics is not None:
            self._offload_metrics.loaded_chunks.labels(tier=self.name, **self._offload_metrics.labels).inc()
        self._ours[fid] = self.files.last_identity()  # verified: this file may be restamped
        self._suspect.pop(fid, None)  # another replica's good copy replaced a forged one
        if fid not in self._index:  # another instance wrote it: restamp its mtime too
            self._index.add(fid, self.file_bytes, disk_time=0.0)
        if self._tk is not None:
            self._key_of[fid] = bytes(key)
        self.touch(key, salt)
        return True

    def submit_read(self, key: ChunkKey, out: np.ndarray, on_done: Callable[[bool], None],
                    salt: bytes = b"", deadline_s: float | None = None) -> bool:
        """Queue ``read_into`` ahead of writes; ``on_done(ok)`` runs on an I/O thread.

        ``deadline_s``: the caller's own bound (a hedged load: past it recomputing wins), on top of
        ``fs_io_timeout_s``; a read past it is reported failed and counted ``read_hedged``.
        False (and no callback) if the tier cannot read at all.
        """
        if self._state in (TierState.OFF, TierState.CLOSED) or self._workers is None:
            self._maybe_reopen()
            return False
        out_mv = byte_view(out, writable=True)
        if len(out_mv) != self.chunk_bytes:
            raise ValueError(f"buffer is not {self.chunk_bytes} bytes")
        timeout, hedged = self.io_timeout_s, False
        if deadline_s is not None and (not timeout or deadline_s < timeout):
            timeout, hedged = max(0.0, deadline_s), True
        if not timeout and not hedged:
            return self._submit_plain_read(key, out, on_done, salt)
        # With a deadline the read lands in a per-thread bounce buffer and is copied into ``out`` only if
        # the deadline has not fired: a read that un-hangs later never writes into a slot reused since.
        lock, state = threading.Lock(), [False]  # reported?

        def report(ok: bool) -> None:
            try:
                on_done(ok)
            except Exception:
                log.exception("fs tier %s: read callback failed", self.name)

        def expire() -> None:
            with lock:
                if state[0]:
                    return
                state[0] = True
            if hedged:  # the load's own bound: the mount is slow, not hung (no warning)
                self._count("read_hedged")
                self._m.op("read", "hedged")
                report(False)
                return
            self._count("read_timeouts")
            self._m.op("read", "timeout")
            if "read_timeout" not in self._warned_errnos:
                self._warned_errnos.add("read_timeout")
                log.warning("fs tier %s: a read passed its deadline (fs_io_timeout_s=%gs); reported failed, the "
                            "request recomputes", self.name, self.io_timeout_s)
            report(False)

        def task() -> bool:
            ok = False
            try:
                buf = self._bounce()
                ok = self.read_into(key, buf, salt)
            finally:
                with lock:
                    late = state[0]
                    if not late:
                        if ok:
                            out_mv[:] = byte_view(buf)
                        state[0] = True
                WATCHDOG.disarm(entry)
                if late:
                    self._count("late_reads_dropped")
                else:
                    report(ok)
            return ok and not late

        entry = WATCHDOG.arm(timeout, expire)
        try:
            self._workers.submit(task, high=True)
        except RuntimeError:
            WATCHDOG.disarm(entry)
            return False
        return True

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = aligned_empty(self.chunk_bytes)
        return buf

    def _submit_plain_read(self, key: ChunkKey, out: np.ndarray, on_done: Callable[[bool], None],
                           salt: bytes = b"") -> bool:
        def task() -> bool:
            ok = False
            try:
                ok = self.read_into(key, out, salt)
            finally:
                try:
                    on_done(ok)
                except Exception:
                    log.exception("fs tier %s: read callback failed", self.name)
            return ok

        try:
            self._workers.submit(task, high=True)
        except RuntimeError:
            return False
        return True

    def _miss(self, fid: bytes) -> bool:
        if fid in self._index:
            self._journal_removed(fid)  # deleted under us (another instance's eviction, an admin)
        self._index.remove(fid)
        if self.leases is not None and fid in self.leases:  # gone: its lease protects nothing any more
            with self._lease_lock:
                self.leases.drop((fid,))
        self._count("read_misses")
        self._m.op("read", "miss")
        return False

    def _read_error(self, e: OSError, fid: bytes | None = None) -> bool:
        """A file that is there but cannot be read (mode 000, a lease, EIO): a miss, hidden until replaced.

        Hidden from ``contains`` and never kept as "already published": the
        recompute's write of the chunk publishes over it (rename), so one bad
        file costs one recompute, not one per request.
        """
        if fid is not None:
            self._index.remove(fid)
            self._ours.pop(fid, None)
            self._suspect[fid] = 0
            self._suspect.move_to_end(fid)
            while len(self._suspect) > 1 << 16:
                self._suspect.popitem(last=False)
        self._count("read_errors")
        self._m.op("read", errno.errorcode.get(e.errno, "error").lower())  # eio, ...: a metric each
        if e.errno not in self._warned_errnos:
            self._warned_errnos.add(e.errno)
            log.warning("fs tier %s: read failed (%s); treated as a miss", self.name, e)
        return False

    def _reject(self, fid: bytes, khex: str, ino: int, reason: str) -> bool:
        """A file that must not be served: count it and take it out of sight."""
        self._index.remove(fid)
        self._journal_removed(fid)
        path = layout.chunk_dir_and_path(self.ns_dir, khex)[1]
        if reason == "mac":  # valid checksums, wrong MAC: made by someone without our key. Not ours to delete.
            self._ours.pop(fid, None)
            self._suspect[fid] = ino  # hidden from contains; our next write of it replaces it
            self._suspect.move_to_end(fid)
            while len(self._suspect) > 1 << 16:
                self._suspect.popitem(last=False)
            self._count("auth_failures")
            self._m.auth_failure()
            self._m.op("read", "auth_failure")
            if "mac" not in self._warned_errnos:
                self._warned_errnos.add("mac")
                log.warning("fs tier %s: %s fails its MAC (written without this tier's key); not served, "
                            "replaced by our next write of that chunk, counted in "
                            "tpu_offload_fs_auth_failures_total", self.name, path)
            return False
        self._count("corrupt", 1, f"corrupt_{reason}", 1)
        self._m.corrupt(reason)
        self._m.op("read", "corrupt")
        if self._offload_metrics is not None:
            self._offload_metrics.record_load_errors(1, tier=self.name)
        log.warning("fs tier %s: rejected %s (%s)", self.name, path, reason)
        try:  # only that inode (not a fresh write since), never through a symlink
            if self.quarantine:
                self.files.quarantine(khex, ino, reason)
            else:
                self.files.unlink(khex, ino, ours=True)  # without our magic it is someone else's: left alone
        except OSError:
            pass  # gone already, or not ours to delete: still a miss
        return False
