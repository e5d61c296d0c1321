"""Helpers for the file-tier tests: layouts, keys, payloads, children, mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tpu_offload.core.fs.format import HEADER_SIZE
from tpu_offload.core.keys import LayoutFingerprint, make_chunk_key

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 64 << 10  # small but page-aligned, so O_DIRECT paths are exercised too
FILE = HEADER_SIZE + CHUNK

# The start of a child script that drops root to ``nobody`` (root is never denied anything, so a real
# permission failure needs another uid): collects the fs tier's warnings, imports before dropping root.
# argv: [1] the tier root, [2] tests/fs (for fs_helpers); scripts go on with their own lines.
NOBODY_PRELUDE = r"""
import json, logging, os, pwd, sys
sys.path.insert(0, sys.argv[2])
from prometheus_client import CollectorRegistry
warnings = []
class H(logging.Handler):
    def emit(self, r):
        if r.levelno >= logging.WARNING: warnings.append(r.getMessage())
logging.getLogger("tpu_offload.fs").addHandler(H())
from fs_helpers import aligned, key, layout   # import first: the interpreter's own files
from tpu_offload.core.fs import FileTier, FsMetrics  # may not be readable by nobody
nobody = pwd.getpwnam("nobody")
"""


def layout(**kw) -> LayoutFingerprint:
    base = dict(model="org/tiny-llama", dtype="bfloat16", block_size=16, blocks_per_chunk=4,
                num_layers=2, kv_heads_per_rank=2, head_dim=64)
    base.update(kw)
    return LayoutFingerprint(**base)


def key(i: int, group: int = 0) -> bytes:
    return make_chunk_key(i.to_bytes(4, "big") * 8, group)


def payload(i: int, nbytes: int = CHUNK) -> np.ndarray:
    """Deterministic bytes per key index, distinct across keys."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def aligned(nbytes: int = CHUNK) -> np.ndarray:
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off : off + nbytes]


def filled(i: int, nbytes: int = CHUNK) -> np.ndarray:
    """An O_DIRECT-aligned buffer holding key ``i``'s payload."""
    b = aligned(nbytes)
    b[:] = payload(i, nbytes)
    return b


def write_all(tier, *idx: int) -> None:
    """Write keys ``idx`` through ``tier`` and wait for each."""
    for i in idx:
        assert tier.submit_write(key(i), filled(i)).wait(30)


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=REPO)


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None):
    """A fresh mount of ``fstype`` (we are root); skips the test if mount fails."""
    d = tempfile.mkdtemp(prefix=f"fs-tier-{fstype}-", dir="/var/tmp")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, d]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount {fstype} ({' '.join(cmd)}): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


@contextlib.contextmanager
def readonly_bind(src: str):
    """``src`` seen through a read-only bind mount: EROFS even for root."""
    d = tempfile.mkdtemp(prefix="fs-tier-ro-", dir="/var/tmp")
    r1 = subprocess.run(["mount", "--bind", src, d], capture_output=True, text=True)
    r2 = r1.returncode == 0 and subprocess.run(
        ["mount", "-o", "remount,ro,bind", d], capture_output=True, text=True)
    if r1.returncode != 0 or r2.returncode != 0:
        if r1.returncode == 0:
            subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)
        pytest.skip(f"cannot make a read-only bind mount: {r1.stderr or r2.stderr}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


def shared_writer(root: str, seed: int, capacity: int, n_ops: int, keyspace: int, out) -> None:
    """One of several processes hammering one directory (multiprocessing target).

    Writes through a ring of slot buffers, honouring ``cancel_or_wait`` before
    reusing a slot, and checks every hit byte for byte.
    """
    from prometheus_client import CollectorRegistry

    from tpu_offload.core.fs import FileTier, FsMetrics

    rng = np.random.default_rng(seed)
    t = FileTier(root, layout(), CHUNK, capacity_bytes=capacity, threads=4, rescan_interval_s=0.05,
                 fs_metrics=FsMetrics(CollectorRegistry()))
    ring = [aligned() for _ in range(16)]
    tickets = [None] * 16
    readbuf = aligned()
    hits = wrong = writes = 0
    for n in range(n_ops):
        i = int(rng.integers(0, keyspace))
        if t.contains(key(i)) and t.read_into(key(i), readbuf):
            hits += 1
            wrong += not np.array_equal(readbuf, payload(i))
            continue
        s = n % 16
        if tickets[s] is not None:
            tickets[s].cancel_or_wait()
        ring[s][:] = payload(i)
        tickets[s] = t.submit_write(key(i), ring[s])
        writes += 1
    t.flush(60)
    out.put({"seed": seed, "hits": hits, "wrong": wrong, "writes": writes, "counters": t.counters()})
    t.close()


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` every 20 ms until it holds or ``timeout`` passes; its last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
