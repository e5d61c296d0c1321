"""Keys derived from the operator's secret: file names, layout tags and chunk MACs.

Why: the shared directory is a trust boundary. Without a secret a chunk
file's header is public (magic, layout digest, key, xxh3 checksums), so any
tenant with write access can publish KV of its choice under another
tenant's key, and a directory listing names the chained token hashes of
every cached prompt. With a secret (``fs_secret_file`` or
``TPU_OFFLOAD_FS_SECRET``, never in a config JSON):

* every file carries an HMAC-SHA256 over its header and payload (twice
  keyed BLAKE2b's speed where the CPU has SHA extensions: 1.8 vs 0.9 GB/s
  per core on the benchmark VM);
  a file that fails it is a miss, counted on its own, never served;
* namespace names, the layout tag in headers and file names are keyed
  hashes, so a listing (or a header) says nothing about the model, the
  layout or the tokens without the secret; replicas with the same secret
  derive the same names and still share;
* the keys are per tenant: derived from the secret, the layout and a tenant
  salt, so chunks of one salt do not verify under another's key.

Every key comes from one root key by keyed BLAKE2b with a distinct
personalisation string (domain separation), so no derived value can stand
in for another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAC_BYTES = 32
NAME_BYTES = 20  # file names: 40 hex characters
NS_PREFIX = "kv-"


def _kdf(key: bytes, person: bytes, data: bytes, size: int = 32) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=size, person=person).digest()


class TenantKeys:
    """Name and MAC keys of one (layout, tenant salt) pair."""

    __slots__ = ("_name_key", "_mac_key", "enc_key", "gmac_key", "_aead", "_gmac")

    def __init__(self, name_key: bytes, mac_key: bytes, enc_key: bytes, gmac_key: bytes = b""):
        self._name_key, self._mac_key, self.enc_key, self.gmac_key = name_key, mac_key, enc_key, gmac_key
        self._aead = self._gmac = None

    def gmac(self, header: memoryview, payload: memoryview, nonce: bytes) -> bytes:
        """16-byte AES-GCM tag over the payload (as associated data) and the header (as plaintext).

        Several times HMAC-SHA256's speed with AES-NI and carry-less
        multiply (``fs_mac: gmac``); safe while nonces never repeat under a
        key (random 96-bit ones: far beyond 2**32 files per tenant).
        """
        if self._gmac is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._gmac = AESGCM(self.gmac_key)
        return self._gmac.encrypt(nonce, bytes(header), payload)[-16:]

    def gmac_ok(self, header: memoryview, payload: memoryview, nonce: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.gmac(header, payload, nonce), bytes(tag))

    def aead(self):
        """AES-256-GCM with this tenant's key (``cryptography``, imported only when encryption is used)."""
        if self._aead is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self.enc_key)
        return self._aead

    def file_id(self, key: bytes) -> bytes:
        """The chunk's on-disk identity: its name (hex) and the key field of its header."""
        return _kdf(self._name_key, b"tpuoff-name", bytes(key), NAME_BYTES)

    def mac(self, header: memoryview, payload: memoryview) -> bytes:
        h = hmac.new(self._mac_key, digestmod="sha256")  # OpenSSL's HMAC: SHA-NI where the CPU has it
        h.update(header)
        h.update(payload)  # released GIL for large buffers
        return h.digest()

    def mac_ok(self, header: memoryview, payload: memoryview, tag: bytes) -> bool:
        return hmac.compare_digest(self.mac(header, payload), bytes(tag))


class FsAuth:
    """The root of every derived key; holds no copy of the secret itself."""

    def __init__(self, secret: bytes):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"fs secret must be at least {MIN_SECRET_BYTES} bytes")
        self._root = hashlib.blake2b(bytes(secret), digest_size=64, person=b"tpuoff-root-v1").digest()

    def layout_tag(self, layout_digest: bytes) -> bytes:
        """16 bytes standing for the layout in names and headers; reveals nothing without the secret."""
        return _kdf(self._root, b"tpuoff-layout", layout_digest, 16)

    def namespace(self, layout_digest: bytes) -> str:
        return NS_PREFIX + self.layout_tag(layout_digest).hex()

    def tenant(self, layout_digest: bytes, salt: bytes = b"") -> TenantKeys:
        """Keys of one tenant salt within one layout (``b""``: the deployment's own)."""
        base = _kdf(self._root, b"tpuoff-tenant", layout_digest + b"\0" + bytes(salt), 64)
        return TenantKeys(_kdf(base, b"tpuoff-namekey", b""), _kdf(base, b"tpuoff-mackey", b""),
                          _kdf(base, b"tpuoff-enckey", b""), _kdf(base, b"tpuoff-gmackey", b""))

    def index_mac(self, body: bytes) -> str:
        """MAC of a snapshot index (hex)."""
        return _kdf(self._root, b"tpuoff-snapshot", body).hex()


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped); ValueError(allowed) otherwise.

    Followed if a symlink (Kubernetes mounts Secrets through symlinks), but
    opened without blocking and kept only if a regular file of sane size.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"a readable file holding at least {MIN_SECRET_BYTES} bytes ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"a regular file of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return check_secret(data)


def check_secret(data: bytes) -> bytes:
    data = bytes(data).strip()
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ValueError(f"a secret of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes "
                         f"(got {len(data)}; e.g. `openssl rand -hex 32`)")
    return data


class Names:
    """Where one layout's chunk files live and what each is called, with or without a secret.

    Shared by the tier and the read-only lookups (scheduler side), so both
    always agree on names. Without a secret: ``<model>-<layout digest>`` and
    the key's hex, as before. With one: ``kv-<keyed layout tag>`` and the
    keyed file id's hex.
    """

    def __init__(self, root: str, fingerprint, auth: FsAuth | None = None):
        self.auth = auth
        self._layout = fingerprint.digest()
        if auth is None:
            self.namespace, self.digest = fingerprint.namespace(), self._layout
        else:
            self.namespace, self.digest = auth.namespace(self._layout), auth.layout_tag(self._layout)
        self.ns_dir = os.path.join(os.path.abspath(root), self.namespace)
        self._tenants: dict[bytes, TenantKeys] = {}

    def keys(self, salt: bytes = b"") -> TenantKeys | None:
        if self.auth is None:
            return None
        k = self._tenants.get(salt)
        if k is None:
            if len(self._tenants) > 4096:  # salts are per request: bound the cache
                self._tenants.clear()
            k = self._tenants[salt] = self.auth.tenant(self._layout, salt)
        return k

    def file_id(self, key: bytes, salt: bytes = b"") -> bytes:
        from tpu_offload.core.fs.layout import key_hex

        key_hex(key)  # validates the key
        k = self.keys(salt)
        return bytes(key) if k is None else k.file_id(key)
