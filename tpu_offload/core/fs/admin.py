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
clock (a writer may still be filling a younger one); with a budget they
count only up to the tier's temp cap (``tempcap``: a quarter of it, newest
first), and those beyond it are junk, deleted before any chunk when the
budget is exceeded (copies of one of our files under temp names must not
evict our chunks). ``verify`` reports
files without our magic and never deletes or moves them.
Nothing is followed or deleted through a symlink, and a subdirectory that
cannot be read is skipped and reported, never fatal.

Keyed namespaces (``kv-<tag>``, a tier with a secret): the magic is public,
so with the secret (``keyring``) only files whose header MAC verifies are
counted, deleted or passed, and only keyed namespaces are acted on; without
it, ``evict`` and ``verify`` refuse a keyed namespace (``KeyRequired``), since
they could not tell our files from another tenant's forgeries. Budgets are
per namespace unless ``per_namespace=False``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from tpu_offload.core.fs import actions, layout, safedir, tempcap
from tpu_offload.core.fs.fileio import aligned_empty
from tpu_offload.core.fs.format import HEADER_SIZE, MAGIC, HeaderError, parse_header
from tpu_offload.core.fs.keyring import Keyring, keyed_tag
from tpu_offload.core.fs.layout import Found, NamespaceScan

import xxhash

_VERIFY_BLOCK = 8 << 20
FOREIGN_SHOWN = 100
NOT_OURS = "magic (not ours: reported, never deleted or moved)"
FORGED = "forged (not signed with this secret: reported, never deleted or moved)"


class KeyRequired(ValueError):
    """A keyed namespace in scope and no secret: the CLI cannot tell our files from forgeries."""

    def __init__(self, what: str, namespaces: list[str]):
        shown = ", ".join(namespaces[:3]) + (f" and {len(namespaces) - 3} more" if len(namespaces) > 3 else "")
        super().__init__(
            f"{what} refused: {shown} {'is a' if len(namespaces) == 1 else 'are'} keyed namespace"
            f"{'' if len(namespaces) == 1 else 's'} (a tier with a secret). Without the secret every file there "
            "looks alike (the magic is public): another tenant's files would be counted, kept or deleted as ours. "
            "Pass --secret-file (or set TPU_OFFLOAD_FS_SECRET_FILE / TPU_OFFLOAD_FS_SECRET, or --config with "
            "fs_secret_file), or --namespace an unkeyed namespace")
        self.namespaces = namespaces


def _require_key(scans: list[NamespaceScan], keyring: Keyring | None, what: str) -> None:
    if keyring is None:
        keyed = [s.namespace for s in scans if keyed_tag(s.namespace) is not None]
        if keyed:
            raise KeyRequired(what, keyed)


def _in_scope(scans: list[NamespaceScan], keyring: Keyring | None) -> list[NamespaceScan]:
    """With the secret only keyed namespaces are ours to act on; without it only unkeyed ones."""
    return [s for s in scans if (keyed_tag(s.namespace) is not None) == (keyring is not None)]


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
    not_ours: int = 0  # files without our magic (with a secret: not signed with it): not counted, never touched
    per_namespace: bool = True  # --budget applies to each namespace on its own
    namespaces: dict = dataclasses.field(default_factory=dict)  # namespace -> {used_before, used_after, evicted}
    future_mtimes_clamped: int = 0
    # with --budget: our temps beyond the tier's temp cap (``tempcap``): junk, not counted; deleted first
    temps_over_cap: int = 0
    temps_over_cap_removed: int = 0
    clock: str = "server"  # whose clock judged ages: "server" (a probe file's mtime) or "local"
    unreadable: list[str] = dataclasses.field(default_factory=list)  # "path: why", skipped
    dry_run: bool = False

    short_of_low: bool = False  # some group (a namespace, with per-namespace budgets) stayed above its low mark

    @property
    def reached_low(self) -> bool:
        return not self.triggered or not self.short_of_low


def is_tier_namespace(name: str) -> bool:
    """A namespace directory's name: ``<model>-<32 hex digits>`` (no secret) or ``kv-<32 hex digits>``."""
    head, _, digest = name.rpartition("-")
    return bool(head) and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest)


def tier_namespaces(root: str, namespace: str | None = None) -> list[str]:
    """Namespace directories of a file tier under ``root`` (none: the path holds no tier)."""
    try:
        return [p for p in layout.iter_namespaces(root, namespace) if is_tier_namespace(os.path.basename(p))]
    except OSError:
        return []


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
    keyring: Keyring | None = None,
    per_namespace: bool = True,
) -> EvictReport:
    """Above ``high_pct`` of the budget (or of the filesystem), delete LRU files down to ``low_pct``.

    Ages are judged on the file server's clock (the mtime of a probe file
    created for it), never ours: a host whose clock runs ahead must not take
    a live writer's temp file for a stale one. A dry run creates no probe and
    uses the local clock, for its report only. ``budget_bytes`` applies to
    each namespace on its own (``per_namespace``), else to their sum.
    """
    if not 0 < low_pct <= high_pct <= 100:
        raise ValueError(f"need 0 < low ({low_pct}) <= high ({high_pct}) <= 100")
    if not (tmp_age_s >= 0 and math.isfinite(tmp_age_s)):
        raise ValueError(f"tmp_age_s={tmp_age_s!r}; allowed: a finite number of seconds >= 0")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r}; allowed: > 0, or None for the filesystem")
    keyring = None if keyring is None else keyring.at(root)
    scans = scan_root(root, namespace)
    _require_key(scans, keyring, "evict")
    unreadable = _unreadable(scans)
    scans = _in_scope(scans, keyring)
    temps_removed = clamped = not_ours = 0
    clock = "server"
    for s in scans:
        srv = None if dry_run else actions.server_now(s.path)
        if srv is None:
            clock = "local"
        now = srv if srv is not None else time.time()
        # first: someone else's file is never restamped, counted or deleted
        not_ours += _keep_ours(s) if keyring is None else _keep_authenticated(s, keyring)
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
    rep = EvictReport("budget" if budget_bytes is not None else "statvfs", 0, 0, 0, 0, 0,
                      temps_removed=temps_removed, future_mtimes_clamped=clamped, clock=clock, not_ours=not_ours,
                      unreadable=unreadable, dry_run=dry_run, per_namespace=per_namespace)
    if budget_bytes is not None and per_namespace:
        groups = [[s] for s in scans]
    else:
        groups = [scans]
    for group in groups:
        files = [f for s in group for f in (*s.chunks, *s.quarantined)]
        temps = [(s, t) for s in group for t in s.temps]
        if budget_bytes is not None:
            # The tier's own rule: temps count up to its temp cap, newest first; the rest is junk.
            temp_bytes, over = tempcap.split_temps(
                temps, name=lambda v: v[1].name, size=lambda v: v[1].size, mtime=lambda v: v[1].mtime,
                cap_bytes=tempcap.temp_cap_bytes(budget_bytes))
            total, used = budget_bytes, sum(f.size for f in files) + temp_bytes
            rep.temps_over_cap += len(over)
        else:
            total, used = _fs_usage(root)
            over = []
        high, low = int(total * high_pct / 100), int(total * low_pct / 100)
        rep.total_bytes += total
        rep.used_before += used
        rep.high_bytes += high
        rep.low_bytes += low
        after = used
        if used >= high:
            rep.triggered = True
            after = _evict_group(rep, group, budget_bytes is not None, used, low, dry_run, over)
        rep.used_after += after
        if budget_bytes is not None and per_namespace:
            rep.namespaces[group[0].namespace] = {"used_before": used, "used_after": after,
                                                  "reached_low": used < high or after <= low}
    return rep


def _evict_group(rep: EvictReport, scans: list[NamespaceScan], budget: bool, used: int, low: int,
                 dry_run: bool, over_cap: list[tuple[NamespaceScan, Found]] = ()) -> int:
    """Delete LRU files of ``scans`` until ``used`` is at most ``low``; returns the bytes left.

    Temps over the temp cap (``over_cap``: not counted in ``used``) go before
    anything else, each only if still unchanged and ours.
    """
    for s, f in over_cap:
        if _delete_if_unchanged(s.path, f, dry_run) == "deleted":
            rep.temps_over_cap_removed += 1
    # Quarantined files are never served: they go first. Then chunks, LRU first.
    victims = [(s, f) for s in scans for f in sorted(s.quarantined, key=lambda f: f.mtime)]
    victims += sorted(((s, f) for s in scans for f in s.chunks), key=lambda v: v[1].mtime)
    for s, f in victims:
        if used <= low:
            break
        outcome = _delete_if_unchanged(s.path, f, dry_run)
        if outcome == "vanished":
            rep.skipped_vanished += 1
        elif outcome == "used":
            rep.skipped_recently_used += 1
        elif outcome == "foreign":
            rep.skipped_not_ours += 1
        else:
            freed = f.size if budget else min(f.blocks, f.size)
            rep.evicted_files += 1
            rep.evicted_bytes += freed
            used -= freed
    if used > low:
        rep.short_of_low = True
    return used


def _keep_authenticated(s: NamespaceScan, keyring: Keyring) -> int:
    """With the secret: keep only files whose header one of our writers signed; returns files dropped.

    Chunks must also carry their own name in the header; quarantined files
    (``<name>.<reason>.<pid>``) the name before the first dot. A temp counts
    and goes only once its header is down and signed (an empty or partial
    temp of a crashed writer is the tier's to reap: it may be anyone's).
    """
    tag = keyed_tag(s.namespace)

    def owned(group: str, f: Found) -> int | None:
        name = f.name if group == "chunks" else f.name.split(".")[0] if group == "quarantined" else None
        try:
            with safedir.dir_at(s.path, f.dirs) as d:
                return keyring.owned_bytes(d, f.name, tag, name)
        except OSError:
            return None

    return _keep(s, owned)


def _keep_ours(s: NamespaceScan) -> int:
    """Drop files that are not ours (no magic) from a scan; ours count at ``actions.ours`` bytes."""
    return _keep(s, lambda group, f: actions.ours(s.path, f))


def _keep(s: NamespaceScan, owned) -> int:
    """Keep the files ``owned(group, f)`` gives a byte count (``Found.size`` becomes it: what the
    budget counts and an eviction frees); the rest are listed in ``s.foreign`` and never touched.
    Returns the files dropped."""
    dropped = 0
    for group in ("chunks", "quarantined", "temps"):
        keep = []
        for f in getattr(s, group):
            n = owned(group, f)
            if n is None:
                s.foreign.append(f.path)
                dropped += 1
                continue
            f.size = n
            keep.append(f)
        setattr(s, group, keep)
    return dropped


def _delete_if_unchanged(ns_dir: str, f: Found, dry_run: bool) -> str:
    """Delete one scanned file if it is still that file, unused since, and ours (``actions.delete_if_unchanged``,
    the tier's eviction rule too), relative to directory fds opened without following a symlink."""
    try:
        with safedir.dir_at(ns_dir, f.dirs) as d:
            return actions.delete_if_unchanged(
                d, f.name, lambda st: st.st_ino == f.ino and st.st_mtime_ns == f.mtime_ns, dry_run)
    except FileNotFoundError:
        return "vanished"
    except OSError:
        return "foreign"  # a symlink or file where a directory belongs, or no access: not ours to touch


def inspect(root: str, namespace: str | None = None, keyring: Keyring | None = None) -> dict:
    """Per-namespace counts, bytes and ages, plus the filesystem's usage.

    Only our files count: our magic and one link (with the secret, a header
    MAC that verifies); the rest is listed as ``foreign`` (the first
    ``FOREIGN_SHOWN`` paths) and counted in ``foreign_entries``. Keyed
    namespaces without the secret say ``"authenticated": null`` (the magic
    is public: forgeries look alike).
    """
    keyring = None if keyring is None else keyring.at(root)
    now = time.time()
    total, used = _fs_usage(root)
    out = {"root": os.path.abspath(root), "fs_total_bytes": total, "fs_used_bytes": used, "namespaces": [],
           "unreadable": []}
    for s in scan_root(root, namespace):
        keyed = keyed_tag(s.namespace) is not None
        # Someone else's files (no magic, a hard link, with the secret not signed with it) are shown apart.
        dropped = _keep_authenticated(s, keyring) if keyed and keyring is not None else _keep_ours(s)
        unauth = dropped if keyed and keyring is not None else None
        ages = sorted(now - f.mtime for f in s.chunks)
        out["unreadable"] += _unreadable([s])
        out["namespaces"].append({
            "namespace": s.namespace,
            "keyed": keyed,
            "authenticated": None if not keyed or keyring is None else True,
            "unauthenticated_files": unauth,
            "files": len(s.chunks),
            "bytes": sum(f.size for f in s.chunks),
            "allocated_bytes": sum(f.blocks for f in s.chunks),
            "temps": len(s.temps),
            "temp_bytes": sum(f.size for f in s.temps),
            "oldest_temp_age_s": max((now - f.mtime for f in s.temps), default=None),
            "quarantined": len(s.quarantined),
            "foreign_entries": len(s.foreign),
            "foreign": s.foreign[:FOREIGN_SHOWN],  # the first few: never counted, deleted or moved
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
    forged: int = 0  # with the secret: header or payload not signed with it
    unverified_salt: int = 0  # with the secret: our header, a tenant salt not given (payload unchecked)
    # with the secret: keyed namespaces where nothing is signed with it (another deployment's), not judged
    foreign_namespaces: list[str] = dataclasses.field(default_factory=list)


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


def verify(root: str, namespace: str | None = None, action: str = "report",
           keyring: Keyring | None = None) -> VerifyReport:
    """Check every chunk file; ``action`` 'quarantine' or 'delete' removes bad ones.

    With the secret only keyed namespaces are checked, every file's header
    MAC and payload MAC too: a file not signed with it is reported forged
    (and never deleted or moved: not ours); without it a keyed namespace is
    refused (``KeyRequired``): its checksums are public, a forgery passes them.
    """
    if action not in ("report", "quarantine", "delete"):
        raise ValueError(f"action {action!r}; allowed: report, quarantine, delete")
    keyring = None if keyring is None else keyring.at(root)
    rep = VerifyReport(action=action)
    buf = aligned_empty(_VERIFY_BLOCK)
    scans = scan_root(root, namespace)
    _require_key(scans, keyring, "verify")
    rep.unreadable = _unreadable(scans)
    for s in _in_scope(scans, keyring):
        tag = keyed_tag(s.namespace)
        digest = tag if keyring is not None else _ns_digest(s.namespace)
        mark = (rep.checked, rep.ok, len(rep.bad), rep.forged, rep.unverified_salt)
        _verify_namespace(rep, s, keyring, tag, digest, buf, action)
        if keyring is not None and namespace is None and rep.ok == mark[1] and rep.unverified_salt == mark[4] \
                and sum(r == FORGED for _, r in rep.bad[mark[2]:]) == rep.checked - mark[0] > 0:
            # Nothing there is signed with this secret: another deployment's namespace, not ours to judge.
            rep.checked, rep.ok, _, rep.forged, rep.unverified_salt = mark
            del rep.bad[mark[2]:]
            rep.foreign_namespaces.append(s.namespace)
    return rep


def _verify_namespace(rep: VerifyReport, s: NamespaceScan, keyring: Keyring | None, tag, digest, buf,
                      action: str) -> None:
    for f in s.chunks:
        try:
            with safedir.dir_at(s.path, f.dirs) as d:
                if keyring is not None:
                    reason = _verify_keyed(rep, d, f, tag, keyring)
                else:
                    reason = _verify_one(rep, d, f, digest, buf)
                if reason is None:
                    continue
                rep.bad.append((f.path, reason))
                if not reason.startswith(("not_regular", "unreadable", NOT_OURS, FORGED)):
                    _act(action, s.path, d, f, reason)
        except FileNotFoundError:
            rep.vanished += 1
        except OSError as e:
            rep.unreadable.append(f"{f.path}: {e.strerror or e}")


def _verify_keyed(rep: VerifyReport, d: int, f: Found, tag: bytes, keyring: Keyring) -> str | None:
    """Header MAC, then the whole file as the tier reads it (payload MAC or AEAD tag) with the salt's keys."""
    from tpu_offload.core.fs.chunkfile import check_chunk

    rep.checked += 1
    try:
        fd, st = safedir.open_regular(f.name, d)
    except safedir.NotRegular as e:
        return f"not_regular ({e.kind})"
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            rep.checked -= 1
            raise
        return f"unreadable ({e.strerror})"
    try:
        hdr = aligned_empty(HEADER_SIZE)
        n = os.preadv(fd, [memoryview(hdr)], 0)
        h = keyring.header(bytes(hdr[:n]), tag, f.name)
        if h is None:
            rep.forged += 1
            return FORGED
        tk = keyring.tenant(tag, h.salt_id)
        if tk is None:  # a tenant salt we were not given: the header is ours, the payload unchecked
            rep.unverified_salt += 1
            return None
        if h.payload_len > st.st_size:
            return "truncated"
        payload = aligned_empty(h.payload_len)
        got = os.preadv(fd, [memoryview(payload)], HEADER_SIZE) if h.payload_len else 0
    except OSError as e:
        return f"unreadable ({e.strerror})"
    finally:
        os.close(fd)
    scratch = {}

    def ct_buf(m: int):
        if m not in scratch:
            scratch[m] = aligned_empty(m + 16)
        return scratch[m]

    reason = check_chunk(tag, h.key, hdr, memoryview(payload), HEADER_SIZE + got, tk, st.st_size, ct_buf)
    if reason is None:
        rep.ok += 1
        return None
    if reason == "mac":  # our header, someone else's payload (e.g. an xxh3 collision): forged
        rep.forged += 1
        return "mac (payload not signed with this secret: forged)"
    return reason


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
