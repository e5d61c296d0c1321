"""JAX's persistent compile cache for one test session: fresh, shared with its children, removed at exit.

The JAX suites compile the same small programs in many tests and in the child processes they start,
each well under JAX's 1-second default threshold, so every compile is kept. A directory made per
session (children inherit it through the environment) means no run reads what another left behind.
A cache hit still counts as a compile for ``offload_helpers.CompileCounter``. Imports only the
standard library: call it before JAX is imported.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def use_fresh_cache(prefix: str, *dir_vars: str) -> str:
    """Make the session's cache directory, point each of ``dir_vars`` at it, cache every compile."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    for var in dir_vars:
        os.environ[var] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    return path
