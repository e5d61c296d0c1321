"""The namespace directory, held open across operations: re-opened when removed, given up when replaced.

Every chunk operation walks below the namespace directory (``safedir``'s walks, which never follow a
symlink); opening that directory by path for each one would add a round trip per operation on NFS
or Lustre, so ``HeldDir`` keeps its fd. The volume is shared, so the directory may be removed and
made again under us (re-opened, ours), or moved away and something else put at its path (never
adopted: ``Replaced``, and the tier turns off until it re-vets the path). It also heals what is ours:
modes set back, non-directories at our directory names moved into a quarantine, never deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from typing import Callable, Iterator, Sequence

from tpu_offload.core.fs import safedir
from tpu_offload.core.fs.safedir import Replaced, log


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
                return safedir.walk_at(h.fd, names, create=create, mode=self.mode, listing=listing,
                                       check=None if self.owner is None else self._vet,
                                       blocked=self._blocked if create and _aside and self.aside is not None
                                       else None)
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
        if ident in self._vetted and safedir.mode_ok(st):
            return
        safedir.check_ours(st, self.owner, f"directory {name!r} under {self.path}", repair=self.mode, fd=fd,
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
        if st.st_uid != self.owner or safedir.mode_ok(st):
            return False
        what, old = f"namespace directory {self.path}", stat.S_IMODE(st.st_mode)
        try:
            safedir.fchmod_dir(h.fd, self.mode)
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
        kind = safedir.kind_name(st.st_mode) if not stat.S_ISREG(st.st_mode) else "file"
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
                    h = _Held(safedir.walk(self.path, (), create=create, mode=self.mode))
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    err = Replaced(self.path, "is a symlink or a file now")
                else:
                    st = os.fstat(h.fd)
                    if self.owner is not None:
                        try:
                            safedir.check_ours(st, self.owner, f"namespace directory {self.path}",
                                               repair=self.mode, fd=h.fd, report=self._report_mode)
                        except safedir.NotOurs as e:
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
            if self.owner is not None and not safedir.mode_ok(st):
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
