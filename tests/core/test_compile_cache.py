"""The test sessions' compile cache (tpu_offload/testing/compile_cache.py): a session killed by a signal
leaves its directory behind; the next one removes it, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

from tpu_offload.testing import compile_cache

PREFIX = "t-xla-cache-"


def test_directories_of_dead_sessions_go_and_nothing_else(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = tmp_path / f"{PREFIX}{dead.stdout.strip()}-abc"  # its process has exited
    (gone / "entry").mkdir(parents=True)
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"  # a session still running
    live.mkdir()
    other = tmp_path / "t-xla-cache-notapid-x"  # not a session's name
    other.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"{PREFIX}{dead.stdout.strip()}-link"  # a link with a dead session's name
    link.symlink_to(target)
    assert compile_cache.remove_orphans(PREFIX, str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.is_dir() and other.is_dir() and link.is_symlink() and target.is_dir()


def test_a_session_names_its_directory_after_its_process(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache.tempfile, "tempdir", str(tmp_path))
    for var in ("T_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        monkeypatch.setenv(var, "")  # restored after the test
    path = compile_cache.use_fresh_cache(PREFIX, "T_CACHE_DIR")
    assert os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-") and os.path.isdir(path)
    assert os.environ["T_CACHE_DIR"] == path
    assert compile_cache.remove_orphans(PREFIX, str(tmp_path)) == []  # its own process runs
