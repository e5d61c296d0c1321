"""Operations on a whole shared directory: evict, inspect, verify.

These run while many engine instances write the same directory, so every
step tolerates files vanishing or changing under it (ENOENT is "someone else
did it", a changed inode or mtime is "someone used it, keep it"). Eviction is
LRU by last access: the tier restamps a file's mtime whenever it is read or
re-offered, so mtime is the shared recency clock (atime is not used: it
depends on mount options and any reader, ``verify`` included, moves it).
Only regular files carrying our magic are counted and deleted (quarantined
ones too), each at its allocated size capped at the header plus the payload
it declares (a sparse 1 TiB file must not make every chunk look over
budget); temp files named by our own pattern count and go only when ours
(our magic, or empty) and older than the given age on the file server's
clock (a writer may still be filling a younger one). ``verify`` reports
files without our magic and never deletes or moves them.
Nothing is followed or deleted through a symlink, and a subdirectory that
cannot be read is skipped and reported, never fatal.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from tpu_offload.core.fs import actions, layout, safedir
from tpu_offload.core.fs.fileio import aligned_empty
from tpu_offload.core.fs.format import HEADER_SIZE, MAGIC, HeaderError, parse_header
from tpu_offload.core.fs.layout import Found, NamespaceScan

import xxhash

_VERIFY_BLOCK = 8 << 20
NOT_OURS = "magic (not ours: reported, never deleted or moved)"


@dataclasses.dataclass
class EvictReport:
    mode: str  # "budget" (bytes of our files vs --budget) or "statvfs" (the filesystem)
    total_bytes: int
    used_before: int
    used_after: int
    high_bytes: int
    low_bytes: int
    triggered: bool = False
    evicted_files: int = 0
    evicted_bytes: int = 0
    temps_removed: int = 0
    skipped_vanished: int = 0
    skipped_recently_used: int = 0
    skipped_not_ours: int = 0
    not_ours: int = 0  # files without our magic: not counted, never touched
    future_mtimes_clamped: int = 0
    clock: str = "server"  # whose clock judged ages: "server" (a probe file's mtime) or "local"
    unreadable: list[str] = dataclasses.field(default_factory=list)  # "path: why", skipped
    dry_run: bool = False

    @property
    def reached_low(self) -> bool:
        return not self.triggered or self.used_after <= self.low_bytes


def scan_root(root: str, namespace: str | None = None) -> list[NamespaceScan]:
    """Every namespace under ``root``; one that cannot be listed is reported, not raised."""
    out = []
    for ns in layout.iter_namespaces(root, namespace):
        try:
            out.append(layout.scan_namespace(ns))
        except FileNotFoundError:
            continue
        except OSError as e:
            s = NamespaceScan(os.path.basename(ns), ns)
            s.unreadable.append((ns, e.strerror or str(e)))
            out.append(s)
    return out


def _unreadable(scans: list[NamespaceScan]) -> list[str]:
    return [f"{p}: {why}" for s in scans for p, why in s.unreadable]


def _fs_usage(root: str) -> tuple[int, int]:
    """(total, used) as ``df`` shows them (reserved blocks excluded)."""
    st = os.statvfs(root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return used + st.f_bavail * st.f_frsize, used


def _clamp_future(s: NamespaceScan, now: float, dry_run: bool) -> int:
    """Files stamped ahead of the server's clock are restamped to now, so they age and can go."""
    n = 0
    for f in s.chunks:
        if not actions.in_future(f.mtime, now):
            continue
        n += 1
        if not dry_run:
            try:
                st = actions.restamp(s.path, f.dirs, f.name, now)
                if st is not None:
                    f.mtime_ns = st.st_mtime_ns
            except OSError:
                pass
        f.mtime = now
    return n


def evict(
    root: str,
    *,
    budget_bytes: int | None = None,
    high_pct: float = 90.0,
    low_pct: float = 80.0,
    namespace: str | None = None,
    tmp_age_s: float = 600.0,
    dry_run: bool = False,
) -> EvictReport:
    """Above ``high_pct`` of the budget (or of the filesystem), delete LRU files down to ``low_pct``.

    Ages are judged on the file server's clock (the mtime of a probe file
    created for it), never ours: a host whose clock runs ahead must not take
    a live writer's temp file for a stale one. A dry run creates no probe and
    uses the local clock, for its report only.
    """
    if not 0 < low_pct <= high_pct <= 100:
        raise ValueError(f"need 0 < low ({low_pct}) <= high ({high_pct}) <= 100")
    if not (tmp_age_s >= 0 and math.isfinite(tmp_age_s)):
        raise ValueError(f"tmp_age_s={tmp_age_s!r}; allowed: a finite number of seconds >= 0")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r}; allowed: > 0, or None for the filesystem")
    scans = scan_root(root, namespace)
    temps_removed = clamped = not_ours = 0
    clock = "server"
    for s in scans:
        srv = None if dry_run else actions.server_now(s.path)
        if srv is None:
            clock = "local"
        now = srv if srv is not None else time.time()
        not_ours += _keep_ours(s)  # first: someone else's file is never restamped, counted or deleted
        clamped += _clamp_future(s, now, dry_run)
        keep = []
        for t in s.temps:
            # Without the server's clock (read-only, dry run) a temp's age cannot be trusted.
            # A temp whose writer ran on this host (pid namespace) and is gone goes at once.
            gone = now - t.mtime > tmp_age_s or layout.temp_writer_dead(t.name)
            if gone and (dry_run or (srv is not None and actions.unlink_temp_if_ours(s.path, t))):
                temps_removed += 1
            else:
                keep.append(t)
        s.temps = keep
    files = [f for s in scans for f in (*s.chunks, *s.quarantined, *s.temps)]
    if budget_bytes is not None:
        mode, total, used = "budget", budget_bytes, sum(f.size for f in files)
    else:
        mode, (total, used) = "statvfs", _fs_usage(root)
    rep = EvictReport(mode, total, used, used, int(total * high_pct / 100), int(total * low_pct / 100),
                      temps_removed=temps_removed, future_mtimes_clamped=clamped, clock=clock, not_ours=not_ours,
                      unreadable=_unreadable(scans), dry_run=dry_run)
    if used < rep.high_bytes:
        return rep
    rep.triggered = True
    # Quarantined files are never served: they go first. Then chunks, LRU first.
    victims = [(s.path, f) for s in scans for f in sorted(s.quarantined, key=lambda f: f.mtime)]
    victims += sorted(((s.path, f) for s in scans for f in s.chunks), key=lambda v: v[1].mtime)
    for ns_dir, f in victims:
        if rep.used_after <= rep.low_bytes:
            break
        outcome = _delete_if_unchanged(ns_dir, f, dry_run)
        if outcome == "vanished":
            rep.skipped_vanished += 1
        elif outcome == "used":
            rep.skipped_recently_used += 1
        elif outcome == "foreign":
            rep.skipped_not_ours += 1
        else:
            freed = f.size if mode == "budget" else min(f.blocks, f.size)
            rep.evicted_files += 1
            rep.evicted_bytes += freed
            rep.used_after -= freed
    return rep


def _keep_ours(s: NamespaceScan) -> int:
    """Drop files that are not ours (no magic) from a scan; ours count at ``actions.ours`` bytes.

    ``Found.size`` becomes those bytes (what the budget counts and an
    eviction frees); foreign files are listed in ``s.foreign`` and never touched.
    """
    dropped = 0
    for group in ("chunks", "quarantined", "temps"):
        keep = []
        for f in getattr(s, group):
            n = actions.ours(s.path, f)
            if n is None:
                s.foreign.append(f.path)
                dropped += 1
                continue
            f.size = n
            keep.append(f)
        setattr(s, group, keep)
    return dropped


def _delete_if_unchanged(ns_dir: str, f: Found, dry_run: bool) -> str:
    """Delete one scanned file if it is still that file, unused since, and starts with our magic.

    Everything is relative to directory fds opened without following a
    symlink, so a fan-out directory swapped for a symlink cannot redirect
    the delete; only a regular file is ever removed.
    """
    try:
        with safedir.dir_at(ns_dir, f.dirs) as d:
            st = safedir.lstat_regular(f.name, d)
            if st is None:
                return "vanished"
            if st.st_ino != f.ino or st.st_mtime_ns != f.mtime_ns:
                return "used"  # read (restamped) or rewritten since the scan: not LRU any more
            try:
                fd, _ = safedir.open_regular(f.name, d)
            except FileNotFoundError:
                return "vanished"
            except OSError:
                return "foreign"
            try:
                head = os.pread(fd, len(MAGIC), 0)
            except OSError:
                return "foreign"
            finally:
                os.close(fd)
            if head != MAGIC:
                return "foreign"
            if dry_run:
                return "deleted"
            return "deleted" if safedir.unlink_if(f.name, d, f.ino, f.mtime_ns) else "vanished"
    except FileNotFoundError:
        return "vanished"
    except OSError:
        return "foreign"  # a symlink or file where a directory belongs, or no access: not ours to touch


def inspect(root: str, namespace: str | None = None) -> dict:
    """Per-namespace counts, bytes and ages, plus the filesystem's usage."""
    now = time.time()
    total, used = _fs_usage(root)
    out = {"root": os.path.abspath(root), "fs_total_bytes": total, "fs_used_bytes": used, "namespaces": [],
           "unreadable": []}
    for s in scan_root(root, namespace):
        ages = sorted(now - f.mtime for f in s.chunks)
        out["unreadable"] += _unreadable([s])
        out["namespaces"].append({
            "namespace": s.namespace,
            "files": len(s.chunks),
            "bytes": sum(f.size for f in s.chunks),
            "allocated_bytes": sum(f.blocks for f in s.chunks),
            "temps": len(s.temps),
            "temp_bytes": sum(f.size for f in s.temps),
            "oldest_temp_age_s": max((now - f.mtime for f in s.temps), default=None),
            "quarantined": len(s.quarantined),
            "foreign_entries": len(s.foreign),
            "unreadable_entries": len(s.unreadable),
            "newest_access_age_s": ages[0] if ages else None,
            "median_access_age_s": ages[len(ages) // 2] if ages else None,
            "oldest_access_age_s": ages[-1] if ages else None,
        })
    return out


@dataclasses.dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bad: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, reason)
    vanished: int = 0
    unreadable: list[str] = dataclasses.field(default_factory=list)  # "path: why", skipped
    action: str = "report"


def verify_file(dir_fd: int, name: str, expect_digest: bytes | None, expect_name: str | None,
                buf=None) -> str | None:
    """Why the file ``name`` in ``dir_fd`` is bad (a reason string), or None if every check passes.

    Opened without following a symlink and without blocking: anything but
    a regular file is "not_regular".
    """
    buf = aligned_empty(_VERIFY_BLOCK) if buf is None else buf
    try:
        fd, st = safedir.open_regular(name, dir_fd)
    except safedir.NotRegular as e:
        return f"not_regular ({e.kind})"
    with open(fd, "rb", buffering=0) as fh:
        hdr = fh.read(HEADER_SIZE)
        if hdr[: len(MAGIC)] != MAGIC and hdr:
            return NOT_OURS
        if len(hdr) < HEADER_SIZE:
            return "truncated"
        try:
            h = parse_header(hdr)
        except HeaderError as e:
            return e.reason
        if expect_digest is not None and h.digest != expect_digest:
            return "layout"
        if expect_name is not None and h.key.hex() != expect_name:
            return "key"
        size = st.st_size
        if size < h.file_size:
            return "truncated"
        if size > h.file_size:
            return "length"
        hasher = xxhash.xxh3_64()
        left = h.payload_len
        mv = memoryview(buf)
        while left:
            n = fh.readinto(mv[: min(left, len(mv))])
            if not n:
                return "truncated"
            hasher.update(mv[:n])
            left -= n
        if hasher.intdigest() != h.checksum:
            return "checksum"
    return None


def _ns_digest(namespace: str) -> bytes | None:
    try:
        return bytes.fromhex(namespace.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


def verify(root: str, namespace: str | None = None, action: str = "report") -> VerifyReport:
    """Check every chunk file; ``action`` 'quarantine' or 'delete' removes bad ones."""
    if action not in ("report", "quarantine", "delete"):
        raise ValueError(f"action {action!r}; allowed: report, quarantine, delete")
    rep = VerifyReport(action=action)
    buf = aligned_empty(_VERIFY_BLOCK)
    scans = scan_root(root, namespace)
    rep.unreadable = _unreadable(scans)
    for s in scans:
        digest = _ns_digest(s.namespace)
        for f in s.chunks:
            try:
                with safedir.dir_at(s.path, f.dirs) as d:
                    reason = _verify_one(rep, d, f, digest, buf)
                    if reason is None:
                        continue
                    rep.bad.append((f.path, reason))
                    if not reason.startswith(("not_regular", "unreadable", NOT_OURS)):
                        _act(action, s.path, d, f, reason)
            except FileNotFoundError:
                rep.vanished += 1
            except OSError as e:
                rep.unreadable.append(f"{f.path}: {e.strerror or e}")
    return rep


def _verify_one(rep: VerifyReport, d: int, f: Found, digest: bytes | None, buf) -> str | None:
    try:
        reason = verify_file(d, f.name, digest, f.name, buf)
    except FileNotFoundError:
        raise
    except OSError as e:
        reason = f"unreadable ({e.strerror})"
    rep.checked += 1
    if reason is None:
        rep.ok += 1
    return reason


def _act(action: str, ns_dir: str, d: int, f: Found, reason: str) -> None:
    """Delete or quarantine a bad file: that inode only, never a symlink, never through one."""
    try:
        if action == "delete":
            safedir.unlink_if(f.name, d, f.ino)
        elif action == "quarantine":
            actions.quarantine(ns_dir, d, f.name, f.ino, reason)
    except FileNotFoundError:
        pass
