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
aside into the quarantine (``HeldDir``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
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


class Replaced(OSError):
    """The namespace directory we hold is no longer the one at its path: not ours to use any more."""

    def __init__(self, path: str, why: str):
        super().__init__(errno.ESTALE, f"the namespace directory {path} {why}; it is not ours any more")


class HeldDir:
    """A directory kept open across operations and walked relative to its fd.

    Why: on NFS or Lustre every open is a round trip, and re-opening the
    namespace directory by path for every chunk operation added one per
    operation. Why it re-opens: someone may remove and recreate the directory
    (``rm -rf``) under us. A removed one shows up as ENOENT from a walk with
    the fd unlinked (``st_nlink == 0``), ESTALE on NFS, or another inode at
    the path; the last check also runs every ``recheck_s`` seconds. A
    directory that was removed, or is simply gone, is made again (ours). One
    that still exists elsewhere while another directory (or a symlink) sits
    at its path was moved aside and replaced: whoever did it, what is at the
    path now is not the directory we made, so nothing is adopted, every walk
    raises ``Replaced`` and ``on_lost`` is told (the tier turns off, tells
    its scheduler, and re-vets the path after its retry delay; ``reset``).
    The path's last component is never followed if it is a symlink.
    An fd is closed only when no walk is using it, so a concurrent walk never
    runs against a reused fd number.

    Self-healing (with ``owner``): a directory of ours whose mode no longer
    lets us search or write it, or lets others write it, is set back to
    ``mode`` (``check_ours``), checked on every walk from the fstat the walk
    already does; with ``aside`` (a name maker) and ``quarantine`` (a
    subdirectory), a non-directory at one of our directory names is moved
    into the quarantine (never deleted: it may not be ours). ``report(what,
    path, detail)`` is told of each repair (``mode``, ``moved_aside``) and
    each failure (``failed``).
    """

    def __init__(self, path: str, *, mode: int = 0o750, recheck_s: float = 1.0, owner: int | None = None,
                 quarantine: str | None = None, aside: Callable[[str], str] | None = None,
                 report: Callable[[str, str, str], None] | None = None,
                 on_lost: Callable[[OSError], None] | None = None):
        self.path = path
        self.mode = mode
        self.recheck_s = recheck_s
        self.owner = owner  # a uid: every directory walked must be its own (``check_ours``)
        self.quarantine, self.aside = quarantine, aside
        self.report = report
        self.on_lost = on_lost
        self._lost: Replaced | None = None
        self._vetted: set[tuple[int, int]] = set()  # (dev, ino) of fan-out directories found ours
        self._lock = threading.Lock()
        self._cur: _Held | None = None
        self._next_check = 0.0
        self._closed = False

    def walk(self, names: Sequence[str], *, create: bool = False, listing: bool = False,
             _aside: bool = True) -> int:
        """fd of ``path/names...`` (``walk_at`` from the held fd; one re-open if it went stale).

        A walk refused (EACCES) by the namespace directory's own mode is
        retried once after that mode is repaired.
        """
        stale_done = heal_done = False
        while True:
            h = self._acquire(create)
            try:
                return walk_at(h.fd, names, create=create, mode=self.mode, listing=listing,
                               check=None if self.owner is None else self._vet,
                               blocked=self._blocked if create and _aside and self.aside is not None else None)
            except PermissionError:
                if heal_done or not self._heal_held(h):
                    raise
                heal_done = True
            except OSError as e:
                if stale_done or not self._stale(h, e):
                    raise
                stale_done = True
            finally:
                self._release(h)

    def _vet(self, fd: int, name: str) -> None:
        """One fstat per directory; an inode found ours is remembered (only we can rename in our directories).

        The mode is looked at every time (from that fstat): a ``chmod`` of a
        directory already found ours is repaired before the walk goes on.
        """
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if ident in self._vetted and mode_ok(st):
            return
        check_ours(st, self.owner, f"directory {name!r} under {self.path}", repair=self.mode, fd=fd,
                   report=self._report_mode)
        if len(self._vetted) > 200_000:
            self._vetted.clear()
        self._vetted.add(ident)

    def _report_mode(self, what: str, why: str) -> None:
        if self.report is not None:
            self.report("mode", what, why)
        else:
            log.warning("%s had %s", what, why)

    def heal(self) -> bool:
        """Check the namespace directory's mode now (not at the next re-check); True if it was repaired."""
        h = self._acquire(False)
        try:
            return self._heal_held(h)
        finally:
            self._release(h)

    def _heal_held(self, h: "_Held") -> bool:
        """Set the held namespace directory back to our mode if ours and wrong; False if not needed or failed."""
        if self.owner is None:
            return False
        try:
            st = os.fstat(h.fd)
        except OSError:
            return False
        if st.st_uid != self.owner or mode_ok(st):
            return False
        what, old = f"namespace directory {self.path}", stat.S_IMODE(st.st_mode)
        try:
            fchmod_dir(h.fd, self.mode)
        except OSError as e:
            self._report("failed", what, f"mode {old:o} could not be set back to {self.mode:o} ({e.strerror or e})")
            return False
        self._report_mode(what, f"mode {old:o} set back to {self.mode:o}")
        return True

    def _blocked(self, parent_fd: int, name: str) -> bool:
        return self.move_aside(parent_fd, name, directory=False)

    def move_aside(self, parent_fd: int, name: str, *, directory: bool) -> bool:
        """Move what blocks ``name`` in our directory ``parent_fd`` into the quarantine; True if the name is free.

        ``directory``: the blocker is a directory (at a file's name), else a
        non-directory (at a directory's name). Anything else there now is
        left alone (True: another of our threads already made the name right).
        Renamed, never deleted: a tenant's directory or file is still theirs,
        only no longer in our way. False (and ``report``) if it cannot be
        moved (the quarantine is blocked, a directory we may not move).
        """
        where = f"{name!r} under {self.path}"
        if self.aside is None or self.quarantine is None:
            return False
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True  # gone meanwhile: the name is free
        except OSError:
            return False
        if stat.S_ISDIR(st.st_mode) != directory:
            return True  # no longer what blocked us (a racing thread of ours moved it and made the name right)
        kind = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "file"
        try:
            q = self.walk((self.quarantine,), create=True, _aside=False)
        except OSError as e:
            self._report("failed", where, f"a {kind} is in the way and the quarantine cannot be used "
                                          f"({e.strerror or e})")
            return False
        try:
            dest = self.aside(name)
            try:
                os.stat(dest, dir_fd=q, follow_symlinks=False)
                return False  # a name clash (never replace what is there)
            except FileNotFoundError:
                pass
            os.rename(name, dest, src_dir_fd=parent_fd, dst_dir_fd=q)
        except FileNotFoundError:
            return True
        except OSError as e:
            self._report("failed", where, f"a {kind} is in the way and cannot be moved aside ({e.strerror or e})")
            return False
        finally:
            os.close(q)
        self._report("moved_aside", where, f"a {kind} was in the way; moved to {self.quarantine}/{dest}")
        return True

    def _report(self, what: str, where: str, detail: str) -> None:
        if self.report is not None:
            self.report(what, where, detail)
        else:
            log.warning("%s: %s", where, detail)

    def reset(self) -> None:
        """Adopt whatever directory of ours is at the path from the next walk on (after ``Replaced``)."""
        with self._lock:
            self._lost = None
            if self._cur is not None:
                self._retire(self._cur)

    @contextlib.contextmanager
    def dir_at(self, names: Sequence[str], *, create: bool = False) -> Iterator[int]:
        fd = self.walk(names, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._cur is not None:
                self._retire(self._cur)

    def __del__(self) -> None:  # a tier never closed must not leak its fd (no walk can be running now)
        h = getattr(self, "_cur", None)
        if h is not None and not h.retired:
            h.retired = True
            try:
                os.close(h.fd)
            except OSError:
                pass

    def _acquire(self, create: bool) -> "_Held":
        with self._lock:
            if self._lost is not None:
                raise self._lost
            h = self._cur
            if h is not None and time.monotonic() < self._next_check:
                h.users += 1
                return h
            if h is not None:
                self._next_check = time.monotonic() + self.recheck_s
        if h is not None:  # due a check of the path (off the lock)
            verdict = self._verdict(h)
            if verdict != "same":
                with self._lock:
                    self._retire(h)
                if verdict == "replaced":
                    self._lose(Replaced(self.path, "was moved away and another directory put in its place"))
        err = None
        with self._lock:
            if self._lost is not None:
                raise self._lost
            h = self._cur
            if h is None or self._closed:
                try:
                    h = _Held(walk(self.path, (), create=create, mode=self.mode))
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    err = Replaced(self.path, "is a symlink or a file now")
                else:
                    st = os.fstat(h.fd)
                    if self.owner is not None:
                        try:
                            check_ours(st, self.owner, f"namespace directory {self.path}", repair=self.mode,
                                       fd=h.fd, report=self._report_mode)
                        except NotOurs as e:
                            os.close(h.fd)
                            err = Replaced(self.path, f"is another owner's now ({e.strerror})")
                    if err is None:
                        h.ident = _ident(st)
                        if self._closed:
                            h.retired = True  # a straggler after close: used once, then closed
                        else:
                            self._cur, self._next_check = h, time.monotonic() + self.recheck_s
            if err is None:
                h.users += 1
                return h
        self._lose(err)

    def _lose(self, err: Replaced) -> None:
        """The namespace is not ours any more: every walk raises ``err`` until ``reset``; ``on_lost`` is told."""
        with self._lock:
            first = self._lost is None
            self._lost = err
        if first and self.on_lost is not None:
            self.on_lost(err)
        raise err

    def _release(self, h: "_Held") -> None:
        with self._lock:
            h.users -= 1
            if h.retired and h.users == 0:
                os.close(h.fd)

    def _retire(self, h: "_Held") -> None:
        """Under the lock: stop handing ``h`` out; closed by its last user."""
        if self._cur is h:
            self._cur = None
        if not h.retired:
            h.retired = True
            if h.users == 0:
                os.close(h.fd)

    def _stale(self, h: "_Held", e: OSError) -> bool:
        """After a failed walk: is ``h`` a removed or replaced directory? (Then it is retired.)"""
        if e.errno not in (errno.ENOENT, errno.ESTALE):
            return False
        verdict = "gone"
        if e.errno == errno.ENOENT:
            verdict = self._verdict(h)
            if verdict == "same":
                return False  # a plain miss
        with self._lock:
            self._retire(h)
        if verdict == "replaced":
            self._lose(Replaced(self.path, "was moved away and another directory put in its place"))
        return True

    def _verdict(self, h: "_Held") -> str:
        """Is ``h`` still the directory at the path ("same"), gone or removed ("gone"), or moved aside
        while something else took its path ("replaced")? "same" also repairs a mode that went wrong."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return "gone"  # nothing there (a write makes it again), or ESTALE: re-open by path decides
        if _ident(st) == h.ident:
            if self.owner is not None and not mode_ok(st):
                self._heal_held(h)
            return "same"
        try:
            if os.fstat(h.fd).st_nlink == 0:
                return "gone"  # removed (rm -rf): what is at the path now is vetted when it is opened
        except OSError:
            return "gone"  # ESTALE: the server no longer knows it
        return "replaced"


class _Held:
    __slots__ = ("fd", "ident", "users", "retired")

    def __init__(self, fd: int):
        self.fd, self.ident, self.users, self.retired = fd, (0, 0), 0, False


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
