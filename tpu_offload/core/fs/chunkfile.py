"""Publishing and reading one chunk file: the mechanics, no policy.

A write lands in a unique ``O_EXCL`` temp file in the final directory and is
published by ``rename``, so a reader sees the whole file or nothing, even if
the writer is killed; a read verifies everything before it says "hit".
Every path operation goes through ``safedir`` (relative to directory fds,
no symlink followed, no open that can block on a FIFO). The namespace
directory stays open (``helddir.HeldDir``), so an operation opens only the
two fan-out directories and the file: on NFS/Lustre each open is a round
trip. The tier decides what failures mean (read-only, miss, quarantine); this module
only reports them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable

import numpy as np

from tpu_offload.core.fs import actions, fileio, helddir, layout, safedir
from tpu_offload.core.fs.fileio import (
    O_DIRECT, aligned_empty, direct_ok, is_direct_refusal, read_all, write_all,
)
from tpu_offload.core.fs.auth import TenantKeys
from tpu_offload.core.fs.format import (
    FLAG_AEAD, FLAG_GMAC, FLAG_MAC, HEADER_SIZE, MAC_OFF, NONCE_BYTES, TAG_BYTES, HeaderError, aead_aad, check_header,
    pack_header, parse_header, payload_checksum,
)

log = logging.getLogger("tpu_offload.fs")
MAC_BYTES_PAD = 32 - NONCE_BYTES - TAG_BYTES  # the MAC field holds nonce + tag + zero padding

HIT, MISS, ERROR, CORRUPT, UNSAFE = "hit", "miss", "error", "corrupt", "unsafe"


class ChunkFiles:
    def __init__(self, ns_dir: str, digest: bytes, *, fsync: bool = False, o_direct: bool = False,
                 name: str = "fs", recheck_s: float = 1.0, dir_mode: int = layout.DIR_MODE,
                 owner: int | None = None, encrypt: bool = False, mac: str = "hmac-sha256",
                 report: Callable[[str, str, str], None] | None = None,
                 on_lost: Callable[[OSError], None] | None = None):
        self.ns_dir = ns_dir
        # Heals what is ours (modes, non-directories at our directory names: ``helddir.HeldDir``);
        # ``on_lost``: the namespace directory was replaced under us.
        self.ns = helddir.HeldDir(ns_dir, mode=dir_mode, recheck_s=recheck_s, owner=owner,
                                  quarantine=layout.QUARANTINE, aside=layout.aside_name, report=report,
                                  on_lost=on_lost)
        self.file_mode = layout.file_mode(dir_mode)
        self.encrypt = encrypt  # with tenant keys: AES-256-GCM payloads, the tag as the MAC
        self.gmac = mac == "gmac"  # else HMAC-SHA256
        self.digest = digest
        self.fsync = fsync
        self.direct = bool(o_direct) and O_DIRECT != 0
        self.name = name
        self._tls = threading.local()
        self._fchmod = layout.umask_strips(self.file_mode)
        # Test seam: called with the temp path once the payload is written and
        # before the rename publishes it (a test kills the writer there).
        self.before_publish: Callable[[str], None] | None = None

    def _dir(self, khex: str, create: bool = False):
        """The key's fan-out directory as an fd context (no symlink followed on the way)."""
        a, b, _ = layout.chunk_relpath(khex)
        return self.ns.dir_at((a, b), create=create)

    def close(self) -> None:
        self.ns.close()

    # ---- write ---------------------------------------------------------
    def write(self, key: bytes, khex: str, mv: memoryview, *, keep: Callable[[os.stat_result], bool] | None = None,
              tk: TenantKeys | None = None, publish: Callable[[], bool] | None = None) -> os.stat_result | None:
        """Publish ``mv`` as the chunk ``key``; raises OSError (ELOOP/ENOTDIR: a symlink on the way).

        ``key`` is what the header names (the file id with a secret); with
        ``tk`` the header carries a MAC over itself and the payload.

        With ``keep``, a regular file already published there for which
        ``keep(stat)`` is true (the tier: the very file it wrote or verified,
        by identity) is kept: its stat is returned and nothing is written. Any
        other file there is published over (rename): a file we did not write
        or verify never blocks our write. The check uses the directory fd the
        write would use, so a write walks the directories once. ``publish()`` is asked once the
        payload is down: False (past its deadline, abandoned) and the temp
        file goes instead of being renamed (``TimeoutError``).
        """
        with self._dir(khex, create=True) as d:
            if keep is not None:
                st = safedir.lstat_regular(khex, d)
                if st is not None and st.st_nlink == 1 and keep(st):
                    return st
            hdr = self._header_buf()
            if tk is not None and self.encrypt:
                mv = self._seal(hdr, key, mv, tk)  # the ciphertext, in a per-thread buffer
            elif tk is not None and self.gmac:
                nonce = os.urandom(NONCE_BYTES)
                pack_header(hdr, self.digest, key, len(mv), payload_checksum(mv),
                            lambda h: nonce + tk.gmac(h, mv, nonce) + bytes(MAC_BYTES_PAD), flags=FLAG_GMAC, head=tk)
            else:
                pack_header(hdr, self.digest, key, len(mv), payload_checksum(mv),
                            None if tk is None else (lambda h: tk.mac(h, mv)), head=tk)
            use_direct = self.direct and direct_ok(mv)
            tmp = layout.temp_name(khex)
            fd, use_direct = self._open_tmp(tmp, d, use_direct)
            try:
                try:
                    if self._fchmod:  # the umask would strip bits of 0640
                        os.fchmod(fd, self.file_mode)
                    try:
                        write_all(fd, [memoryview(hdr), mv])
                    except OSError as e:
                        if not (use_direct and is_direct_refusal(e)):
                            raise
                        self._no_direct(e)
                        os.close(fd)
                        fd = -1
                        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
                        write_all(fd, [memoryview(hdr), mv])
                    if self.fsync:
                        os.fsync(fd)
                    if publish is not None and not publish():
                        raise TimeoutError(errno.ETIMEDOUT, "the write passed its deadline (fs_io_timeout_s)")
                    if self.before_publish is not None:
                        self.before_publish(os.path.join(layout.chunk_dir(self.ns_dir, khex), tmp))
                    try:
                        os.rename(tmp, khex, src_dir_fd=d, dst_dir_fd=d)
                    except IsADirectoryError:  # a directory at the chunk's name: moved aside, once
                        if not self.ns.move_aside(d, khex, directory=True):
                            raise
                        os.rename(tmp, khex, src_dir_fd=d, dst_dir_fd=d)
                    # What we published, after the rename (it moves the ctime): the only file ours to restamp.
                    self._tls.ident = identity(os.fstat(fd))
                finally:
                    if fd >= 0:
                        os.close(fd)
            except BaseException:
                safedir.unlink_if(tmp, d)
                raise
            if self.fsync:  # make the rename itself durable
                safedir.fsync_dir(d)
        return None

    def _open_tmp(self, tmp: str, d: int, use_direct: bool) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(2):
            try:
                return os.open(tmp, flags | (O_DIRECT if use_direct else 0), self.file_mode, dir_fd=d), use_direct
            except OSError as e:
                if not (use_direct and is_direct_refusal(e)):
                    raise
                self._no_direct(e)
                use_direct = False
                safedir.unlink_if(tmp, d)  # some filesystems (ramfs) create it, then refuse
        raise OSError(errno.EIO, f"could not create {tmp}")

    # ---- read ----------------------------------------------------------
    def read(self, khex: str, key: bytes, mv: memoryview, tk: TenantKeys | None = None) -> tuple[str, object]:
        """Fill ``mv`` from the file. Returns one of

        ``(HIT, None)``, ``(MISS, None)``, ``(UNSAFE, what)`` (a symlink, FIFO,
        directory or device where the file or a directory belongs: a miss),
        ``(ERROR, OSError)`` or ``(CORRUPT, (reason, inode))``; only HIT means
        ``mv`` holds the chunk.
        """
        use_direct = self.direct and direct_ok(mv)
        hdr = self._header_buf()
        try:
            with self._dir(khex) as d:
                for _ in range(2):
                    try:
                        fd, _st = safedir.open_regular(khex, d, O_DIRECT if use_direct else 0)
                    except FileNotFoundError:
                        return MISS, None
                    except safedir.NotRegular as e:
                        return UNSAFE, e.kind
                    except OSError as e:
                        if use_direct and is_direct_refusal(e):
                            self._no_direct(e)
                            use_direct = False
                            continue
                        return ERROR, e
                    if _st.st_nlink > 1:  # also linked from elsewhere (maybe outside the root): not ours
                        os.close(fd)
                        return UNSAFE, "hardlink"
                    try:
                        try:
                            n = read_all(fd, [memoryview(hdr), mv])
                        except OSError as e:
                            if use_direct and is_direct_refusal(e):
                                self._no_direct(e)
                                use_direct = False
                                continue
                            return ERROR, e
                        reason = self._check(key, hdr, mv, n, tk, _st.st_size)
                        if reason is not None:
                            return CORRUPT, (reason, _st.st_ino)
                        self._tls.ident = identity(_st)  # verified: ours to restamp
                    finally:
                        os.close(fd)
                    return HIT, None
        except (FileNotFoundError, safedir.Replaced):  # replaced: the tier is off (``on_lost``)
            return MISS, None
        except OSError as e:
            if safedir.is_unsafe(e):
                return UNSAFE, "symlink or file in place of a directory"
            return ERROR, e
        return ERROR, OSError(errno.EIO, "O_DIRECT retry loop")

    # ---- metadata ------------------------------------------------------
    def stat(self, khex: str) -> os.stat_result | None:
        """The published file's stat, or None: absent, or not a regular file reached without symlinks."""
        try:
            if fileio.fault is not None:
                fileio.fault("stat")
            with self._dir(khex) as d:
                st = safedir.lstat_regular(khex, d)
        except OSError:
            return None
        return st if st is not None and st.st_nlink == 1 else None

    def last_identity(self) -> tuple[int, int, int] | None:
        """``identity`` of the file this thread last published (``write``) or verified (a ``read`` hit)."""
        return getattr(self._tls, "ident", None)

    def restamp(self, khex: str, ident: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """Set the file's mtime to now (the shared recency clock) if it is still the file ``ident`` names.

        Through an fd opened without following a symlink and checked by
        ``fstat``: a file someone swapped in since (even on a reused inode
        number: its ctime differs) is never kept alive by us. Returns the
        file's new identity (a restamp moves its ctime), or None.
        """
        with self._dir(khex) as d:
            try:
                fd, st = safedir.open_regular(khex, d)
            except (FileNotFoundError, safedir.NotRegular):
                return None
            try:
                if st.st_nlink != 1 or identity(st) != ident:  # a hardlink's inode is shared with a path outside
                    return None
                os.utime(fd)
                return identity(os.fstat(fd))
            finally:
                os.close(fd)

    def unlink(self, khex: str, ino: int | None = None, ours: bool = False) -> bool:
        """Remove the regular file (that inode, if given); True if we did. Symlinks are never removed.

        ``ours``: only if it starts with our magic (an eviction; a rejected
        file was just read and judged).
        """
        try:
            with self._dir(khex) as d:
                if ours and actions.ours_at(d, khex) is None:
                    return False
                return safedir.unlink_if(khex, d, ino)
        except FileNotFoundError:
            return False

    def evict(self, khex: str, unchanged: Callable[[os.stat_result], bool]) -> str:
        """Delete the chunk file if ``unchanged(stat)`` and ours (``actions.delete_if_unchanged``)."""
        try:
            with self._dir(khex) as d:
                return actions.delete_if_unchanged(d, khex, unchanged)
        except FileNotFoundError:
            return "vanished"

    def quarantine(self, khex: str, ino: int, reason: str) -> bool:
        """Move the file (that inode only) to ``<namespace>/quarantine/``."""
        with self._dir(khex) as d:
            if actions.ours_at(d, khex) is None:
                return False  # not ours (no magic): not ours to move either
            return actions.quarantine(self.ns_dir, d, khex, ino, reason)

    def _check(self, key: bytes, hdr: np.ndarray, mv: memoryview, n: int, tk: TenantKeys | None,
               size: int) -> str | None:
        return check_chunk(self.digest, key, hdr, mv, n, tk, size, self._ct_buf)

    # ---- encryption at rest (fs_encrypt) --------------------------------
    def _seal(self, hdr: np.ndarray, key: bytes, mv: memoryview, tk: TenantKeys) -> memoryview:
        """Encrypt ``mv`` into a per-thread buffer and fill the header; returns the ciphertext view."""
        buf = self._ct_buf(len(mv))
        nonce = os.urandom(NONCE_BYTES)  # random 96-bit nonces: safe far beyond 2**32 chunks per key
        tk.aead().encrypt_into(nonce, mv, aead_aad(self.digest, key, len(mv)), memoryview(buf))
        ct = memoryview(buf)[: len(mv)]
        tag = bytes(buf[len(mv):])
        pack_header(hdr, self.digest, key, len(mv), payload_checksum(ct),
                    lambda _h: nonce + tag + bytes(MAC_BYTES_PAD), flags=FLAG_AEAD, head=tk)
        return ct

    def _ct_buf(self, n: int) -> np.ndarray:
        buf = getattr(self._tls, "ct", None)
        if buf is None or len(buf) != n + TAG_BYTES:
            buf = self._tls.ct = aligned_empty(n + TAG_BYTES)
        return buf

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


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """Which file this is: device, inode and ctime (an inode number alone is reused once a file is deleted)."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def check_chunk(digest: bytes, key: bytes, hdr, mv: memoryview, n: int, tk: TenantKeys | None, size: int,
                ct_buf: Callable[[int], np.ndarray]) -> str | None:
    """Why a chunk read into ``hdr`` + ``mv`` (``n`` bytes, file of ``size``) must not be served, or None.

    With ``tk`` the MAC (or AEAD tag, decrypting ``mv`` in place) must verify;
    the tier and ``tpu-offload-fs verify`` both judge files with this one copy.
    """
    if n < HEADER_SIZE:
        return "truncated"
    try:
        h = parse_header(hdr)
    except HeaderError as e:
        return e.reason
    reason = check_header(h, digest, key, len(mv))
    if reason is not None:
        return reason
    if n < HEADER_SIZE + len(mv) or size < HEADER_SIZE + len(mv):
        return "truncated"
    if size > HEADER_SIZE + len(mv):  # trailing bytes: not the file we wrote
        return "length"
    if payload_checksum(mv) != h.checksum:
        return "checksum"
    if tk is not None:  # damage is caught above; this says whether one of our keys wrote it
        if h.flags & FLAG_AEAD:
            return _open_sealed(digest, h, key, mv, tk, ct_buf)
        if h.flags & FLAG_GMAC:
            try:
                ok = tk.gmac_ok(memoryview(hdr)[:MAC_OFF], mv, h.mac[:NONCE_BYTES],
                                h.mac[NONCE_BYTES:NONCE_BYTES + TAG_BYTES])
            except ImportError:  # no cryptography here: cannot verify, so never serve
                ok = False
            return None if ok else "mac"
        if not h.flags & FLAG_MAC or not tk.mac_ok(memoryview(hdr)[:MAC_OFF], mv, h.mac):
            return "mac"
    return None


def _open_sealed(digest: bytes, h, key: bytes, mv: memoryview, tk: TenantKeys,
                 ct_buf: Callable[[int], np.ndarray]) -> str | None:
    """Decrypt the ciphertext in ``mv`` in place (through ``ct_buf``); "mac" if the tag fails."""
    try:
        from cryptography.exceptions import InvalidTag
    except ImportError:  # no cryptography here: cannot decrypt, so never serve
        return "mac"

    n = len(mv)
    buf = ct_buf(n)
    buf[:n] = np.frombuffer(mv, dtype=np.uint8)
    buf[n:] = np.frombuffer(h.mac[NONCE_BYTES:NONCE_BYTES + TAG_BYTES], dtype=np.uint8)
    try:
        tk.aead().decrypt_into(h.mac[:NONCE_BYTES], memoryview(buf), aead_aad(digest, key, n), mv)
    except InvalidTag:
        return "mac"
    return None
