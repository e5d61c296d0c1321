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
in for another. The root key itself comes from the secret by scrypt
(memory-hard), and only machine-made secrets are accepted (at least 32
random bytes, see ``check_secret``): nothing public is a fast function of
a guessable secret.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
import math
import os
import stat

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAC_BYTES = 32
NAME_BYTES = 20  # file names: 40 hex characters
NS_PREFIX = "kv-"
log = logging.getLogger("tpu_offload.auth")


def _kdf(key: bytes, person: bytes, data: bytes, size: int = 32) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=size, person=person).digest()


class TenantKeys:
    """Name and MAC keys of one (layout, tenant salt) pair."""

    __slots__ = ("_name_key", "_mac_key", "enc_key", "gmac_key", "_aead", "_gmac", "_head_key", "salt_id")

    def __init__(self, name_key: bytes, mac_key: bytes, enc_key: bytes, gmac_key: bytes = b"",
                 head_key: bytes = b"", salt_id: bytes = bytes(8)):
        self._name_key, self._mac_key, self.enc_key, self.gmac_key = name_key, mac_key, enc_key, gmac_key
        self._head_key, self.salt_id = head_key, salt_id
        self._aead = self._gmac = None

    def head_mac(self, header: memoryview) -> bytes:
        """HMAC-SHA256 of a header's leading bytes under the namespace's header key (salt-free).

        What ``tpu-offload-fs`` checks with the secret alone: it proves one of
        our writers made this header (name, layout tag, length, checksum), so
        another tenant's files are never counted or deleted, without reading
        payloads. The payload's own MAC still decides what is served.
        """
        return hmac.new(self._head_key, header, "sha256").digest()

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


# scrypt's cost for the root key: 32 MiB and ~0.1 s once per process and secret, so that nothing
# public (a ``kv-<tag>`` name, a header MAC) lets anyone test guesses of the secret at hash speed.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
# The salt when no deployment salt is known (``kdfsalt``: a shared directory holds one): snapshots,
# and a tier whose salt file cannot be made or trusted. One constant serves every such deployment.
FIXED_KDF_SALT = b"tpu-offload fs root key v2"


@functools.lru_cache(maxsize=8)
def _root_key(secret: bytes, salt: bytes = FIXED_KDF_SALT) -> bytes:
    return hashlib.scrypt(secret, salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          maxmem=2 * 128 * SCRYPT_N * SCRYPT_R + (1 << 20), dklen=64)


class FsAuth:
    """The root of every derived key; holds no copy of the secret itself.

    The root key comes from the secret by scrypt (memory-hard, derived once
    per process) salted with ``kdf_salt``: the deployment's own random salt
    (``kdfsalt.auth_for_root``, from the shared directory) so that no
    dictionary computed once serves every deployment, else a fixed one.
    Every other key, name and tag is a fast keyed hash of the root key,
    never of the secret itself.
    """

    def __init__(self, secret: bytes, kdf_salt: bytes = FIXED_KDF_SALT):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"fs secret must be at least {MIN_SECRET_BYTES} bytes")
        self.kdf_salt = bytes(kdf_salt)
        self._root = _root_key(bytes(secret), self.kdf_salt)

    def salt_check(self) -> bytes:
        """16 bytes only a holder of the secret can compute for this salt: what vouches for a salt file."""
        return _kdf(self._root, b"tpuoff-saltfile", self.kdf_salt, 16)

    def layout_tag(self, layout_digest: bytes) -> bytes:
        """16 bytes standing for the layout in names and headers; reveals nothing without the secret."""
        return _kdf(self._root, b"tpuoff-layout", layout_digest, 16)

    def namespace(self, layout_digest: bytes) -> str:
        return NS_PREFIX + self.layout_tag(layout_digest).hex()

    def tenant(self, layout_digest: bytes, salt: bytes = b"") -> TenantKeys:
        """Keys of one tenant salt within one layout (``b""``: the deployment's own)."""
        return self.tenant_of_tag(self.layout_tag(layout_digest), salt)

    def head_key(self, tag: bytes) -> bytes:
        """The header-MAC key of one namespace (its layout tag): the same for every tenant salt."""
        return _kdf(self._root, b"tpuoff-headkey", bytes(tag))

    def salt_id(self, tag: bytes, salt: bytes) -> bytes:
        """8 bytes naming a tenant salt in headers: reveals nothing without the secret."""
        return _kdf(self.head_key(tag), b"tpuoff-saltid", bytes(salt), 8)

    def tenant_of_tag(self, tag: bytes, salt: bytes = b"") -> TenantKeys:
        """Tenant keys from a namespace's layout tag (its name): what the CLI can derive with the secret."""
        base = _kdf(self._root, b"tpuoff-tenant2", bytes(tag) + b"\0" + bytes(salt), 64)
        return TenantKeys(_kdf(base, b"tpuoff-namekey", b""), _kdf(base, b"tpuoff-mackey", b""),
                          _kdf(base, b"tpuoff-enckey", b""), _kdf(base, b"tpuoff-gmackey", b""),
                          self.head_key(tag), self.salt_id(tag, salt))

    def index_mac(self, body: bytes) -> str:
        """MAC of a snapshot index (hex)."""
        return _kdf(self._root, b"tpuoff-snapshot", body).hex()

    def row_mac(self, context: bytes, views) -> str:
        """HMAC-SHA256 (hex) of one snapshot row's bytes, bound to ``context`` (what the row stands for).

        Why per row and keyed: an index MAC over xxh3 sums does not protect
        the data (xxh3 is not a MAC: a row can be rewritten keeping its xxh3),
        so each row carries its own MAC and a restore drops every row that fails.
        """
        h = hmac.new(_kdf(self._root, b"tpuoff-snaprow", b""), digestmod="sha256")
        h.update(len(context).to_bytes(4, "little") + bytes(context))
        for v in views:
            h.update(v)
        return h.hexdigest()


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped); ValueError(allowed) otherwise.

    Kept only if nobody but us (or root) could have put it there, checked
    as OpenSSH's StrictModes does (``check_secret_path``): every directory
    on the way and every symlink followed is root's or ours, and a directory
    group or others can write has the sticky bit; the file is a regular file
    of sane size that only its owner (us or root) can write. Opened without
    blocking. A secret that group or others can read is accepted with a
    warning, except in a Kubernetes Secret mount (files 0644 or 0640 by
    design): a ``..data`` entry on the path owned by the secret's own owner,
    us or root (one made by anyone else proves nothing: any uid can create
    ``..data`` in a sticky directory such as ``/tmp``).
    """
    real, mount_owners = check_secret_path(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"a readable file holding {HOW_TO_MAKE} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"a regular file of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
        if st.st_mode & 0o022:
            raise ValueError(f"a file only its owner can write (this one is mode {stat.S_IMODE(st.st_mode):04o}: "
                             "group- or world-writable, so another user could replace the secret; chmod 600 it)")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"a file owned by this user ({os.geteuid()}) or root (this one is owned by uid "
                             f"{st.st_uid}, who could replace the secret)")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    via_secret_mount = st.st_uid in mount_owners and st.st_uid in (os.geteuid(), 0)
    if st.st_mode & 0o044 and not via_secret_mount:
        who = "world" if st.st_mode & 0o004 else "group"
        log.warning("fs secret file %s is %s-readable (mode %04o): %s on this host can read the key of the "
                    "shared tier; chmod 600 it", path, who, stat.S_IMODE(st.st_mode),
                    "any user" if who == "world" else "every member of its group")
    return check_secret(data)


def _safe_dir(st: os.stat_result, where: str) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise ValueError(f"a secret file reached only through directories owned by this user or root ({where} "
                         f"is owned by uid {st.st_uid}, who could swap the secret)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ValueError(f"a secret file reached only through directories that group and others cannot write, or "
                         f"that have the sticky bit ({where} is mode {stat.S_IMODE(st.st_mode):04o}: another user "
                         f"could swap the secret)")


def check_secret_path(path: str) -> tuple[str, frozenset[int]]:
    """Walk ``path`` as OpenSSH's StrictModes does; (the real path, the owners of the ``..data`` entries on it).

    Every directory from ``/`` down is root's or ours, and if group or others
    can write it, it has the sticky bit (``/tmp``); every symlink followed is
    root's or ours (Kubernetes mounts a Secret as root-owned ``..data``
    links: those pass). A ``..data`` entry (followed, or beside a directory
    on the way) marks a Kubernetes Secret mount; its owner is returned so the
    caller can require it to be the secret's. ValueError says which
    component failed.
    """
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    parts = [p for p in path.split(os.sep) if p]
    cur = os.sep
    try:
        _safe_dir(os.lstat(cur), cur)
    except OSError as e:
        raise ValueError(f"a readable file holding {HOW_TO_MAKE} ({e.strerror})") from None
    hops = 0
    mount_owners: set[int] = set()
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur) or os.sep
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except OSError as e:
            raise ValueError(f"a readable file holding {HOW_TO_MAKE} ({nxt}: {e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                raise ValueError(f"a secret file path without a symlink loop ({path})")
            if st.st_uid not in (os.geteuid(), 0):
                raise ValueError(f"a secret file reached only through symlinks owned by this user or root ({nxt} is "
                                 f"a symlink owned by uid {st.st_uid}, who could point it at a secret of theirs)")
            if name == "..data":
                mount_owners.add(st.st_uid)  # Kubernetes' atomic writer: a root-owned ..data link in a Secret volume
            target = os.readlink(nxt)
            parts = [p for p in target.split(os.sep) if p] + parts
            if target.startswith(os.sep):
                cur = os.sep
            continue
        if parts:  # a directory on the way
            if not stat.S_ISDIR(st.st_mode):
                raise ValueError(f"a readable file holding {HOW_TO_MAKE} ({nxt} is not a directory)")
            _safe_dir(st, nxt)
            try:
                mount_owners.add(os.lstat(os.path.join(nxt, "..data")).st_uid)
            except OSError:
                pass
        cur = nxt
    return cur, frozenset(mount_owners)


def make_secret_file(path: str) -> bytes:
    """Write a fresh secret (32 random bytes, base64) to a new file of mode 0600; returns it.

    What ``tpu-offload-fs make-secret`` does, and the same as
    ``head -c 32 /dev/urandom | base64 > path; chmod 600 path``.
    """
    import base64

    data = base64.b64encode(os.urandom(32))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data + b"\n")
    finally:
        os.close(fd)
    return data


MIN_SECRET_BITS = 128
HOW_TO_MAKE = "32 random bytes, e.g. `head -c 32 /dev/urandom | base64`"


_ALPHABETS = (  # (characters, size): the smallest one a secret fits in sets its bits per character
    (frozenset(b"0123456789"), 10),
    (frozenset(b"0123456789abcdef"), 16), (frozenset(b"0123456789ABCDEF"), 16),
    (frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567="), 32), (frozenset(b"abcdefghijklmnopqrstuvwxyz234567="), 32),
    (frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_"), 64),
    (frozenset(range(32, 127)), 95),
)


def _alphabet_bits(data: bytes) -> float:
    chars = set(data)
    return math.log2(next((n for a, n in _ALPHABETS if chars <= a), 256))


def secret_weakness(data: bytes) -> str | None:
    """Why ``data`` is a guessable secret (an estimate below 128 bits), or None.

    An estimate, not a proof: bits per character of the smallest usual
    alphabet it fits (digits, hex, base32, base64, printable, bytes) times
    its length, not counting characters a run predicts (``aaaaa``,
    ``01234``: all but the first two of a run of 5 or more); and refused
    outright when it shows a pattern a person types (fewer than 8 distinct
    characters, one character a third of it, a repeated block). 32 random
    bytes (256 bits) are recommended: a 16-byte key sits on the threshold.
    """
    n = len(data)
    predictable, run = 0, 1
    for i in range(1, n + 1):
        step = data[i] - data[i - 1] if i < n else None
        if i < n and step in (-1, 0, 1) and (run == 1 or step == data[i - 1] - data[i - 2]):
            run += 1
            continue
        if run >= 5:
            predictable += run - 2
        run = 2 if i < n and step in (-1, 0, 1) else 1
    bits = (n - predictable) * _alphabet_bits(data)
    if bits < MIN_SECRET_BITS:
        return f"about {bits:.0f} bits for its length and alphabet" + (
            f", {predictable} characters of it runs like aaaaa or 01234" if predictable else "")
    distinct = len(set(data))
    if distinct < 8:
        return f"only {distinct} distinct characters"
    top = max(data.count(bytes([c])) for c in set(data))
    if top > max(3, n // 3):
        return f"one character makes up {top} of its {n}"
    for p in range(1, n // 2 + 1):
        if data[p:] == data[:-p]:
            return f"a block of {p} characters repeated"
    return None


MIN_RANDOM_BYTES = 32


def _decode(text: bytes) -> bytes | None:
    """The bytes a text secret stands for: hex or base64 (standard or URL-safe, padded or not); else None."""
    if len(text) % 2 == 0 and all(c in b"0123456789abcdefABCDEF" for c in text):
        return bytes.fromhex(text.decode())
    t = text.rstrip(b"=")
    alt = b"-_" if (b"-" in t or b"_" in t) else b"+/"
    if not t or not all(c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789" + alt for c in t):
        return None
    try:
        return base64.b64decode(t + b"=" * (-len(t) % 4), altchars=alt, validate=True)
    except (binascii.Error, ValueError):
        return None


def secret_doubt(data: bytes) -> str | None:
    """Why ``data`` (stripped) does not look machine-made, or None.

    The rule: a secret is at least 32 random bytes (256 bits). Text must be
    hex or base64 of them (``head -c 32 /dev/urandom | base64``, or
    ``openssl rand -hex 32``); raw bytes are taken as they are. A phrase, a
    word, a machine-id (16 bytes of hex) or anything shorter is refused.
    Then a plausibility check that random bytes pass with overwhelming
    probability: base64 text has both letter cases, hex text both digits
    and letters, the decoded bytes are not themselves text and hold at least 60% of the distinct values
    random bytes of that length would (30 of 32 on average), and the text
    shows no pattern a person types (``secret_weakness``).
    """
    text = _is_text(data)
    raw = _decode(data) if text else bytes(data)
    if raw is None:
        return ("text that is neither hex nor base64 (a phrase or a password, not machine-made)")
    if len(raw) < MIN_RANDOM_BYTES:
        return f"{len(raw)} bytes after decoding, fewer than {MIN_RANDOM_BYTES}"
    if text:
        is_hex = len(data) % 2 == 0 and all(c in b"0123456789abcdefABCDEF" for c in data)
        if is_hex and not (any(c in b"0123456789" for c in data) and any(c in b"abcdefABCDEF" for c in data)):
            return "hex with only digits or only letters"
        if not is_hex and not (any(65 <= c <= 90 for c in data) and any(97 <= c <= 122 for c in data)):
            return "base64 with only one letter case"
    if text and _is_text(raw):
        return "the encoding of text (a phrase), not of random bytes"
    expected = 256 * (1 - (255 / 256) ** len(raw))
    if len(set(raw)) < 0.6 * expected:
        return f"only {len(set(raw))} distinct byte values in {len(raw)} bytes"
    weak = secret_weakness(data)
    return None if weak is None else f"it is guessable: {weak}"


def _is_text(data: bytes) -> bool:
    return all(32 <= c < 127 for c in data)


def check_secret(data: bytes) -> bytes:
    """``data`` if it is a machine-made secret (``secret_doubt``); ValueError(allowed) otherwise.

    Text is stripped of surrounding whitespace (a trailing newline); raw
    bytes are kept as they are (a random byte may be a space).
    """
    stripped = bytes(data).strip()
    data = stripped if _is_text(stripped) else bytes(data)
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ValueError(f"a machine-made secret of at least {MIN_RANDOM_BYTES} random bytes "
                         f"(got {len(data)} bytes; use {HOW_TO_MAKE})")
    doubt = secret_doubt(data)
    if doubt is not None:
        raise ValueError(f"a machine-made secret of at least {MIN_RANDOM_BYTES} random bytes, as base64 or hex "
                         f"(this one is not: {doubt}; use {HOW_TO_MAKE})")
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
