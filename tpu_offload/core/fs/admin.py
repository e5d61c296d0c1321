"""Operations on a whole shared directory: evict, inspect, verify.

These run while many engine instances write the same directory, so every
step tolerates files vanishing or changing under it (ENOENT is "someone else
did it", a changed inode or mtime is "someone used it, keep it"). Eviction is
LRU by last access: the tier restamps a file's mtime whenever it is read or
re-offered, so mtime is the shared recency clock (atime is not used: it
depends on mount options and any reader, ``verify`` included, moves it).
Only files carrying our magic are deleted; temp files younger than the
given age are never touched (a writer may still be filling them).
"""

from __future__ import annotations

import dataclasses
import os
import time

from tpu_offload.core.fs import layout
from tpu_offload.core.fs.fileio import aligned_empty
from tpu_offload.core.fs.format import HEADER_SIZE, MAGIC, HeaderError, parse_header
from tpu_offload.core.fs.layout import Found, NamespaceScan

import xxhash

_VERIFY_BLOCK = 8 << 20


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
    dry_run: bool = False

    @property
    def reached_low(self) -> bool:
        return not self.triggered or self.used_after <= self.low_bytes


def scan_root(root: str, namespace: str | None = None) -> list[NamespaceScan]:
    return [layout.scan_namespace(ns) for ns in layout.iter_namespaces(root, namespace)]


def _fs_usage(root: str) -> tuple[int, int]:
    """(total, used) as ``df`` shows them (reserved blocks excluded)."""
    st = os.statvfs(root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return used + st.f_bavail * st.f_frsize, used


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
    """Above ``high_pct`` of the budget (or of the filesystem), delete LRU files down to ``low_pct``."""
    if not 0 < low_pct <= high_pct <= 100:
        raise ValueError(f"need 0 < low ({low_pct}) <= high ({high_pct}) <= 100")
    scans = scan_root(root, namespace)
    now = time.time()
    temps_removed = 0
    for s in scans:
        keep = []
        for t in s.temps:
            if now - t.mtime > tmp_age_s and (dry_run or layout.unlink_quiet(t.path)):
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
                      temps_removed=temps_removed, dry_run=dry_run)
    if used < rep.high_bytes:
        return rep
    rep.triggered = True
    # Quarantined files are never served: they go first. Then chunks, LRU first.
    victims = [(f, False) for s in scans for f in sorted(s.quarantined, key=lambda f: f.mtime)]
    victims += [(f, True) for f in sorted((f for s in scans for f in s.chunks), key=lambda f: f.mtime)]
    for f, check_magic in victims:
        if rep.used_after <= rep.low_bytes:
            break
        outcome = _delete_if_unchanged(f, check_magic, dry_run)
        if outcome == "vanished":
            rep.skipped_vanished += 1
        elif outcome == "used":
            rep.skipped_recently_used += 1
        elif outcome == "foreign":
            rep.skipped_not_ours += 1
        else:
            freed = f.size if mode == "budget" else f.blocks
            rep.evicted_files += 1
            rep.evicted_bytes += freed
            rep.used_after -= freed
    return rep


def _delete_if_unchanged(f: Found, check_magic: bool, dry_run: bool) -> str:
    try:
        st = os.lstat(f.path)
    except FileNotFoundError:
        return "vanished"
    if st.st_ino != f.ino or st.st_mtime != f.mtime:
        return "used"  # read (restamped) or rewritten since the scan: not LRU any more
    if check_magic:
        try:
            with open(f.path, "rb") as fh:
                head = fh.read(len(MAGIC))
        except FileNotFoundError:
            return "vanished"
        except OSError:
            return "foreign"
        if head != MAGIC:
            return "foreign"
    if dry_run:
        return "deleted"
    return "deleted" if layout.unlink_quiet(f.path) else "vanished"


def inspect(root: str, namespace: str | None = None) -> dict:
    """Per-namespace counts, bytes and ages, plus the filesystem's usage."""
    now = time.time()
    total, used = _fs_usage(root)
    out = {"root": os.path.abspath(root), "fs_total_bytes": total, "fs_used_bytes": used, "namespaces": []}
    for s in scan_root(root, namespace):
        ages = sorted(now - f.mtime for f in s.chunks)
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
    action: str = "report"


def verify_file(path: str, expect_digest: bytes | None, expect_name: str | None, buf=None) -> str | None:
    """Why the file is bad (a reason string), or None if every check passes."""
    buf = aligned_empty(_VERIFY_BLOCK) if buf is None else buf
    with open(path, "rb", buffering=0) as fh:
        hdr = fh.read(HEADER_SIZE)
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
        size = os.fstat(fh.fileno()).st_size
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
    for s in scan_root(root, namespace):
        digest = _ns_digest(s.namespace)
        for f in s.chunks:
            try:
                reason = verify_file(f.path, digest, f.name, buf)
            except FileNotFoundError:
                rep.vanished += 1
                continue
            except OSError as e:
                reason = f"unreadable ({e.strerror})"
            rep.checked += 1
            if reason is None:
                rep.ok += 1
                continue
            rep.bad.append((f.path, reason))
            try:
                if action == "delete":
                    os.unlink(f.path)
                elif action == "quarantine":
                    qdir = os.path.join(s.path, layout.QUARANTINE)
                    layout.make_dirs(qdir)
                    tag = reason.split(" ")[0]
                    os.rename(f.path, os.path.join(qdir, f"{f.name}.{tag}.{os.getpid()}"))
            except FileNotFoundError:
                pass
    return rep
