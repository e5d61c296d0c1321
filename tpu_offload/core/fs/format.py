"""The on-disk chunk file: one fixed 4 KiB header, then the payload.

The header is a full page so the payload starts page-aligned and the same
file works with and without ``O_DIRECT``. It carries everything a reader
needs to refuse bytes that are not exactly the chunk it asked for: magic,
format version, layout digest, the key itself, payload length and an xxh3-64
checksum of the payload; its own xxh3-64 protects those fields. No pickle,
no JSON: a fixed little-endian struct any language can parse.

Layout of the header (little-endian)::

    0   8s  magic  b"TPUOFFKV"
    8   H   format version
    10  H   header size (4096)
    12  I   flags: 1 = HMAC present, 2 = payload AES-256-GCM encrypted, 4 = GMAC present
            (2 and 4: nonce and tag in the MAC field)
    16  16s layout fingerprint digest (with a secret: a keyed tag of it)
    32  Q   payload length in bytes
    40  Q   xxh3-64 of the payload
    48  H   key length
    50  ..  key bytes (with a secret: the keyed file id), zero padding
    4016 8s  keyed id of the tenant salt (flag 8; else zero)
    4024 32s HMAC-SHA256 of bytes [0, 4024) under the namespace's header key (flag 8; else zero):
             lets ``tpu-offload-fs`` tell our files from forgeries with the secret alone (no salt,
             no layout), without reading payloads
    4056 32s HMAC-SHA256 of bytes [0, 4056) and the payload (flag 1; else zero)
    4088 Q  xxh3-64 of bytes [0, 4088)

The xxh3 checksums catch damage; only the MAC (``auth``) says who wrote it.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable

import xxhash

MAGIC = b"TPUOFFKV"
VERSION = 1
HEADER_SIZE = 4096
MAX_KEY_BYTES = 120  # the file name is the key's hex: keep it under NAME_MAX

_FIXED = struct.Struct("<8sHHI16sQQH")
_KEY_OFF = _FIXED.size
_HCHK = struct.Struct("<Q")
_HCHK_OFF = HEADER_SIZE - _HCHK.size
MAC_BYTES = 32
MAC_OFF = _HCHK_OFF - MAC_BYTES  # the MAC covers every header byte before it
FLAG_MAC = 1
FLAG_AEAD = 2
FLAG_GMAC = 4
FLAG_HEAD = 8  # salt id and header MAC present
HEAD_MAC_OFF = MAC_OFF - MAC_BYTES
SALT_ID_BYTES = 8
SALT_ID_OFF = HEAD_MAC_OFF - SALT_ID_BYTES
NONCE_BYTES, TAG_BYTES = 12, 16  # AES-GCM, stored at MAC_OFF


def aead_aad(digest: bytes, key: bytes, payload_len: int) -> bytes:
    """What an encrypted chunk's tag also covers: every header field but the (ciphertext) checksum."""
    return _FIXED.pack(MAGIC, VERSION, HEADER_SIZE, FLAG_AEAD, digest, payload_len, 0, len(key)) + key
_VERSION_AT = struct.Struct("<H")
_ZERO = bytes(HEADER_SIZE)


class HeaderError(ValueError):
    """A header we must not trust; ``reason`` names the check that failed."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    digest: bytes
    key: bytes
    payload_len: int
    checksum: int
    flags: int = 0
    mac: bytes = b""
    salt_id: bytes = b""  # FLAG_HEAD
    head_mac: bytes = b""  # FLAG_HEAD: over bytes [0, HEAD_MAC_OFF)

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.payload_len


def payload_checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def pack_header(buf, digest: bytes, key: bytes, payload_len: int, checksum: int,
                seal: Callable[[memoryview], bytes] | None = None, flags: int | None = None,
                head=None) -> None:
    """Fill ``buf`` (a writable 4096-byte buffer, e.g. an aligned numpy row).

    ``seal(header[:MAC_OFF])`` returns the MAC (it also covers the payload);
    with it the MAC flag is set. ``head`` (tenant keys: ``salt_id`` and
    ``head_mac``) adds the salt id and the header MAC, before the seal.
    """
    if len(key) > MAX_KEY_BYTES or not key:
        raise ValueError(f"key of {len(key)} bytes; allowed 1..{MAX_KEY_BYTES}")
    if len(digest) != 16:
        raise ValueError("layout digest must be 16 bytes")
    mv = memoryview(buf).cast("B")
    if len(mv) != HEADER_SIZE:
        raise ValueError(f"header buffer must be {HEADER_SIZE} bytes, got {len(mv)}")
    mv[:] = _ZERO
    if flags is None:
        flags = FLAG_MAC if seal is not None else 0
    if head is not None:
        flags |= FLAG_HEAD
    _FIXED.pack_into(mv, 0, MAGIC, VERSION, HEADER_SIZE, flags, digest, payload_len, checksum, len(key))
    mv[_KEY_OFF : _KEY_OFF + len(key)] = key
    if head is not None:
        mv[SALT_ID_OFF:HEAD_MAC_OFF] = head.salt_id
        mv[HEAD_MAC_OFF:MAC_OFF] = head.head_mac(mv[:HEAD_MAC_OFF])
    if seal is not None:
        tag = seal(mv[:MAC_OFF])
        if len(tag) != MAC_BYTES:
            raise ValueError(f"MAC of {len(tag)} bytes; the header holds {MAC_BYTES}")
        mv[MAC_OFF:_HCHK_OFF] = tag
    _HCHK.pack_into(mv, _HCHK_OFF, xxhash.xxh3_64_intdigest(mv[:_HCHK_OFF]))


def has_magic(buf) -> bool:
    return bytes(memoryview(buf).cast("B")[: len(MAGIC)]) == MAGIC


def parse_header(buf) -> Header:
    """Decode and self-check a header; raise ``HeaderError`` on anything odd.

    Version is checked before the header checksum: another version may lay
    out (and checksum) its header differently, and "foreign version" is the
    more useful diagnosis than "corrupt".
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE:
        raise HeaderError("truncated", f"header has {len(mv)} of {HEADER_SIZE} bytes")
    if bytes(mv[: len(MAGIC)]) != MAGIC:
        raise HeaderError("magic", "not a tpu-offload chunk file")
    (version,) = _VERSION_AT.unpack_from(mv, len(MAGIC))
    if version != VERSION:
        raise HeaderError("version", f"format version {version}, this reader knows {VERSION}")
    (hchk,) = _HCHK.unpack_from(mv, _HCHK_OFF)
    if xxhash.xxh3_64_intdigest(mv[:_HCHK_OFF]) != hchk:
        raise HeaderError("header_checksum", "header bytes do not match their checksum")
    _, _, hsize, flags, digest, plen, chk, klen = _FIXED.unpack_from(mv, 0)
    if hsize != HEADER_SIZE or klen == 0 or klen > MAX_KEY_BYTES:
        raise HeaderError("header", f"header size {hsize}, key length {klen}")
    key = bytes(mv[_KEY_OFF : _KEY_OFF + klen])
    head = flags & FLAG_HEAD
    return Header(version=version, digest=digest, key=key, payload_len=plen, checksum=chk, flags=flags,
                  mac=bytes(mv[MAC_OFF:_HCHK_OFF]) if flags & (FLAG_MAC | FLAG_AEAD | FLAG_GMAC) else b"",
                  salt_id=bytes(mv[SALT_ID_OFF:HEAD_MAC_OFF]) if head else b"",
                  head_mac=bytes(mv[HEAD_MAC_OFF:MAC_OFF]) if head else b"")


def check_header(h: Header, digest: bytes, key: bytes, payload_len: int) -> str | None:
    """Reason the header is not the one a reader of (digest, key, length) wants."""
    if h.digest != digest:
        return "layout"
    if h.key != key:
        return "key"
    if h.payload_len != payload_len:
        return "length"
    return None
