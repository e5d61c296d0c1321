"""The scrypt salt of a deployment: random, made once, kept in the shared directory every replica uses.

Why: the root key is scrypt(secret, salt). With one fixed salt, a dictionary
of candidate secrets computed once could be tested against every
deployment's public values (``kv-<tag>`` names, header MACs); a salt per
deployment forces that work per deployment. The shared directory is the one
thing every replica, the scheduler and ``tpu-offload-fs`` already share, so
the salt lives there, in ``<shared_storage_path>/.tpu-offload-fs-salt``:

* made once by whoever comes first: 32 random bytes written to a temp file
  and published with ``link`` (exclusive: a racing replica gets EEXIST and
  reads the winner's; nobody ever reads a half-written salt file);
* vouched for: the file also holds ``FsAuth.salt_check``, a value only a
  holder of the secret can compute for that salt, so a salt planted by
  someone without the secret (to choose it) or made by another deployment
  (another secret) is refused;
* read without following a symlink, without blocking, as a regular file of
  a few dozen bytes.

When it cannot be made or trusted (a read-only or unwritable root, a file
that is not ours, malformed or vouched for by another secret) the keys come
from the fixed salt (``auth.FIXED_KDF_SALT``), with one warning naming the
file and the cause: the tier keeps working (replicas in the same situation
still share), as strong as without a salt file. The salt is not secret.
Changing it (deleting the file) changes every derived name: existing files
become misses, never errors.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import time

from tpu_offload.core.fs.auth import FsAuth

SALT_FILE = ".tpu-offload-fs-salt"
SALT_BYTES = 32
_HEAD = b"tpu-offload-fs-salt v1 "
_LINE = re.compile(rb"^tpu-offload-fs-salt v1 ([0-9a-f]{64}) ([0-9a-f]{32})\n$")
_SIZE = len(_HEAD) + 2 * SALT_BYTES + 1 + 32 + 1
# A file created in place (no hard links there) may be read before it is written: a short one
# that was just made is read again for up to this long; an old short one is refused at once.
_READ_WAIT_S = 2.0
log = logging.getLogger("tpu_offload.auth")
_warned: set[tuple[str, str]] = set()


class Untrusted(Exception):
    """The salt file exists but cannot be used; the message says why."""


def auth_for_root(secret: bytes, root: str, *, create: bool = True, dir_mode: int = 0o700) -> FsAuth:
    """The ``FsAuth`` of the deployment sharing ``root``: salted with its salt file, made if ``create``.

    ``create`` False (``tpu-offload-fs``): a missing file means the tier there
    never had one (files made with the fixed salt), so the fixed salt is used
    without a word. Every other failure: the fixed salt and one warning.
    """
    path = os.path.join(os.path.abspath(root), SALT_FILE)
    try:
        try:
            return _read(secret, path)
        except FileNotFoundError:
            if not create:
                return FsAuth(secret)
        return _make(secret, path, dir_mode)
    except (OSError, Untrusted) as e:
        why = f"{e.strerror or e}" if isinstance(e, OSError) else str(e)
        if (path, why) not in _warned:
            _warned.add((path, why))
            log.warning("fs tier: the deployment's scrypt salt %s cannot be used (%s); the keys are derived with "
                        "the fixed salt instead (what every deployment without one shares). Replicas that read the "
                        "file use other names: no sharing with them. Fix the cause, or remove the file so that "
                        "the next start makes a new one", path, why)
        return FsAuth(secret)


def _read(secret: bytes, path: str) -> FsAuth:
    deadline = time.monotonic() + _READ_WAIT_S
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Untrusted("not a regular file")
            data = os.read(fd, _SIZE + 1)
        finally:
            os.close(fd)
        m = _LINE.match(data)
        young = time.time() - st.st_mtime < _READ_WAIT_S + 1.0
        if m is None and len(data) < _SIZE and young and time.monotonic() < deadline:
            time.sleep(0.05)  # being written (a filesystem without hard links): wait for the rest
            continue
        break
    if m is None:
        raise Untrusted(f"not a salt file ({len(data)} bytes, expected one line of {_SIZE})")
    auth = FsAuth(secret, bytes.fromhex(m.group(1).decode()))
    if not secrets.compare_digest(auth.salt_check().hex().encode(), m.group(2)):
        raise Untrusted("not vouched for by this secret: made by another deployment sharing the directory "
                        "(another secret), or planted")
    return auth


def _make(secret: bytes, path: str, dir_mode: int) -> FsAuth:
    """A new salt, published only if none is there yet; else the one there (read and checked)."""
    from tpu_offload.core.fs.layout import make_dirs

    make_dirs(os.path.dirname(path), dir_mode)
    auth = FsAuth(secret, secrets.token_bytes(SALT_BYTES))
    line = _HEAD + auth.kdf_salt.hex().encode() + b" " + auth.salt_check().hex().encode() + b"\n"
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            os.fchmod(fd, 0o644)  # not secret; readable by the CLI whoever runs it
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            return auth
        except FileExistsError:
            return _read(secret, path)  # another replica was first: its salt
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                raise
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return _make_in_place(secret, path, auth, line)


def _make_in_place(secret: bytes, path: str, auth: FsAuth, line: bytes) -> FsAuth:
    """No hard links here: create the file itself exclusively and write it in one call."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return _read(secret, path)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return auth
