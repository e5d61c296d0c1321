"""Walks below the root that never follow a symlink; opens that never hang.

The volume is shared with other tenants, so any name below the root may be
swapped at any time for a symlink, a FIFO, a directory or a device node.
Every directory below the namespace directory is therefore opened relative
to its parent's fd with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink or a file
there fails with ENOTDIR/ELOOP instead of leading elsewhere), and every
create, rename, unlink and utime is done relative to that fd. Chunk files
are opened ``O_NONBLOCK | O_NOFOLLOW`` and kept only if ``fstat`` says
regular: a FIFO cannot block the opener and a symlink is never followed.
Walks use ``O_PATH`` fds, which need search permission only, like a path.

The root itself, and the path to it, is the operator's choice and may
contain symlinks; the namespace directory under it may not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import Iterator, Sequence

O_PATH = getattr(os, "O_PATH", 0)
_WALK = (O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# A path component that is there but is not a plain directory (or file).
UNSAFE_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO})


class NotRegular(OSError):
    """Something other than a regular file (or a symlink) sits at a file's name."""

    def __init__(self, name: str, mode: int | None):
        kind = "symlink" if mode is None else _kind(mode)
        super().__init__(errno.EINVAL, f"{name} is a {kind}")
        self.kind = kind


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "non-regular file"


def is_unsafe(e: OSError) -> bool:
    return isinstance(e, NotRegular) or e.errno in UNSAFE_ERRNOS


def open_base(path: str, *, listing: bool = False) -> int:
    """A namespace (or quarantine) directory by path; its last component must not be a symlink."""
    return os.open(path, (_LIST if listing else _WALK))


def walk(base: str, names: Sequence[str], *, create: bool = False, mode: int = 0o750,
         listing: bool = False) -> int:
    """fd of ``base/names[0]/...``: every component opened O_NOFOLLOW relative to its parent.

    With ``create``, missing components are made (``mode`` whatever the
    umask). The caller closes the fd. ``listing`` gives an fd ``scandir``
    and ``fsync`` accept (it needs read permission).
    """
    last = _LIST if listing else _WALK
    try:
        fd = os.open(base, last if not names else _WALK)
    except FileNotFoundError:
        if not create:
            raise
        from tpu_offload.core.fs.layout import make_dirs  # the base itself: by path, then re-opened

        make_dirs(base, mode)
        fd = os.open(base, last if not names else _WALK)
    try:
        for i, name in enumerate(names):
            flags = last if i == len(names) - 1 else _WALK
            try:
                nfd = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                _mkdir_at(name, fd, mode)
                nfd = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mkdir_at(name: str, dir_fd: int, mode: int) -> None:
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:
        return  # a racing creator: fine (the re-open checks it is a directory)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # mkdir's mode went through the umask
    finally:
        os.close(fd)


@contextlib.contextmanager
def dir_at(base: str, names: Sequence[str] = (), **kw) -> Iterator[int]:
    fd = walk(base, names, **kw)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(name: str, dir_fd: int, extra: int = 0) -> tuple[int, os.stat_result]:
    """(fd, stat) of a regular file, opened without following a symlink or blocking.

    Raises ``NotRegular`` for a symlink, FIFO, directory, socket or device.
    ``extra`` flags (``O_DIRECT``) stay set; ``O_NONBLOCK`` is cleared.
    """
    try:
        fd = os.open(name, _READ | extra, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegular(name, None) from None
        if e.errno in (errno.ENXIO, errno.ENODEV):  # a socket, a device without a driver
            raise NotRegular(name, stat.S_IFSOCK if e.errno == errno.ENXIO else stat.S_IFCHR) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(name, st.st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, extra & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def lstat_regular(name: str, dir_fd: int) -> os.stat_result | None:
    """The file's stat if a regular file is there; None if nothing or anything else is."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def unlink_if(name: str, dir_fd: int, ino: int | None = None, mtime_ns: int | None = None) -> bool:
    """Unlink a regular file at ``dir_fd`` (the same inode/mtime, if given); True if we did.

    Never follows or removes a symlink, FIFO or directory: those are not ours.
    """
    st = lstat_regular(name, dir_fd)
    if st is None or (ino is not None and st.st_ino != ino) or (mtime_ns is not None and st.st_mtime_ns != mtime_ns):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


def fsync_dir(dir_fd: int) -> None:
    """fsync a directory given by an O_PATH fd (those cannot be fsynced themselves)."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def server_now(dir_fd: int, probe_name: str) -> float | None:
    """The file server's clock: the mtime of a file just created in ``dir_fd``.

    Local clocks of hosts sharing a volume disagree; ages of files written by
    other hosts are only meaningful against the clock that stamped them.
    None when nothing can be created here (read-only).
    """
    try:
        fd = os.open(probe_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o640, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(probe_name, dir_fd=dir_fd)
        except OSError:
            pass
