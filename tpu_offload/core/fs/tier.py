"""The shared-filesystem tier: host chunk bytes <-> one file per chunk.

Why it is built this way:

* The engine must never block on a filesystem: writes are queued on a fixed
  thread pool and dropped (and counted) when the queue is full or the tier
  cannot write; reads are synchronous (``read_into``) or queued before writes.
* A file is published by ``rename`` of a fully written ``O_EXCL`` temp file,
  so other processes, a ``kill -9`` or ENOSPC never expose a partial chunk,
  and two writers of one key are harmless (same bytes, last rename wins).
* Every read re-checks the header (magic, version, layout, key, length) and
  the payload checksum; anything else is a miss, counted, and the file is
  deleted or quarantined. Wrong bytes are never returned as a hit.
* ENOSPC, a read-only mount or EACCES turn the tier read-only (or off) with
  one warning; callers only see dropped writes and misses.
* One action by a tenant never turns it off for good: a directory of ours
  with a wrong mode is set back, whatever blocks one of our names is moved
  into the quarantine (``helddir.HeldDir``), and what cannot be repaired is
  read-only or off, said once, and retried every ``readonly_retry_s``. A
  namespace directory moved aside and replaced is not ours any more: off at
  once, the scheduler told (``_lost``), the path vetted again at the retry.
* Eviction re-checks each victim just before the unlink: a file another
  replica read (restamped) since our rescan chose it is kept.
* Recency is the file mtime (restamped on access, throttled), so LRU order is
  shared with other instances and the ``tpu-offload-fs evict`` CLI, and
  survives restarts; the in-memory index is rebuilt from the directory off
  its lock, so a rescan of 150k files never stalls ``touch`` or a read.
* The volume is hostile (other tenants): nothing below the namespace is
  followed if it is a symlink, a FIFO or device at a key is a miss, an
  unreadable subdirectory is skipped and counted, only our own names are
  ever deleted, and ages are judged on the file server's clock.
* Session leases (``core/leases.py``): eviction takes the chunks a
  session leased only after every unleased file in the index, until the
  lease expires, at most ``lease_max_fraction`` of the budget. The table is
  this process's (keyed by on-disk id): it orders our own evictions only;
  other replicas sharing the namespace evict by their own tables.
* A checksum is not authentication: with a secret (``auth``) every file
  carries a keyed MAC, names are keyed hashes, and a file that fails the MAC
  is a miss counted as ``auth_failures``, never served and never deleted
  (someone else made it). Without one the tier says once that it is
  unauthenticated. The index is keyed by the on-disk id (the key itself
  without a secret), since a rescan only sees names.
"""

from __future__ import annotations

import collections
import errno
import hmac
import logging
import os
import stat
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tpu_offload.core.fs import kdfsalt, layout, safedir, tempcap
from tpu_offload.core.fs.auth import Names
from tpu_offload.core.fs.chunkfile import ChunkFiles, identity
from tpu_offload.core.fs.deadline import BoundedCalls
from tpu_offload.core.fs.format import FLAG_HEAD, HEAD_MAC_OFF, HEADER_SIZE, HeaderError, parse_header
from tpu_offload.core.fs.index import FileIndex
from tpu_offload.core.fs.journal import FileJournal
from tpu_offload.core.fs.metrics import FsMetrics
from tpu_offload.core.fs.rescan import Rescanner
from tpu_offload.core.fs.ticket import TierState
from tpu_offload.core.fs.tier_reads import ReadPath
from tpu_offload.core.fs.tier_writes import SPACE_ERRNOS, WritePath
from tpu_offload.core.fs.workers import IOWorkers
from tpu_offload.core import leases as _leases
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint
from tpu_offload.core.manager import TierStats

if TYPE_CHECKING:
    from tpu_offload.core.config import OffloadConfig
    from tpu_offload.core.metrics import OffloadMetrics

log = logging.getLogger("tpu_offload.fs")

_UNAUTH_WARNED = False  # once per process
_NO_BUDGET_WARNED = False  # once per process
_ROOTS_WARNED: set[str] = set()  # roots found writable by others without the sticky bit (warned once each)


class CapacityError(ValueError):
    """``capacity_bytes`` below one chunk file; ``from_config`` words it as a config error."""

    def __init__(self, capacity_bytes: int, need: int):
        super().__init__(f"capacity_bytes={capacity_bytes} is smaller than one chunk file "
                         f"({need} bytes); allowed: at least that, or None")
        self.capacity_bytes, self.need = capacity_bytes, need


class FileTier(WritePath, ReadPath):
    def __init__(
        self,
        root: str,
        fingerprint: LayoutFingerprint,
        chunk_bytes: int,
        *,
        capacity_bytes: int | None,
        threads: int = 8,
        queue_depth: int = 256,
        fsync: bool = False,
        o_direct: bool = False,
        metrics: "OffloadMetrics | None" = None,
        fs_metrics: FsMetrics | None = None,
        name: str = "fs",
        quarantine: bool = False,
        stale_tmp_s: float = 600.0,
        rescan_interval_s: float = 60.0,
        readonly_retry_s: float = 30.0,
        touch_interval_s: float = 1.0,
        rescan_bytes: int | None = None,
        secret: bytes | None = None,
        dir_mode: int = layout.DIR_MODE,
        encrypt: bool = False,
        mac: str = "hmac-sha256",
        io_timeout_s: float | None = None,
        lease_max_fraction: float = 0.0,
        lease_max_sessions: int = 4096,
    ):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if capacity_bytes is not None and capacity_bytes < HEADER_SIZE + chunk_bytes:
            raise CapacityError(capacity_bytes, HEADER_SIZE + chunk_bytes)
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if encrypt and not secret:
            raise ValueError("encrypt needs a secret (the keys are derived from it)")
        if mac not in ("hmac-sha256", "gmac"):
            raise ValueError(f"mac {mac!r}; allowed: 'hmac-sha256' or 'gmac'")
        if dir_mode not in (0o700, 0o750):
            raise ValueError(f"dir_mode {dir_mode:o}; allowed: 0700 or 0750")
        self.dir_mode = dir_mode
        # Deadline of every read and write (deadline.py): past it a read is a miss, a write is dropped.
        self.io_timeout_s = io_timeout_s
        self._stats_bounded = BoundedCalls(io_timeout_s, name=f"{name}-stat") if io_timeout_s else None
        self._tls = threading.local()  # per I/O thread: the bounce buffer of deadline reads
        self._uid = os.geteuid()  # every directory we use must be this uid's (``safedir.check_ours``)
        self.name = name
        self.root = os.path.abspath(root)
        self.fingerprint = fingerprint
        self.names = Names(self.root, fingerprint, kdfsalt.auth_for_root(secret, self.root, dir_mode=dir_mode)
                           if secret else None)  # salted per deployment: the salt file in the root
        self.ns_dir = self.names.ns_dir
        self._tk = self.names.keys()  # None without a secret
        self._key_of: dict[bytes, bytes] = {}  # file id -> chunk key, for the journal (with a secret)
        # file id -> inode of a file that failed its MAC: absent for ``contains``, and our next write of
        # the chunk replaces it (temp + rename over it) instead of keeping "a file of the right size".
        self._suspect: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        # file id -> identity (st_dev, st_ino, st_ctime_ns) of the file we last published or verified
        # there: the only file ``touch`` restamps and the only one that makes a write of the chunk
        # unnecessary. An inode number alone is reused by the filesystem; its ctime changes with it.
        self._ours: dict[bytes, tuple[int, int, int]] = {}
        self.chunk_bytes = chunk_bytes
        self.file_bytes = HEADER_SIZE + chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.queue_depth = queue_depth
        self.quarantine = quarantine
        self.rescan_interval_s = rescan_interval_s
        # Rescan also after this many bytes written: N writers sharing one budget then stay within
        # budget + N * rescan_bytes (plus writes in flight) between rescans; see docs/file-tier/README.md.
        if rescan_bytes is None and capacity_bytes is not None:
            rescan_bytes = max(HEADER_SIZE + chunk_bytes, capacity_bytes // 16)
        self.rescan_bytes = rescan_bytes
        self._written_since_scan = 0
        self.readonly_retry_s = readonly_retry_s
        self._warned_repairs: set[str] = set()
        self.files = ChunkFiles(self.ns_dir, self.names.digest, fsync=fsync, o_direct=o_direct, name=name,
                                dir_mode=dir_mode, owner=self._uid, encrypt=encrypt, mac=mac,
                                report=self._repaired, on_lost=self._lost)
        self._index = FileIndex(touch_interval_s)
        # Session leases, keyed by on-disk id; None without a budget (nothing is evicted) or with a share of 0.
        # Used by the engine's thread (lease, renew) and the I/O threads (eviction): ``_lease_lock``.
        self.leases = (_leases.table_for(lease_max_fraction, lease_max_sessions, capacity_bytes // self.file_bytes)
                       if capacity_bytes is not None else None)
        self._lease_lock = threading.Lock()
        self._scanner = Rescanner(self.ns_dir, self._index, name=name, stale_tmp_s=stale_tmp_s, count=self._count,
                                  writable=lambda: self._state is TierState.RW, owner=self._uid,
                                  file_bytes=self.file_bytes, head_ok=self._head_ok if self._tk else None,
                                  writes_per_writer=threads,
                                  temp_cap_bytes=tempcap.temp_cap_bytes(capacity_bytes),
                                  dir_mode=dir_mode, report=lambda path, why: self._repaired("mode", path, why))
        self._lock = threading.RLock()  # state, counters, in-flight writes
        self._inflight: dict[bytes, Future] = {}
        self._writes = 0
        self._counts: collections.Counter[str] = collections.Counter()
        self._touch_q: dict[bytes, None] = {}
        self._touch_scheduled = False
        self._state = TierState.RW
        self._retry_at: float | None = None
        self._warned = False
        self._warned_errnos: set[int | str] = set()
        self._fs_total = 0
        self._offload_metrics = metrics
        if fs_metrics is None:
            fs_metrics = FsMetrics.for_registry(metrics.registry, metrics.labels) if metrics else FsMetrics()
        self.fs_metrics = fs_metrics
        self._m = fs_metrics.for_tier(name)
        self._workers: IOWorkers | None = None
        self._journal: FileJournal | None = None  # set by an adapter that reports to its scheduler
        self._probe_error: OSError | None = None
        self._warn_unauthenticated()
        self._workers = IOWorkers(threads, name=f"{name}-io")  # also when off: the retries run on it
        self._open_namespace()
        fs_metrics.add_tier(name, self.usage)
        if metrics is not None:
            metrics.add_tier(name, self.stats)

    @classmethod
    def from_config(
        cls, cfg: "OffloadConfig", fingerprint: LayoutFingerprint, chunk_bytes: int,
        metrics: "OffloadMetrics | None" = None, **kw,
    ) -> "FileTier | None":
        """The configured tier, or None when no ``shared_storage_path`` is set."""
        if not cfg.shared_storage_path:
            return None
        if not cfg.fs_secret and not cfg.fs_allow_unauthenticated:  # a config built without from_sources
            from tpu_offload.core.config import _check_authenticated

            _check_authenticated({"shared_storage_path": cfg.shared_storage_path})
        try:
            tier = cls(
                cfg.shared_storage_path, fingerprint, chunk_bytes,
                capacity_bytes=cfg.fs_capacity_bytes, threads=cfg.fs_threads,
                queue_depth=cfg.fs_queue_depth, fsync=cfg.fs_fsync, o_direct=cfg.fs_o_direct,
                metrics=metrics, secret=cfg.fs_secret, dir_mode=cfg.fs_dir_mode, encrypt=cfg.fs_encrypt,
                mac=cfg.fs_mac, **{"io_timeout_s": cfg.fs_io_timeout_s, "lease_max_fraction": cfg.lease_max_fraction,
                                   "lease_max_sessions": cfg.lease_max_sessions, **kw},
            )
            tier._warn_no_budget()  # an engine's start: say it once when the shared tier has no budget
            return tier
        except CapacityError as e:  # checked (once) by the constructor, before it touches anything
            from tpu_offload.core.config import ConfigError

            raise ConfigError(
                f"fs_capacity_bytes: value {e.capacity_bytes} is not allowed; allowed: at least one "
                f"chunk file, {e.need} bytes ({chunk_bytes} of KV + a {HEADER_SIZE}-byte header), or unset"
            ) from None

    # ---- lookups -------------------------------------------------------
    @property
    def state(self) -> TierState:
        return self._state

    @property
    def journal(self) -> FileJournal | None:
        return self._journal

    @journal.setter
    def journal(self, j: FileJournal | None) -> None:
        """Outcomes for the scheduler; an off tier says so at once (no file hits are offered meanwhile)."""
        self._journal = j
        if j is not None and self._state is TierState.OFF:
            j.tier_state(off=True)

    @property
    def authenticated(self) -> bool:
        return self._tk is not None

    def path_of(self, key: ChunkKey, salt: bytes = b"") -> str:
        return layout.chunk_dir_and_path(self.ns_dir, self._fid(key, salt=salt).hex())[1]

    def _keys(self, salt: bytes):
        """Tenant keys for a request's ``cache_salt`` (b"": the deployment's own); None without a secret."""
        return self._tk if not salt or self._tk is None else self.names.keys(bytes(salt))

    def _fid(self, key: bytes, remember: bool = False, salt: bytes = b"") -> bytes:
        """The chunk's on-disk id (raises ValueError for a bad key).

        ``remember``: the file will be in the index, so its removal must be
        journaled under the key (with a secret the name cannot give it back).
        """
        layout.key_hex(key)
        if self._tk is None:
            return bytes(key)
        fid = self._keys(salt).file_id(key)
        if remember:
            self._key_of[fid] = bytes(key)
        return fid

    def _journal_removed(self, fid: bytes) -> None:
        key = self._key_of.pop(fid, None) if self._tk is not None else fid
        if key is not None and self.journal is not None:
            self.journal.removed(key)

    def _head_ok(self, hdr: bytes, name: str | None) -> bool:
        """Did one of our writers sign this header for this namespace (and, given ``name``, this file)?"""
        try:
            h = parse_header(hdr)
        except HeaderError:
            return False
        if not h.flags & FLAG_HEAD or h.digest != self.names.digest or (name is not None and h.key.hex() != name):
            return False
        return hmac.compare_digest(self._tk.head_mac(memoryview(hdr)[:HEAD_MAC_OFF]), h.head_mac)

    def _warn_no_budget(self) -> None:
        global _NO_BUDGET_WARNED
        if self.capacity_bytes is None and not _NO_BUDGET_WARNED:
            _NO_BUDGET_WARNED = True
            log.warning("fs tier %s at %s has no budget (fs_capacity_bytes is not set): nothing but "
                        "`tpu-offload-fs evict` removes its files, and a full volume turns it read-only. Set "
                        "fs_capacity_bytes to what every replica writing this namespace may keep together",
                        self.name, self.root)

    def _warn_unauthenticated(self) -> None:
        global _UNAUTH_WARNED
        if self._tk is None and not _UNAUTH_WARNED:
            _UNAUTH_WARNED = True
            logging.getLogger("tpu_offload.auth").warning("fs tier %s at %s is unauthenticated: anyone who can write the directory can publish "
                        "KV this engine will serve, and file names are hashes of the tokens. Set fs_secret_file "
                        "(or TPU_OFFLOAD_FS_SECRET) to sign chunks and hide names", self.name, self.root)

    def contains(self, key: ChunkKey, salt: bytes = b"") -> bool:
        """Index first; a stat finds files other processes wrote. No side effects.

        Only a regular file reached without a symlink counts: a FIFO,
        directory, device or symlink at the key's path is a miss.
        """
        if self._state in (TierState.OFF, TierState.CLOSED):
            self._maybe_reopen()
            return False
        try:
            fid = self._fid(key, salt=salt)
        except ValueError:
            return False
        if fid in self._suspect:  # failed its MAC: not present until our own copy replaces it
            return False
        if fid in self._index:
            return True
        if self._stats_bounded is not None:  # never block a caller on a hung mount
            st = self._stats_bounded.call(self.files.stat, fid.hex())
        else:
            st = self.files.stat(fid.hex())
        return st is not None and st.st_size == self.file_bytes

    # ---- recency -------------------------------------------------------
    def touch(self, key: ChunkKey, salt: bytes = b"") -> None:
        """Mark as used: index now, file mtime (throttled) on an I/O thread."""
        if self._state in (TierState.OFF, TierState.CLOSED):
            return
        fid = self._fid(key, salt=salt)
        if fid in self._index and not self._index.touch(fid):
            return
        with self._lock:
            self._touch_q[fid] = None
            if self._touch_scheduled or self._workers is None:
                return
            try:
                self._workers.submit(self._touch_task)
                self._touch_scheduled = True
            except RuntimeError:
                pass

    def _touch_task(self) -> None:
        with self._lock:
            keys, self._touch_q = self._touch_q, {}
            self._touch_scheduled = False
        for fid in keys:
            ident = self._ours.get(fid)
            if ident is None:
                continue  # never restamp a file we did not write or verify
            try:
                new = self.files.restamp(fid.hex(), ident)
            except OSError:
                new = None  # evicted meanwhile, or another uid's file
            if new is not None and self._ours.get(fid) == ident:
                self._ours[fid] = new  # the restamp moved its ctime

    def keys_lru_order(self) -> list[bytes]:
        """On-disk ids, least recent first (the chunk keys themselves without a secret)."""
        return self._index.keys_lru_order()

    # ---- session leases ---------------------------------------------------
    def lease(self, session: str, ttl_s: float, keys, salt: bytes = b"") -> int:
        """A request of ``session`` finished: its prefix ``keys`` (head first, named for ``salt``) is evicted
        only after unleased files for ``ttl_s``; returns how many are leased (0: leases off or table full).
        Files still being written are leased too: they are the newest part of the prefix."""
        table = self.leases
        if table is None or self._state is TierState.CLOSED:
            return 0
        try:
            fids = [self._fid(k, salt=salt) for k in keys]
        except ValueError:
            return 0
        with self._lease_lock:
            return table.lease(session, ttl_s, fids)

    def renew(self, session: str, ttl_s: float) -> bool:
        """The session came back: its lease runs ``ttl_s`` from now. False if it holds none here."""
        table = self.leases
        if table is None:
            return False
        with self._lease_lock:
            return table.renew(session, ttl_s)

    def apply_lease_orders(self, renews, leases) -> None:
        """A scheduler's lease orders of one step, for a tier that lives in a worker: renewals first
        ((session, ttl_s)), then finished requests' prefixes ((session, ttl_s, keys head first, salt))."""
        for session, ttl_s in renews:
            self.renew(session, ttl_s)
        for session, ttl_s, keys, salt in leases:
            self.lease(session, ttl_s, keys, salt)

    def _record_leases(self) -> None:
        """Honoured and expired leases to the tier-labelled counters (after evictions and rescans)."""
        if self.leases is not None and self._offload_metrics is not None:
            with self._lease_lock:
                self._offload_metrics.record_leases(self.leases, tier=self.name)

    def take_lease_counts(self) -> tuple[int, int, int]:
        """(leased bytes now, leases honoured, leases expired since the last call), for a caller that reports
        them itself (vLLM's stats channel); the tier's own counters then stay unset (no ``metrics``)."""
        table = self.leases
        if table is None:
            return 0, 0, 0
        with self._lease_lock:
            honoured, expired = table.take_counts()
            return len(table) * self.chunk_bytes, honoured, expired

    # ---- capacity ------------------------------------------------------
    def _evict_to(self, budget: int, spare: bytes | None = None) -> int:
        """Evict least-recent files until the index fits ``budget``; returns files deleted.

        Each victim is re-checked just before the unlink: a file whose
        identity (ctime: a restamp or a rewrite moves it) is no longer what
        our last rescan indexed or what we last wrote or verified was used by
        another replica since the choice. It is kept, back in the index as
        just used, and the next least recent goes instead. Leased files go
        after unleased ones (``FileIndex.pop_lru_until``), ``spare`` (the
        file just written) after those.
        """
        n = 0
        kept: list[tuple[bytes, int]] = []
        kept_bytes = 0
        table = self.leases
        if table is not None:
            with self._lease_lock:
                table.expire()
        while True:
            victims, honoured = self._index.pop_lru_until(budget - kept_bytes, table, spare)
            if not victims:
                break
            if honoured:
                with self._lease_lock:
                    table.honoured += honoured
            for fid, size in victims:
                khex = fid.hex()
                ours = self._ours.get(fid)

                def unchanged(st: os.stat_result, ours=ours, khex=khex) -> bool:
                    return (ours is not None and identity(st) == ours) or self._scanner.unchanged(khex, st)

                try:
                    outcome = self.files.evict(khex, unchanged)
                except OSError as e:
                    log.debug("fs tier %s: evicting %s failed: %s", self.name, khex, e)
                    outcome = "failed"
                if outcome != "used" and table is not None and fid in table:  # out of the index: no lease
                    with self._lease_lock:
                        table.drop((fid,))
                if outcome == "failed":
                    continue
                if outcome == "deleted":
                    n += 1
                    self._journal_removed(fid)
                elif outcome == "used":
                    kept.append((fid, size))
                    kept_bytes += size
        for fid, size in kept:
            self._index.add(fid, size)
        if kept:
            self._count("evictions_skipped_used", len(kept))
            self._m.op("evict", "used_since_chosen", len(kept))
        if n:
            self._count("evicted", n)
            self._m.evicted.inc(n)
            if self._offload_metrics is not None:
                self._offload_metrics.record_evictions(n, tier=self.name)
        self._record_leases()
        return n

    def rescan(self) -> None:
        """Re-read the directory now (new files from other instances, deletions)."""
        self._rescan(block=True)

    def _rescan(self, block: bool) -> None:
        """Re-read the directory (see ``Rescanner``), then enforce the budget."""
        written = self._written_since_scan
        if not self._scanner.run(block):
            return  # another thread is scanning
        self._written_since_scan -= written
        if self._tk is not None and len(self._key_of) > 2 * len(self._index) + 1024:
            idx = self._index
            self._key_of = {f: k for f, k in list(self._key_of.items()) if f in idx}
        if len(self._ours) > 2 * len(self._index) + 1024:
            idx = self._index
            self._ours = {f: i for f, i in list(self._ours.items()) if f in idx}
        if self.capacity_bytes is not None:
            self._enforce_budget()
        self._record_leases()  # leases that ran out while nothing was evicted

    # ---- state ---------------------------------------------------------
    def _open_namespace(self) -> None:
        """Make or adopt the namespace directory, probe it, scan it; on failure off (or read-only), retried.

        Retried every ``readonly_retry_s`` (``_maybe_reopen``): a full disk or
        a directory that cannot be made at start or after a reset must not
        turn the tier off until a restart.
        """
        err, usable = self._prepare_namespace()
        self._warn_shared_root()
        if not usable:
            self._to_off(err)
            return
        self.files.ns.reset()  # vetted just now: adopt it (also after the held one was replaced)
        with self._lock:
            was_off = self._state is TierState.OFF
            self._state, self._retry_at = TierState.RW, None
        if was_off and self._journal is not None:
            self._journal.tier_state(off=False)
        if err is not None:
            self._to_read_only(err)
        try:
            self._rescan(block=True)
        except OSError as e:
            self._to_off(e)

    def _prepare_namespace(self) -> tuple[OSError | None, bool]:
        """(the error, whether the directory is usable at all: read-only when an error comes with True)."""
        ro_err = None
        try:
            layout.make_dirs(self.ns_dir, self.dir_mode)
        except OSError as e:
            if not os.path.isdir(self.ns_dir):
                return e, False
            ro_err = e
        try:  # never followed: whoever made a symlink there, it is not ours
            fd = safedir.open_base(self.ns_dir)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                return OSError(errno.ELOOP, "the namespace directory is a symlink"), False
            return e, False
        try:  # another uid's (a tenant made it first) is never adopted; ours with a wrong mode is repaired
            safedir.check_ours(os.fstat(fd), self._uid, f"namespace directory {self.ns_dir}",
                               repair=self.dir_mode, fd=fd, report=lambda what, why: self._repaired("mode", what, why))
        except OSError as e:
            return e, False
        finally:
            os.close(fd)
        try:
            st = os.statvfs(self.ns_dir)
            self._fs_total = st.f_blocks * st.f_frsize
        except OSError:
            self._fs_total = 0
        if ro_err is None and not self._ns_writable():
            ro_err = self._probe_error or OSError(errno.EACCES, "cannot create a file in the namespace directory")
        return ro_err, True

    def _warn_shared_root(self) -> None:
        """One warning per root that others can write without the sticky bit (``fsGroup`` on an RWX volume).

        There any uid that can write the root can rename our namespace
        directory aside and put its own in its place: the tier notices and
        turns off (``safedir.Replaced``), and stays off while theirs is there.
        """
        try:
            st = os.stat(self.root)
        except OSError:
            return
        if not st.st_mode & 0o022 or st.st_mode & stat.S_ISVTX or self.root in _ROOTS_WARNED:
            return
        _ROOTS_WARNED.add(self.root)
        who = "group and others" if st.st_mode & 0o022 == 0o022 else "its group" if st.st_mode & 0o020 else "others"
        log.warning("fs tier %s: the root %s is writable by %s (mode %o) and has no sticky bit: another uid that "
                    "can write it can rename this tier's namespace directory aside and put its own in its place, "
                    "which turns the tier off on every replica until it is removed. Fix: `chmod +t %s` (as on "
                    "/tmp: then only an entry's owner may rename or delete it), or give each uid its own "
                    "directory under the root", self.name, self.root, who, stat.S_IMODE(st.st_mode), self.root)

    def _repaired(self, what: str, path: str, detail: str) -> None:
        """Self-healing (``safedir``): counted, exported, one warning per kind; the rest at info."""
        self._count(f"repairs_{what}")
        self._m.repair(what)
        if what == "failed":
            msg = (f"fs tier {self.name}: cannot heal {path}: {detail}; the chunks there are not cached, "
                   f"counted in tpu_offload_fs_repairs_total{{what=\"failed\"}}; tried again at each write there")
        else:
            msg = (f"fs tier {self.name}: {path}: {detail}, counted in "
                   f"tpu_offload_fs_repairs_total{{what=\"{what}\"}}" +
                   ("; never deleted, it may not be ours" if what == "moved_aside" else
                    " (someone sharing our uid changed it)"))
        with self._lock:
            first = what not in self._warned_repairs
            self._warned_repairs.add(what)
        (log.warning if first else log.info)(msg)

    def _lost(self, e: OSError) -> None:
        """The namespace directory was replaced under us (``safedir.Replaced``): off, the scheduler told, retried."""
        self._to_off(e)

    def _ns_writable(self) -> bool:
        """Can a file be created (and removed) in the namespace directory now? (``_probe_error`` says why not.)"""
        probe = layout.temp_name("probe")
        try:
            with safedir.dir_at(self.ns_dir) as d:
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 layout.FILE_MODE, dir_fd=d))
                os.unlink(probe, dir_fd=d)
        except OSError as e:
            self._probe_error = e
            return False
        self._probe_error = None
        return True

    def _maybe_reopen(self) -> None:
        """An OFF tier whose retry time has come: open the namespace again, on an I/O thread."""
        with self._lock:
            if self._state is not TierState.OFF or self._retry_at is None or time.monotonic() < self._retry_at \
                    or self._workers is None:
                return
            self._retry_at = None  # one attempt at a time
        try:
            self._workers.submit(self._reopen)
        except RuntimeError:
            pass

    def _reopen(self) -> None:
        self._open_namespace()
        if self._state is not TierState.OFF:
            log.warning("fs tier %s at %s is back (%s)", self.name, self.ns_dir, self._state.value)

    def _to_read_only(self, e: OSError) -> None:
        with self._lock:
            if self._state is not TierState.RW:
                return
            self._state = TierState.READ_ONLY
            self._retry_at = time.monotonic() + self.readonly_retry_s
            self._announce(
                f"fs tier {self.name} at {self.ns_dir} is read-only ({e.strerror or e}); "
                f"writes are dropped and counted, reads continue; writes retried every {self.readonly_retry_s:g}s"
            )

    def _to_off(self, e: OSError) -> None:
        with self._lock:
            if self._state is TierState.CLOSED:
                return
            if self._state is not TierState.OFF and self._journal is not None:
                self._journal.tier_state(off=True)
            self._state = TierState.OFF
            self._retry_at = time.monotonic() + self.readonly_retry_s
            self._announce(f"fs tier {self.name} at {self.ns_dir} is off ({e.strerror or e}); every lookup "
                           f"misses; retried every {self.readonly_retry_s:g}s")

    def _announce(self, msg: str) -> None:
        if self._warned:
            log.info(msg)
        else:
            self._warned = True
            log.warning(msg)

    def _drop(self, reason: str, key: bytes | None = None) -> None:
        with self._lock:
            self._counts["dropped"] += 1
            self._counts[f"dropped_{reason}"] += 1
        self._m.dropped(reason)
        if key is not None and self.journal is not None:
            self.journal.failed(key)

    def _count(self, name: str, n: int = 1, *more) -> None:
        """Add to counters under one lock: ``_count(name, n, name2, n2, ...)``."""
        with self._lock:
            self._counts[name] += n
            for i in range(0, len(more), 2):
                self._counts[more[i]] += more[i + 1]

    # ---- lifecycle and stats -------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued I/O; then re-read the directory and enforce the budget.

        The rescan makes the last instance to flush see every file all
        instances wrote, so a shared directory ends within the budget.
        """
        if self._workers is None:
            return True
        ok = self._workers.drain(timeout)
        if ok and self.capacity_bytes is not None and self._state in (TierState.RW, TierState.READ_ONLY):
            try:
                self._rescan(block=True)
            except OSError as e:
                log.debug("fs tier %s: rescan failed: %s", self.name, e)
        return ok

    def close(self, timeout: float | None = None) -> None:
        if self._state is TierState.CLOSED:
            return
        self.flush(timeout)
        if self._workers is not None:
            self._workers.close(timeout)
        with self._lock:
            self._state = TierState.CLOSED
        self.files.close()
        self.fs_metrics.remove_tier(self.name, self.usage)

    def retire(self, timeout: float | None = None) -> int:
        """Finish queued I/O, delete every file of ours this tier knows, close. Returns files deleted.

        For a namespace nobody will read again (the KV of weights replaced by
        a reset): left behind, each reset would leak a budget's worth of disk
        that no tier evicts. Only files with our magic go.
        """
        if self._state is TierState.CLOSED:
            return 0
        if self._workers is not None:
            self._workers.drain(timeout)
        try:
            self._scanner.run(block=True)  # what other instances wrote there too
        except OSError:
            pass
        n = self._evict_to(0) if self._state is not TierState.OFF else 0
        self.close(timeout)
        return n

    def __enter__(self) -> "FileTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> TierStats:
        budget = self.capacity_bytes if self.capacity_bytes is not None else self._fs_total
        return TierStats(
            capacity_chunks=budget // self.file_bytes,
            used_chunks=len(self._index),
            pinned_chunks=0,
            pending_chunks=self._writes,
            chunk_bytes=self.chunk_bytes,
            leased_chunks=len(self.leases) if self.leases is not None else 0,
        )

    def usage(self) -> dict:
        budget = self.capacity_bytes if self.capacity_bytes is not None else self._fs_total
        return {
            "capacity_bytes": budget, "used_bytes": self._index.used_bytes, "files": len(self._index),
            "writes_in_flight": self._writes, "state": self._state.value,
            "unreadable_paths": len(self._scanner.unreadable), "foreign_entries": self._scanner.foreign,
        }

    def counters(self) -> dict[str, int]:
        """Monotonic event counts (for tests, logs and the CLI)."""
        with self._lock:
            return dict(self._counts)
