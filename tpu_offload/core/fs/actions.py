"""Acting on files a namespace scan found: shared by the tier's rescan and the CLI.

Both run against a directory other instances change under them, so each
action re-checks that the file is still the one scanned (inode, mtime) and a
regular file, walks from the namespace directory without following a
symlink, and judges ages on the file server's clock. One copy, so the tier
and ``tpu-offload-fs`` can never disagree on what they may delete or restamp.
"""

from __future__ import annotations

import os
import struct
from typing import Callable

from tpu_offload.core.fs import layout, safedir
from tpu_offload.core.fs.format import HEADER_SIZE, MAGIC

FUTURE_SLACK_S = 2.0  # mtime granularity and clock jitter: not "the future" yet


def server_now(ns_dir: str) -> float | None:
    """The file server's clock (a probe file's mtime), or None (read-only, or gone)."""
    try:
        with safedir.dir_at(ns_dir) as d:
            return safedir.server_now(d, layout.temp_name("clock"))
    except OSError:
        return None


def in_future(mtime: float, now: float) -> bool:
    """Stamped ahead of the server's ``now`` (a host whose clock runs ahead)."""
    return mtime > now + FUTURE_SLACK_S


def restamp(ns_dir: str, dirs: tuple[str, ...], name: str, now: float) -> os.stat_result | None:
    """Set a future-stamped file's mtime to ``now``, so it ages for every instance and the CLI.

    Returns its new stat; None if no regular file is there. Raises OSError
    (read-only, a symlink on the way).
    """
    with safedir.dir_at(ns_dir, dirs) as d:
        if safedir.lstat_regular(name, d) is None:
            return None
        os.utime(name, (now, now), dir_fd=d, follow_symlinks=False)
        return os.stat(name, dir_fd=d, follow_symlinks=False)


def unlink_found(ns_dir: str, f: layout.Found) -> bool:
    """Remove the scanned file if it is still that inode with that mtime; True if we did."""
    try:
        with safedir.dir_at(ns_dir, f.dirs) as d:
            return safedir.unlink_if(f.name, d, f.ino, f.mtime_ns)
    except OSError:
        return False


def delete_if_unchanged(d: int, name: str, unchanged: Callable[[os.stat_result], bool],
                        dry_run: bool = False) -> str:
    """Delete a chosen file only if it is still the file chosen and ours; what happened.

    Eviction picks victims from a scan (the tier's rescan, the CLI's) and
    deletes them later, while other replicas read and restamp the same files:
    a file read or rewritten since the choice is no longer the least recent,
    and a file someone swapped in is not ours. ``unchanged(stat)`` says
    whether it is the very file chosen (inode, mtime or ctime as recorded).
    Returns "deleted" (or would be, with ``dry_run``), "vanished", "used"
    (changed since the choice: kept) or "foreign" (not a regular file of one
    link starting with our magic: kept). ``d`` is the file's directory,
    opened without following a symlink; only a regular file is ever removed.
    """
    st = safedir.lstat_regular(name, d)
    if st is None:
        return "vanished"
    if not unchanged(st):
        return "used"
    try:
        fd, st2 = safedir.open_regular(name, d)
    except FileNotFoundError:
        return "vanished"
    except OSError:
        return "foreign"
    try:
        if st2.st_nlink != 1:
            return "foreign"  # also linked from elsewhere, where someone else put it
        head = os.pread(fd, len(MAGIC), 0)
    except OSError:
        return "foreign"
    finally:
        os.close(fd)
    if head != MAGIC:
        return "foreign"
    if dry_run:
        return "deleted"
    return "deleted" if safedir.unlink_if(name, d, st.st_ino, st.st_mtime_ns) else "vanished"


_PLEN = struct.Struct("<Q")
_PLEN_OFF = 32  # payload length in the header (format.py)


def ours_at(d: int, name: str, blocks: int | None = None,
            head_ok: Callable[[bytes, str | None], bool] | None = None, want_name: str | None = None) -> int | None:
    """Bytes a file of ours counts for, or None if it is not ours.

    Ours: a regular file with one link (a hard link also lives elsewhere,
    where someone else put it) that starts with our magic, or an empty one
    (a writer killed before its first byte). With ``head_ok`` (a tier with a
    secret) its header MAC must also verify (``head_ok(header, want_name)``):
    the magic is public. It counts at its allocated size, capped at header
    plus the payload its header declares, so a sparse or padded file can
    never make the budget look full.
    """
    try:
        fd, st = safedir.open_regular(name, d)
    except OSError:
        return None
    try:
        if st.st_nlink != 1:
            return None
        if st.st_size == 0:
            return 0
        head = os.pread(fd, HEADER_SIZE if head_ok is not None else _PLEN_OFF + _PLEN.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if head[: len(MAGIC)] != MAGIC:
        return None
    if head_ok is not None and (len(head) < HEADER_SIZE or not head_ok(head, want_name)):
        return None
    cap = HEADER_SIZE + (_PLEN.unpack_from(head, _PLEN_OFF)[0] if len(head) >= _PLEN_OFF + _PLEN.size else 0)
    return min(st.st_blocks * 512 if blocks is None else blocks, cap)


def ours(ns_dir: str, f: layout.Found, head_ok: Callable[[bytes, str | None], bool] | None = None) -> int | None:
    """``ours_at`` for a scanned file (None also when it vanished or cannot be reached)."""
    if f.nlink != 1:
        return None
    try:
        with safedir.dir_at(ns_dir, f.dirs) as d:
            return ours_at(d, f.name, f.blocks, head_ok)
    except OSError:
        return None


def unlink_temp_if_ours(ns_dir: str, f: layout.Found,
                        head_ok: Callable[[bytes, str | None], bool] | None = None) -> bool:
    """Remove a scanned temp file only if it is ours (magic, or empty; one link) and unchanged; True if we did."""
    try:
        with safedir.dir_at(ns_dir, f.dirs) as d:
            return ours_at(d, f.name, head_ok=head_ok) is not None and safedir.unlink_if(f.name, d, f.ino, f.mtime_ns)
    except OSError:
        return False


def quarantine(ns_dir: str, d: int, name: str, ino: int, reason: str) -> bool:
    """Move ``name`` in the fan-out directory ``d`` (that inode only) to ``<namespace>/quarantine/``.

    False if another file (or none) is there now. Raises OSError.
    """
    st = safedir.lstat_regular(name, d)
    if st is None or st.st_ino != ino:
        return False
    with safedir.dir_at(ns_dir, (layout.QUARANTINE,), create=True, mode=layout.DIR_MODE) as q:
        os.rename(name, layout.quarantine_name(name, reason), src_dir_fd=d, dst_dir_fd=q)
    return True
