"""What ``tpu-offload-fs`` knows with the secret: which files are ours.

Why: if "ours" meant "starts with the 8 public magic bytes", another
tenant's magic-prefixed junk would be counted against our budget and kept,
while ``evict`` deleted our chunks (or a file of that tenant). With the
secret the CLI derives, from a keyed namespace's name alone (``kv-<tag>``),
the header key every writer of that namespace signs headers with (salt-free,
``FsAuth.head_key``): a file is ours only if its header MAC verifies, its
layout tag is the namespace's and its key field is its own name. That costs
one 4 KiB read per file. ``verify`` also checks the payload MAC, with the
tenant keys of the salts it was given (the deployment's own, ``b""``,
always): a header whose salt id names a salt not given is reported
unverified, not forged.
"""

from __future__ import annotations

import functools
import hmac
import os
import string

from tpu_offload.core.fs import kdfsalt, safedir
from tpu_offload.core.fs.auth import NS_PREFIX, FsAuth, TenantKeys
from tpu_offload.core.fs.format import FLAG_HEAD, HEAD_MAC_OFF, HEADER_SIZE, MAGIC, Header, HeaderError, parse_header

_HEX = frozenset(string.hexdigits.lower())


def keyed_tag(namespace: str) -> bytes | None:
    """The layout tag of a keyed namespace name (``kv-`` + 32 hex digits, maybe ``.salt`` suffixed); else None."""
    if not namespace.startswith(NS_PREFIX):
        return None
    h = namespace[len(NS_PREFIX):]
    if len(h) != 32 or not set(h) <= _HEX:
        return None
    return bytes.fromhex(h)


class Keyring:
    """The secret's keys as the tier derives them in one shared directory (``at(root)``).

    The root key is salted per deployment (``kdfsalt``: the salt file in the
    shared directory), so the keys depend on the directory: ``admin`` binds
    the keyring to the root it works on before judging any file. Unbound, the
    fixed salt is used (a tier that had no salt file).
    """

    def __init__(self, secret: bytes, salts: tuple[bytes, ...] = (), root: str | None = None):
        self._secret = bytes(secret)
        self.root = None if root is None else os.path.abspath(root)
        self._auth: FsAuth | None = None  # derived on first use (scrypt: ~0.1 s), once bound to a root
        self.salts = tuple(dict.fromkeys((b"", *map(bytes, salts))))

    @property
    def auth(self) -> FsAuth:
        if self._auth is None:
            self._auth = (FsAuth(self._secret) if self.root is None
                          else kdfsalt.auth_for_root(self._secret, self.root, create=False))
        return self._auth

    def at(self, root: str) -> "Keyring":
        """This keyring with the keys of the deployment sharing ``root`` (its salt file; never creates one)."""
        if self.root == os.path.abspath(root):
            return self
        return Keyring(self._secret, self.salts, root)

    @functools.lru_cache(maxsize=256)
    def _head_key(self, tag: bytes) -> bytes:
        return self.auth.head_key(tag)

    @functools.lru_cache(maxsize=256)
    def _tenants(self, tag: bytes) -> dict[bytes, TenantKeys]:
        """Salt id -> tenant keys, for every salt we were given."""
        out = {}
        for salt in self.salts:
            tk = self.auth.tenant_of_tag(tag, salt)
            out[tk.salt_id] = tk
        return out

    def header(self, hdr: bytes, tag: bytes, name: str | None) -> Header | None:
        """The parsed header if one of our writers signed it for this namespace and file name; else None."""
        if len(hdr) < HEADER_SIZE or hdr[: len(MAGIC)] != MAGIC:
            return None
        try:
            h = parse_header(hdr)
        except HeaderError:
            return None
        if not h.flags & FLAG_HEAD or h.digest != tag or (name is not None and h.key.hex() != name):
            return None
        want = hmac.new(self._head_key(tag), memoryview(hdr)[:HEAD_MAC_OFF], "sha256").digest()
        return h if hmac.compare_digest(want, h.head_mac) else None

    def tenant(self, tag: bytes, salt_id: bytes) -> TenantKeys | None:
        """The keys of the salt ``salt_id`` names, if it is one we were given."""
        return self._tenants(tag).get(salt_id)

    def owned_bytes(self, d: int, name: str, tag: bytes, check_name: str | None) -> int | None:
        """Bytes an authenticated file of ours counts for (allocated, capped at its size), or None."""
        try:
            fd, st = safedir.open_regular(name, d)
        except OSError:
            return None
        try:
            if st.st_nlink != 1:  # a hard link also lives elsewhere: not ours
                return None
            hdr = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        h = self.header(hdr, tag, check_name)
        if h is None:
            return None
        return min(st.st_blocks * 512, h.file_size, st.st_size)
