"""Publishing and reading one chunk file: the mechanics, no policy.

A write lands in a unique ``O_EXCL`` temp file in the final directory and is
published by ``rename``, so a reader sees the whole file or nothing, even if
the writer is killed; a read verifies everything before it says "hit". The
tier decides what failures mean (read-only, miss, quarantine); this module
only reports them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable

import numpy as np

from tpu_offload.core.fs import layout
from tpu_offload.core.fs.fileio import (
    O_DIRECT, aligned_empty, direct_ok, is_direct_refusal, read_all, write_all,
)
from tpu_offload.core.fs.format import (
    HEADER_SIZE, HeaderError, check_header, pack_header, parse_header, payload_checksum,
)

log = logging.getLogger("tpu_offload.fs")

HIT, MISS, ERROR, CORRUPT = "hit", "miss", "error", "corrupt"


class ChunkFiles:
    def __init__(self, digest: bytes, *, fsync: bool = False, o_direct: bool = False, name: str = "fs"):
        self.digest = digest
        self.fsync = fsync
        self.direct = bool(o_direct) and O_DIRECT != 0
        self.name = name
        self._known_dirs: set[str] = set()
        self._tls = threading.local()
        self._fchmod = layout.umask_strips(layout.FILE_MODE)
        # Test seam: called with the temp path once the payload is written and
        # before the rename publishes it (a test kills the writer there).
        self.before_publish: Callable[[str], None] | None = None

    # ---- write ---------------------------------------------------------
    def write(self, d: str, path: str, key: bytes, khex: str, mv: memoryview) -> None:
        """Publish ``mv`` as the chunk ``key`` at ``path`` (in directory ``d``); raises OSError."""
        if d not in self._known_dirs:
            layout.make_dirs(d)
            self._known_dirs.add(d)
        hdr = self._header_buf()
        pack_header(hdr, self.digest, key, len(mv), payload_checksum(mv))
        use_direct = self.direct and direct_ok(mv)
        tmp = f"{d}{os.sep}{layout.temp_name(khex)}"
        fd, use_direct = self._open_tmp(tmp, d, use_direct)
        try:
            try:
                if self._fchmod:  # the umask would strip bits of 0640
                    os.fchmod(fd, layout.FILE_MODE)
                try:
                    write_all(fd, [memoryview(hdr), mv])
                except OSError as e:
                    if not (use_direct and is_direct_refusal(e)):
                        raise
                    self._no_direct(e)
                    os.close(fd)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
                    write_all(fd, [memoryview(hdr), mv])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.before_publish is not None:
                self.before_publish(tmp)
            os.rename(tmp, path)
        except BaseException:
            layout.unlink_quiet(tmp)
            raise
        if self.fsync:  # make the rename itself durable
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _open_tmp(self, tmp: str, d: str, use_direct: bool) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        recreated = False
        for _ in range(3):
            try:
                return os.open(tmp, flags | (O_DIRECT if use_direct else 0), layout.FILE_MODE), use_direct
            except FileNotFoundError:
                if recreated:
                    raise
                # The fan-out dir vanished (an external cleaner): recreate once.
                recreated = True
                self._known_dirs.discard(d)
                layout.make_dirs(d)
                self._known_dirs.add(d)
            except OSError as e:
                if not (use_direct and is_direct_refusal(e)):
                    raise
                self._no_direct(e)
                use_direct = False
                layout.unlink_quiet(tmp)  # some filesystems (ramfs) create it, then refuse
        raise OSError(errno.EIO, f"could not create {tmp}")

    # ---- read ----------------------------------------------------------
    def read(self, path: str, key: bytes, mv: memoryview) -> tuple[str, object]:
        """Fill ``mv`` from the file. Returns one of

        ``(HIT, None)``, ``(MISS, None)``, ``(ERROR, OSError)`` or
        ``(CORRUPT, (reason, inode))``; only HIT means ``mv`` holds the chunk.
        """
        use_direct = self.direct and direct_ok(mv)
        hdr = self._header_buf()
        for _ in range(2):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if use_direct else 0))
            except FileNotFoundError:
                return MISS, None
            except OSError as e:
                if use_direct and is_direct_refusal(e):
                    self._no_direct(e)
                    use_direct = False
                    continue
                return ERROR, e
            try:
                try:
                    n = read_all(fd, [memoryview(hdr), mv])
                except OSError as e:
                    if use_direct and is_direct_refusal(e):
                        self._no_direct(e)
                        use_direct = False
                        continue
                    return ERROR, e
                reason = self._check(key, hdr, mv, n)
                if reason is not None:
                    return CORRUPT, (reason, os.fstat(fd).st_ino)
            finally:
                os.close(fd)
            return HIT, None
        return ERROR, OSError(errno.EIO, "O_DIRECT retry loop")

    def _check(self, key: bytes, hdr: np.ndarray, mv: memoryview, n: int) -> str | None:
        if n < HEADER_SIZE:
            return "truncated"
        try:
            h = parse_header(hdr)
        except HeaderError as e:
            return e.reason
        reason = check_header(h, self.digest, key, len(mv))
        if reason is not None:
            return reason
        if n < HEADER_SIZE + len(mv):
            return "truncated"
        if payload_checksum(mv) != h.checksum:
            return "checksum"
        return None

    # ---- helpers -------------------------------------------------------
    def _no_direct(self, e: OSError) -> None:
        if self.direct:
            self.direct = False
            log.info("fs tier %s: O_DIRECT refused (%s); using buffered I/O", self.name, e)

    def _header_buf(self) -> np.ndarray:
        buf = getattr(self._tls, "hdr", None)
        if buf is None:  # one page per I/O thread, aligned for O_DIRECT
            buf = self._tls.hdr = aligned_empty(HEADER_SIZE)
        return buf
