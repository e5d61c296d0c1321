"""Acting on files a namespace scan found: shared by the tier's rescan and the CLI.

Both run against a directory other instances change under them, so each
action re-checks that the file is still the one scanned (inode, mtime) and a
regular file, walks from the namespace directory without following a
symlink, and judges ages on the file server's clock. One copy, so the tier
and ``tpu-offload-fs`` can never disagree on what they may delete or restamp.
"""

from __future__ import annotations

import os

from tpu_offload.core.fs import layout, safedir

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
