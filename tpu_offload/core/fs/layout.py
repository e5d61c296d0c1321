"""Where chunk files live and how a directory is walked.

``<root>/<namespace>/<k0k1>/<k2k3>/<key hex>``: the namespace is the layout
fingerprint's, so data of another layout is never even looked at; the two
hex fan-out levels keep directories small on Lustre/NFS. Names are the key's
lowercase hex, so no key can climb out of the root. Temp files start with
``.tmp.`` and quarantined files live under ``quarantine/``: neither matches
a chunk name, so lookups can never see them.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import stat
import string
from typing import Iterator

from tpu_offload.core.fs.format import MAX_KEY_BYTES

DIR_MODE = 0o750
FILE_MODE = 0o640
TMP_PREFIX = ".tmp."
QUARANTINE = "quarantine"
_HEX = frozenset(string.hexdigits.lower())


def key_hex(key: bytes) -> str:
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"chunk key of {len(key)} bytes; allowed 1..{MAX_KEY_BYTES}")
    return bytes(key).hex()


def chunk_relpath(khex: str) -> tuple[str, str, str]:
    """(fan-out 1, fan-out 2, file name). Short keys pad the fan-out with 0."""
    padded = khex.ljust(4, "0")
    return padded[0:2], padded[2:4], khex


def chunk_dir(ns_dir: str, khex: str) -> str:
    a, b, _ = chunk_relpath(khex)
    return os.path.join(ns_dir, a, b)


def chunk_path(ns_dir: str, khex: str) -> str:
    a, b, name = chunk_relpath(khex)
    return os.path.join(ns_dir, a, b, name)


def chunk_dir_and_path(ns_dir: str, khex: str) -> tuple[str, str]:
    """Both at once, by plain concatenation (the per-chunk hot path)."""
    if len(khex) < 4:
        return chunk_dir(ns_dir, khex), chunk_path(ns_dir, khex)
    d = f"{ns_dir}{os.sep}{khex[0:2]}{os.sep}{khex[2:4]}"
    return d, f"{d}{os.sep}{khex}"


def is_chunk_name(name: str) -> bool:
    return 2 <= len(name) <= 2 * MAX_KEY_BYTES and len(name) % 2 == 0 and set(name) <= _HEX


_TMP_TOKEN = secrets.token_hex(4)  # per process: pids repeat across hosts sharing a mount
_tmp_seq = itertools.count()


def temp_name(khex: str) -> str:
    """Unique without a syscall per write (O_EXCL still guards a collision)."""
    return f"{TMP_PREFIX}{khex[:16]}.{os.getpid()}.{_TMP_TOKEN}.{next(_tmp_seq)}"


def umask_strips(mode: int) -> bool:
    """Would the current umask remove bits of ``mode``? (Linux: read, not set.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return bool(int(line.split()[1], 8) & mode)
    except (OSError, ValueError):
        pass
    return True  # unknown: chmod explicitly


def make_dirs(path: str, mode: int = DIR_MODE) -> None:
    """``mkdir -p`` with an explicit mode on every directory we create.

    ``os.makedirs(mode=)`` is filtered by the umask; a chmod after each mkdir
    gives every instance the same 0750 whatever its umask. Racing creators
    are fine: EEXIST is success.
    """
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path.rstrip(os.sep))
    if parent and parent != path:
        make_dirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode)


@dataclasses.dataclass
class Found:
    path: str
    name: str
    size: int
    blocks: int  # bytes actually allocated (st_blocks * 512)
    mtime: float
    ino: int


@dataclasses.dataclass
class NamespaceScan:
    namespace: str
    path: str
    chunks: list[Found] = dataclasses.field(default_factory=list)
    temps: list[Found] = dataclasses.field(default_factory=list)
    quarantined: list[Found] = dataclasses.field(default_factory=list)
    foreign: list[str] = dataclasses.field(default_factory=list)


def _found(entry: os.DirEntry) -> Found | None:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:  # deleted under us: another instance's eviction
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return Found(entry.path, entry.name, st.st_size, st.st_blocks * 512, st.st_mtime, st.st_ino)


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        return []


def scan_namespace(ns_dir: str) -> NamespaceScan:
    """Every chunk, temp and quarantined file under one namespace directory."""
    out = NamespaceScan(os.path.basename(ns_dir.rstrip(os.sep)), ns_dir)
    for e1 in _scandir(ns_dir):
        if e1.name == QUARANTINE and e1.is_dir(follow_symlinks=False):
            out.quarantined.extend(f for e in _scandir(e1.path) if (f := _found(e)))
            continue
        if e1.name.startswith(TMP_PREFIX):  # the writability probe's temp
            if f := _found(e1):
                out.temps.append(f)
            continue
        if not (len(e1.name) == 2 and set(e1.name) <= _HEX and e1.is_dir(follow_symlinks=False)):
            out.foreign.append(e1.path)
            continue
        for e2 in _scandir(e1.path):
            if not (len(e2.name) == 2 and set(e2.name) <= _HEX and e2.is_dir(follow_symlinks=False)):
                out.foreign.append(e2.path)
                continue
            for e in _scandir(e2.path):
                if e.name.startswith(TMP_PREFIX):
                    if f := _found(e):
                        out.temps.append(f)
                elif is_chunk_name(e.name) and chunk_relpath(e.name)[:2] == (e1.name, e2.name):
                    if f := _found(e):
                        out.chunks.append(f)
                else:
                    out.foreign.append(e.path)
    return out


def iter_namespaces(root: str, only: str | None = None) -> Iterator[str]:
    """Namespace directories under ``root`` (sorted, for stable CLI output)."""
    for e in sorted(_scandir(root), key=lambda e: e.name):
        if e.is_dir(follow_symlinks=False) and (only is None or e.name == only):
            yield e.path


def unlink_quiet(path: str) -> bool:
    """True if we removed it; False if someone else already had (ENOENT)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
