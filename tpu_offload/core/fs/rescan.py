"""Rebuilding a tier's index from its namespace directory, on the file server's clock.

Why a rescan: other instances write and delete in the same directory, so
the index must be merged with it now and then (at start, every
``rescan_interval_s`` of writes, at flush). Why the server's clock: hosts
sharing a volume disagree on the time, and a file's mtime was stamped by the
server, so ages and recency are judged against a probe file's mtime: a host
whose clock runs ahead must not reap a live writer's temp file, and a file
stamped in the future is set back to now so that it ages and can be evicted.
A crashed writer's temp is reaped at start if its pid-and-boot tagged name
says its writer (on this host) is gone, and by any rescan once it is older
than ``stale_tmp_s`` on the server's clock or has not changed (inode, size,
mtime) for ``stale_tmp_s`` of our own monotonic time across rescans: a temp
stamped in the future by a host whose clock runs ahead (or a server clock we
cannot read) cannot keep it alive, and a live writer changes it.
The index is rebuilt off its lock (``FileIndex.adopt``), paced, so a rescan
of 150k files never stalls the engine thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from tpu_offload.core.fs import actions, layout, tempcap
from tpu_offload.core.fs.index import FileIndex

log = logging.getLogger("tpu_offload.fs")


class Rescanner:
    def __init__(self, ns_dir: str, index: FileIndex, *, name: str, stale_tmp_s: float,
                 count: Callable[..., None], writable: Callable[[], bool], owner: int | None = None,
                 file_bytes: int | None = None, head_ok: Callable[[bytes, str | None], bool] | None = None,
                 writes_per_writer: int = 8, temp_cap_bytes: int | None = None, dir_mode: int | None = None,
                 report: Callable[[str, str], None] | None = None):
        self.ns_dir = ns_dir
        # Ours: our magic (with a secret, a header MAC that verifies) and one link. Anything else in the
        # namespace is foreign: never counted, never deleted (``actions.ours_at``).
        self.head_ok = head_ok
        # Chunk name -> (hash of (dev, ino, ctime_ns, size), ours?) for every chunk-named file the last
        # scan looked at, ours or not: junk at chunk names costs one header read per change, not one per
        # rescan (a round trip each on NFS). Rebuilt by each scan from the files it saw, so it holds
        # at most one entry per file in the namespace (deleted files drop out).
        self._vetted: dict[str, tuple[int, bool]] = {}
        self._scanned: dict[str, tuple[int, bool]] = {}  # the same, of the last completed scan (what ``unchanged`` asks)
        # The temps that count (``tempcap.split_temps``, the CLI's rule too): at most
        # ``writes_per_writer`` per writer, and at most ``temp_cap_bytes`` in all, so copies of our
        # headers under temp names can never push the budget for chunks below ``capacity - temp_cap_bytes``.
        self.writes_per_writer = max(1, writes_per_writer)
        self.temp_cap_bytes = temp_cap_bytes
        self.dir_mode = dir_mode  # fan-out directories of ours with another mode are set back to it
        self.report = report  # told (path, why) of each such repair
        self.owner = owner  # fan-out directories of another uid and hardlinked files are not indexed
        # A file counts at its allocated size, capped at one chunk file: a sparse 1 TiB file
        # with a chunk's name must not make the budget evict every real chunk.
        self.file_bytes = file_bytes
        self.index = index
        self.name = name
        self.stale_tmp_s = stale_tmp_s
        self._count = count  # the tier's counters: ``count(name, n, ...)``
        self._writable = writable  # no probe file (and no delete) unless the tier may write
        self._lock = threading.Lock()
        self.last = 0.0  # time.monotonic() of the last completed scan
        self.unreadable: list[tuple[str, str]] = []  # (path, why) skipped by the last scan
        self.temp_bytes = 0  # writes in progress (ours, capped) the last scan saw: they count in the budget
        self.foreign = 0  # entries the last scan found that are not ours (never counted or deleted)
        # temp (dirs, name) -> (inode, size, mtime_ns, time.monotonic() when first seen like that)
        self._temps_seen: dict[tuple, tuple[int, int, int, float]] = {}

    def run(self, block: bool) -> bool:
        """Re-read the directory into the index; False if another thread was scanning (and not ``block``)."""
        if not self._lock.acquire(blocking=block):
            return False
        try:
            self.index.begin_rebuild()
            scan = layout.NamespaceScan(os.path.basename(self.ns_dir), self.ns_dir)
            try:
                srv = self.server_now()
                now = srv if srv is not None else self.index.now()
                pace = layout.Pacer()  # the engine thread must get the GIL while we walk
                vetted, self._vetted = self._vetted, {}
                self.index.adopt(
                    ((bytes.fromhex(name), self._bytes(st), self._clamp(name, st, dirs, now))
                     for name, st, dirs in layout.walk_namespace(
                         self.ns_dir, scan, pace, self.owner,
                         vet=lambda d, name, st: self._vet(vetted, d, name, st),
                         repair=self.dir_mode if self._writable() else None, report=self.report)),
                    pace,
                )
            except BaseException:
                self.index.abort_rebuild()
                raise
            live = []
            mono = time.monotonic()
            seen, self._temps_seen = self._temps_seen, {}
            for t in scan.temps:
                # Ages on the server's clock: our clock may run ahead of the writer's.
                # Without it (read-only) we cannot judge an age, and could not delete anyway.
                # A writer of this host (pid namespace) that is gone: its temp goes now.
                # Unchanged for stale_tmp_s of our monotonic time: nobody is writing it.
                # Only ours (our magic, or empty): someone else's file named like our temps stays.
                sig = (t.ino, t.size, t.mtime_ns)
                prev = seen.get((t.dirs, t.name))
                since = prev[3] if prev is not None and prev[:3] == sig else mono
                self._temps_seen[(t.dirs, t.name)] = (*sig, since)
                stale = srv is not None and srv - t.mtime > self.stale_tmp_s
                still = not stale and srv is not None and mono - since > self.stale_tmp_s
                dead = not stale and not still and srv is not None and layout.temp_writer_dead(t.name)
                n = actions.ours(self.ns_dir, t, self.head_ok)
                if n is None:  # junk named like our temps, or a hard link: foreign, never counted or deleted
                    self._temps_seen.pop((t.dirs, t.name), None)
                    scan.foreign.append(t.path)
                    continue
                if (stale or still or dead) and actions.unlink_temp_if_ours(self.ns_dir, t, self.head_ok):
                    self._temps_seen.pop((t.dirs, t.name), None)
                    self._count("stale_temps_removed" if stale else "unchanged_temps_removed" if still
                                else "dead_temps_removed")
                    continue
                live.append(t)
            self.temp_bytes, _ = tempcap.split_temps(
                live, name=lambda t: t.name, size=lambda t: self._bytes_of(t.size, t.blocks),
                mtime=lambda t: t.mtime, cap_bytes=self.temp_cap_bytes, writes_per_writer=self.writes_per_writer)
            self.foreign = len(scan.foreign)
            self._scanned = self._vetted
            self._note_unreadable(scan.unreadable)
            self.last = time.monotonic()
        finally:
            self._lock.release()
        return True

    def _vet(self, vetted: dict[str, tuple[int, bool]], d: int, name: str, st: os.stat_result) -> bool:
        """Is the chunk-named file ``name`` ours? One header read per new (dev, ino, ctime, size), ours or not.

        The ctime (not only the mtime) is part of the identity: any rewrite
        moves it and nobody can set it back, so a verdict cannot outlive the
        bytes it was given for.
        """
        ident = hash((st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size))
        prev = vetted.get(name)
        if prev is not None and prev[0] == ident:
            ours = prev[1]
        else:
            ours = st.st_size != 0 and actions.ours_at(d, name, head_ok=self.head_ok, want_name=name) is not None
        self._vetted[name] = (ident, ours)
        return ours

    @property
    def cached_verdicts(self) -> int:
        """How many files' verdicts (ours or not) the last scan left cached: at most the files it saw."""
        return len(self._vetted)

    def unchanged(self, name: str, st: os.stat_result) -> bool:
        """Is ``st`` the very file the last scan indexed under ``name`` (same dev, inode, ctime and size)?

        A read or a restamp by another replica, or a rewrite, moves the
        ctime: eviction skips such a file (it was used since it was chosen).
        """
        return self._scanned.get(name) == (hash((st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size)), True)

    def _bytes(self, st: os.stat_result) -> int:
        return self._bytes_of(st.st_size, st.st_blocks * 512)

    def _bytes_of(self, size: int, allocated: int) -> int:
        n = min(size, allocated)
        return n if self.file_bytes is None else min(n, self.file_bytes)

    def server_now(self) -> float | None:
        """The file server's clock (a probe file's mtime); also re-aims the index's clock."""
        if not self._writable():
            return None
        t0 = time.time()
        srv = actions.server_now(self.ns_dir)
        local = (t0 + time.time()) / 2
        if srv is not None:
            self.index.offset = srv - local
        return srv

    def _clamp(self, name: str, st: os.stat_result, dirs: tuple[str, ...], now: float) -> float:
        """A file stamped in the future (a host whose clock runs ahead) is aged from now.

        Its mtime is set to now on disk, so it ages for every instance and the
        CLI; otherwise it would sort as most recent forever and never be evicted.
        """
        if not actions.in_future(st.st_mtime, now):
            return st.st_mtime
        try:
            actions.restamp(self.ns_dir, dirs, name, now)
            self._count("future_mtimes_clamped")
        except OSError:
            pass  # read-only, or gone: the index still ages it from now
        return now

    def _note_unreadable(self, unreadable: list[tuple[str, str]]) -> None:
        """Skipped paths: counted, exported, one warning when the set first becomes non-empty."""
        if unreadable:
            self._count("scan_unreadable", len(unreadable))
            if not self.unreadable:
                path, why = unreadable[0]
                log.warning("fs tier %s: %d path(s) under %s could not be read and are skipped "
                            "(first: %s: %s); the rest is served", self.name, len(unreadable),
                            self.ns_dir, path, why)
        self.unreadable = unreadable
