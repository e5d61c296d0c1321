"""Where chunk files live and how a directory is walked.

``<root>/<namespace>/<k0k1>/<k2k3>/<key hex>``: the namespace is the layout
fingerprint's, so data of another layout is never even looked at; the two
hex fan-out levels keep directories small on Lustre/NFS. Names are the key's
lowercase hex, so no key can climb out of the root. Temp files are named
``.tmp.<key16>.<pid>.<token>.<n>`` and quarantined files live under
``quarantine/``: neither matches a chunk name, so lookups never see them,
and the cleaners delete only names of exactly these shapes. Walks go
through ``safedir``: nothing below the namespace directory is followed if
it is a symlink.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
import secrets
import socket
import stat
import string
import time
from typing import Callable, Iterator

from tpu_offload.core.fs import safedir
from tpu_offload.core.fs.format import MAX_KEY_BYTES

DIR_MODE = 0o700  # ours alone by default; 0o750 (files 0o640) by the fs_dir_mode setting
FILE_MODE = 0o600


def file_mode(dir_mode: int) -> int:
    """Files get the directory's read bits (0700 -> 0600, 0750 -> 0640)."""
    return dir_mode & 0o640
TMP_PREFIX = ".tmp."
QUARANTINE = "quarantine"
_HEX = frozenset(string.hexdigits.lower())
# Our names only: ``temp_name`` and the tier's/CLI's quarantine renames.
# ``.tmp.<key16>.<pid>.<host tag>.<token>.<n>``; names without the host tag are from older versions.
_TMP_RE = re.compile(r"^\.tmp\.(?:[0-9a-f]{1,16}|probe|clock)\.([0-9]+)\.(?:([0-9a-f]{8})\.)?[0-9a-f]{8}\.[0-9]+$")
_QUAR_RE = re.compile(r"^[0-9a-f]{2,%d}\.[a-z_]{1,32}\.[0-9]+$" % (2 * MAX_KEY_BYTES))


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


def published_stat(ns_dir: str, khex: str) -> os.stat_result | None:
    """A published chunk's stat: a regular file reached without following a symlink, or None.

    The presence check for anyone who only looks (``os.stat`` would follow
    a symlink planted at the key or on the way, and count a FIFO).
    """
    from tpu_offload.core.fs import fileio

    a, b, _ = chunk_relpath(khex)
    try:
        if fileio.fault is not None:
            fileio.fault("stat")
        with safedir.dir_at(ns_dir, (a, b)) as d:
            st = safedir.lstat_regular(khex, d)
    except OSError:
        return None
    return st if st is not None and st.st_nlink == 1 else None  # a hardlink also lives elsewhere: not ours


def is_chunk_name(name: str) -> bool:
    return 2 <= len(name) <= 2 * MAX_KEY_BYTES and len(name) % 2 == 0 and set(name) <= _HEX


_TMP_TOKEN = secrets.token_hex(4)  # per process: pids repeat across hosts sharing a mount
_tmp_seq = itertools.count()


def _host_tag() -> str:
    """8 hex digits naming this kernel boot and pid namespace: where a temp's pid means something.

    Two writers with one tag see the same pids, so ``kill(pid, 0)`` tells
    whether a temp's writer still lives; any other tag (another host, pod,
    or boot) is never judged by pid.
    """
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(str(os.stat(path).st_ino) if path.endswith("pid") else open(path).read().strip())
        except OSError:
            parts.append(secrets.token_hex(8))  # unknown: a tag nobody else has, so no temp is judged by pid
    return hashlib.blake2b("|".join(parts).encode(), digest_size=4).hexdigest()


HOST_TAG = _host_tag()


def temp_name(khex: str) -> str:
    """Unique without a syscall per write (O_EXCL still guards a collision)."""
    return f"{TMP_PREFIX}{khex[:16]}.{os.getpid()}.{HOST_TAG}.{_TMP_TOKEN}.{next(_tmp_seq)}"


def temp_writer_dead(name: str) -> bool:
    """Is ``name`` a temp of ours whose writer ran in this pid namespace and is gone? (Then reap it now.)"""
    m = _TMP_RE.match(name)
    if m is None or m.group(2) != HOST_TAG:
        return False
    pid = int(m.group(1))
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive (EPERM: another user's), or cannot tell
    return False


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
    path: str  # for messages; act on it with ``dirs`` + ``name`` under the namespace (no symlinks)
    name: str
    size: int
    blocks: int  # bytes actually allocated (st_blocks * 512)
    mtime: float
    ino: int
    dirs: tuple[str, ...] = ()  # directories between the namespace directory and the file
    mtime_ns: int = 0
    nlink: int = 1  # more than one: the inode is also linked elsewhere, so it is not ours


@dataclasses.dataclass
class NamespaceScan:
    namespace: str
    path: str
    chunks: list[Found] = dataclasses.field(default_factory=list)
    temps: list[Found] = dataclasses.field(default_factory=list)
    quarantined: list[Found] = dataclasses.field(default_factory=list)
    foreign: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, why): skipped


def is_our_temp(name: str) -> bool:
    """A temp file this code names (never an editor's ``.tmp.*`` or another tool's)."""
    return _TMP_RE.match(name) is not None


def is_our_quarantine(name: str) -> bool:
    return _QUAR_RE.match(name) is not None


def quarantine_name(khex: str, reason: str) -> str:
    """``<key hex>.<reason's first word>.<pid>``: the only names ``is_our_quarantine`` accepts."""
    return f"{khex}.{reason.split(' ')[0]}.{os.getpid()}"


def aside_name(name: str) -> str:
    """``<name>.blocking.<pid><9 random digits>``: what blocked one of our names, in the quarantine.

    Unique (the rename never replaces anything there), and of the shape
    ``is_our_quarantine`` knows, so ``inspect`` lists it; only a regular file
    with our magic (and MAC) is ever deleted from there, so a tenant's
    directory or file moved aside stays theirs.
    """
    return f"{name}.blocking.{os.getpid()}{secrets.randbelow(10 ** 9):09d}"


class Pacer:
    """Makes a long background loop step aside: sleep ``pause_s`` after each ``run_s`` of work.

    Why sleep and not just release the GIL: a thread doing many short
    syscalls releases and retakes the GIL thousands of times a second, and
    CPython's switch logic counts each retake as progress, so a waiting
    engine thread may never be handed the GIL until the loop ends (measured:
    1 s stalls during a 150k-file walk). A real sleep leaves the GIL free
    long enough for the waiting thread to be scheduled and take it.
    """

    def __init__(self, run_s: float = 0.002, pause_s: float = 0.0005):
        self.run_s, self.pause_s = run_s, pause_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.run_s:
            time.sleep(self.pause_s)
            self._since = time.perf_counter()


class _Walk:
    """One directory walk: records what cannot be read instead of raising."""

    def __init__(self, out: NamespaceScan, pace: Callable[[], None] | None, owner: int | None = None,
                 repair: int | None = None, report: Callable[[str, str], None] | None = None):
        self.out = out
        self.pace = pace
        self.owner = owner
        self.repair = repair
        self.report = report

    def listing(self, parent_fd: int, name: str, path: str) -> tuple[int, list[os.DirEntry]] | None:
        """(fd, entries) of a subdirectory, or None (gone, not a directory, unreadable)."""
        try:
            fd = self._open_listing(parent_fd, name, path)
        except FileNotFoundError:
            return None
        except OSError as e:
            if safedir.is_unsafe(e):
                self.out.foreign.append(path)  # a symlink or a file where a directory belongs
            else:
                self.out.unreadable.append((path, e.strerror or str(e)))
            return None
        if self.owner is not None:
            try:
                safedir.check_ours(os.fstat(fd), self.owner, path, repair=self.repair, fd=fd, report=self.report)
            except OSError:
                os.close(fd)
                self.out.foreign.append(path)  # another uid's, or writable by others: not ours
                return None
        try:
            return fd, self.entries(fd)
        except OSError as e:
            os.close(fd)
            self.out.unreadable.append((path, e.strerror or str(e)))
            return None

    def _open_listing(self, parent_fd: int, name: str, path: str) -> int:
        """Open a subdirectory to list it; one of ours we may not read (``chmod 0000``) is repaired first."""
        try:
            return os.open(name, safedir._LIST, dir_fd=parent_fd)
        except PermissionError as denied:
            if self.owner is None or self.repair is None:
                raise
            try:
                pfd = os.open(name, safedir._WALK, dir_fd=parent_fd)  # needs search permission on the parent only
                try:
                    repaired = safedir.check_ours(os.fstat(pfd), self.owner, path, repair=self.repair, fd=pfd,
                                                  report=self.report)
                finally:
                    os.close(pfd)
            except OSError:
                raise denied from None  # not ours (another uid's): unreadable, as before
            if not repaired:
                raise
            return os.open(name, safedir._LIST, dir_fd=parent_fd)

    @staticmethod
    def entries(fd: int) -> list[os.DirEntry]:
        with os.scandir(fd) as it:
            return list(it)

    def stat(self, entry: os.DirEntry, parent: str) -> os.stat_result | None:
        """The entry's own stat if it is a regular file; else None (and noted)."""
        if self.pace is not None:
            self.pace()
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # deleted under us: another instance's eviction
            return None
        except OSError as e:
            self.out.unreadable.append((f"{parent}{os.sep}{entry.name}", e.strerror or str(e)))
            return None
        if not stat.S_ISREG(st.st_mode):
            self.out.foreign.append(f"{parent}{os.sep}{entry.name}")  # FIFO, device, symlink, directory
            return None
        return st

    def found(self, entry: os.DirEntry, parent: str, dirs: tuple[str, ...]) -> Found | None:
        st = self.stat(entry, parent)
        return None if st is None else _found(entry.name, st, parent, dirs)


def _found(name: str, st: os.stat_result, parent: str, dirs: tuple[str, ...]) -> Found:
    return Found(f"{parent}{os.sep}{name}", name, st.st_size, st.st_blocks * 512, st.st_mtime, st.st_ino,
                 dirs, st.st_mtime_ns, st.st_nlink)


def walk_namespace(ns_dir: str, out: NamespaceScan, pace: Callable[[], None] | None = None,
                   owner: int | None = None, vet: Callable[[int, str, os.stat_result], bool] | None = None,
                   repair: int | None = None, report: Callable[[str, str], None] | None = None,
                   ) -> Iterator[tuple[str, os.stat_result, tuple[str, str]]]:
    """Yield (name, stat, fan-out dirs) per chunk file; temps, quarantined,
    foreign and unreadable entries go to ``out``.

    Streams, so a rescan of 150k files holds no per-file Python containers
    (the garbage collector would stall every thread on them). Raises OSError
    only if the namespace directory itself cannot be listed; anything below
    that cannot be read is skipped and listed in ``out.unreadable``.
    Symlinks are never followed (they count as foreign). ``pace`` (e.g. a
    ``Pacer``) is called once per file. With ``owner`` (the tier's uid), a
    fan-out directory that is not ours and a hardlinked file are foreign.
    ``vet(dir_fd, name, stat)`` decides whether a chunk-named file is ours
    (our magic, a header MAC that verifies): False and it is foreign. With
    ``repair`` (a mode), a fan-out directory of ours that group or others
    can write, or that we can no longer list or search (``chmod 0000``), is
    set back to it (``fchmod``) instead of being foreign or unreadable;
    ``report(path, why)`` is told of each repair.
    """
    w = _Walk(out, pace, owner, repair, report)
    try:
        fd = safedir.open_base(ns_dir, listing=True)
    except FileNotFoundError:
        return  # not created yet, or removed by an operator: nothing to see
    try:
        for e1 in w.entries(fd):
            p1 = f"{ns_dir}{os.sep}{e1.name}"
            if e1.name == QUARANTINE:
                _quarantine(w, fd, p1)
                continue
            if e1.name.startswith(TMP_PREFIX):  # the writability probe's temp
                if (f := w.found(e1, ns_dir, ())) is not None and is_our_temp(e1.name):
                    out.temps.append(f)
                elif f is not None:
                    out.foreign.append(p1)
                continue
            if not (len(e1.name) == 2 and set(e1.name) <= _HEX):
                out.foreign.append(p1)
                continue
            sub1 = w.listing(fd, e1.name, p1)
            if sub1 is None:
                continue
            fd1, entries1 = sub1
            try:
                for e2 in entries1:
                    p2 = f"{p1}{os.sep}{e2.name}"
                    if not (len(e2.name) == 2 and set(e2.name) <= _HEX):
                        out.foreign.append(p2)
                        continue
                    sub2 = w.listing(fd1, e2.name, p2)
                    if sub2 is None:
                        continue
                    fd2, entries2 = sub2
                    try:
                        dirs = (e1.name, e2.name)
                        for e in entries2:
                            if is_our_temp(e.name):
                                if (f := w.found(e, p2, dirs)) is not None:
                                    out.temps.append(f)
                            elif is_chunk_name(e.name) and chunk_relpath(e.name)[:2] == dirs:
                                if (st := w.stat(e, p2)) is None:
                                    pass
                                elif (owner is not None and st.st_nlink > 1) or \
                                        (vet is not None and not vet(fd2, e.name, st)):
                                    out.foreign.append(f"{p2}{os.sep}{e.name}")
                                else:
                                    yield e.name, st, dirs
                            else:
                                out.foreign.append(f"{p2}{os.sep}{e.name}")
                    finally:
                        os.close(fd2)
            finally:
                os.close(fd1)
    finally:
        os.close(fd)


def _quarantine(w: _Walk, fd: int, path: str) -> None:
    sub = w.listing(fd, QUARANTINE, path)
    if sub is None:
        return
    qfd, entries = sub
    try:
        for e in entries:
            f = w.found(e, path, (QUARANTINE,))
            if f is not None and is_our_quarantine(e.name):
                w.out.quarantined.append(f)
            elif f is not None:
                w.out.foreign.append(f.path)
    finally:
        os.close(qfd)


def scan_namespace(ns_dir: str) -> NamespaceScan:
    """Every chunk, temp and quarantined file under one namespace directory (see ``walk_namespace``)."""
    out = NamespaceScan(os.path.basename(ns_dir.rstrip(os.sep)), ns_dir)
    for name, st, dirs in walk_namespace(ns_dir, out):
        out.chunks.append(_found(name, st, os.path.join(ns_dir, *dirs), dirs))
    return out


def iter_namespaces(root: str, only: str | None = None) -> Iterator[str]:
    """Namespace directories under ``root`` (sorted, for stable CLI output); symlinks skipped."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False) and (only is None or e.name == only):
            yield e.path


def unlink_quiet(path: str) -> bool:
    """True if we removed it; False if someone else already had (ENOENT)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
