"""JAX's persistent compile cache for one test session: fresh, shared with its children, removed at exit.

The JAX suites compile the same small programs in many tests and in the child processes they start,
each well under JAX's 1-second default threshold, so every compile is kept. A directory made per
session (children inherit it through the environment) means no run reads what another left behind.
A cache hit still counts as a compile for ``offload_helpers.CompileCounter``. Imports only the
standard library: call it before JAX is imported.

A session killed by a signal skips its atexit removal, so each directory is named after the process
that made it, and a new session removes the ones of its prefix whose process is gone (its user's own
directories only, never a link).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile


def use_fresh_cache(prefix: str, *dir_vars: str) -> str:
    """Make the session's cache directory, point each of ``dir_vars`` at it, cache every compile."""
    remove_orphans(prefix)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    atexit.register(shutil.rmtree, path, True)
    for var in dir_vars:
        os.environ[var] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    return path


def remove_orphans(prefix: str, root: str | None = None) -> list[str]:
    """Remove ``root``'s (the temporary directory's) ``<prefix><pid>-*`` directories of this user whose
    process no longer runs; returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        pid = name[len(prefix):].split("-", 1)[0]
        if not name.startswith(prefix) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
