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
contain symlinks; the namespace directory under it may not. A directory
below the root that another uid owns was not made by us: another tenant
could plant or swap files in it, so it is never adopted (``NotOurs``, a miss
or a dropped write, like a symlink). One of ours with a wrong mode (group or
others can write it, or we can no longer search or write it) is set back
(``check_ours``); a non-directory at one of our directory names is moved
aside into the quarantine (``helddir.HeldDir``, the namespace directory held open, built on these walks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from typing import Callable, Iterator, Sequence

log = logging.getLogger("tpu_offload.fs")
O_PATH = getattr(os, "O_PATH", 0)
_WALK = (O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# A path component that is there but is not a plain directory (or file).
UNSAFE_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO})


class NotRegular(OSError):
    """Something other than a regular file (or a symlink) sits at a file's name."""

    def __init__(self, name: str, mode: int | None):
        kind = "symlink" if mode is None else kind_name(mode)
        super().__init__(errno.EINVAL, f"{name} is a {kind}")
        self.kind = kind


def kind_name(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "non-regular file"


class NotOurs(OSError):
    """A directory owned by another uid, or writable by group or others: not ours to use."""

    def __init__(self, what: str, st: os.stat_result, uid: int):
        super().__init__(errno.EPERM, f"{what} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; "
                                      f"this process (uid {uid}) only uses directories it owns that group and "
                                      "others cannot write")


def mode_ok(st: os.stat_result) -> bool:
    """Can we (the owner) list, search and create in this directory, and nobody else write it?"""
    return not st.st_mode & 0o022 and st.st_mode & 0o700 == 0o700


def check_ours(st: os.stat_result, uid: int, what: str = "directory", *, repair: int | None = None,
               fd: int | None = None, report: Callable[[str, str], None] | None = None) -> bool:
    """Raise ``NotOurs`` unless the directory is ``uid``'s and group and others cannot write it.

    With ``repair`` (a mode) and the directory's ``fd``, a directory of ours
    with a wrong mode is set back to ``repair`` through the fd and kept: a
    ``chmod g+w`` (anyone could plant files) as much as a ``chmod 0500`` or
    ``0000`` (we could no longer write or search it) by someone sharing our
    uid; refusing it, or failing on it, would let one chmod turn the tier off
    for every replica. Another uid's directory is still refused. Returns True
    if it repaired the mode; ``report(what, why)`` is told (else one warning).
    """
    if st.st_uid != uid:
        raise NotOurs(what, st, uid)
    if mode_ok(st):
        return False
    if repair is None or fd is None:
        if not st.st_mode & 0o022:
            return False  # only our own access is short: nobody else can plant anything; the caller's EACCES says so
        raise NotOurs(what, st, uid)
    try:
        fchmod_dir(fd, repair)
    except OSError:
        if not st.st_mode & 0o022:
            return False
        raise NotOurs(what, st, uid) from None
    why = f"mode {stat.S_IMODE(st.st_mode):o} set back to {repair:o}"
    if report is not None:
        report(what, why)
    else:
        log.warning("%s had %s", what, why)
    return True


def fchmod_dir(fd: int, mode: int) -> None:
    """``fchmod`` a directory fd, also an ``O_PATH`` one (those refuse fchmod).

    Through ``/proc/self/fd``, which names that very inode and needs no read
    or search permission on it (a ``chmod 0000`` directory of ours can be
    repaired); without ``/proc``, re-opened as ".".
    """
    try:
        os.fchmod(fd, mode)
        return
    except OSError as e:
        if e.errno != errno.EBADF:
            raise
    try:
        os.chmod(f"/proc/self/fd/{fd}", mode)
        return
    except FileNotFoundError:
        pass
    rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    try:
        os.fchmod(rfd, mode)
    finally:
        os.close(rfd)


class Replaced(OSError):
    """The namespace directory we hold is no longer the one at its path: not ours to use any more."""

    def __init__(self, path: str, why: str):
        super().__init__(errno.ESTALE, f"the namespace directory {path} {why}; it is not ours any more")


def is_unsafe(e: OSError) -> bool:
    return isinstance(e, (NotRegular, NotOurs, Replaced)) or e.errno in UNSAFE_ERRNOS


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
    if not names:
        return fd
    try:
        return walk_at(fd, names, create=create, mode=mode, listing=listing)
    finally:
        os.close(fd)


def walk_at(dir_fd: int, names: Sequence[str], *, create: bool = False, mode: int = 0o750,
            listing: bool = False, check=None, blocked=None) -> int:
    """Like ``walk`` from an open directory fd, which stays open (``names`` not empty).

    ``check(fd, name)`` vets each directory opened (raises ``NotOurs``).
    ``blocked(parent_fd, name)`` (with ``create``) is asked when something
    other than a directory sits at a name: True if it moved that aside, and
    the directory is then made.
    """
    if not names:
        raise ValueError("walk_at needs at least one name")
    last = _LIST if listing else _WALK
    fd = dir_fd
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
            except OSError as e:
                if not (create and blocked is not None and e.errno in (errno.ENOTDIR, errno.ELOOP)
                        and blocked(fd, name)):
                    raise
                _mkdir_at(name, fd, mode)
                nfd = os.open(name, flags, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nfd
            if check is not None:
                check(fd, name)
    except BaseException:
        if fd != dir_fd:
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
