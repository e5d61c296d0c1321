"""Warm restart of the host tier: save the ready chunks at shutdown, load at start.

Format: a directory with ``chunks.npy`` (a standard ``.npy`` of shape
``[n, chunk_bytes]`` uint8, rows in LRU order, least recent first) and
``index.json`` (format, version, layout fingerprint and its digest, chunk
size, key hex, original slot and xxh3-64 per row, plus an xxh3-64 of the
index itself; with a secret also a keyed HMAC-SHA256 per row over the
layout digest, the key and the row's bytes, and a MAC of the index). It is
published by renaming a fully written temp directory.

Why not orbax: orbax-checkpoint imports jax, and this core is shared with
the torch (GPU) backend whose installs have no jax; the host slab is a plain
numpy array anyway, so ``.npy`` + JSON is as portable and needs nothing
more. Rows are streamed from and into slot views, so neither save nor
restore holds a second copy of the slab.

The snapshot directory may sit on a shared volume, so restore trusts
nothing in it: the index and the data are opened like chunks (no symlink
followed, never blocking on a FIFO, regular files only), ``data`` must be
a bare file name inside the directory, every field is type- and
range-checked (anything malformed is a cold start with one warning, never
an exception), and with a secret the index carries a keyed MAC
(``index_mac``) that must verify, and every row its own MAC (``macs``): a
row whose bytes changed under an intact index (even keeping its xxh3) is
dropped and counted (``RestoreStats``), the rest are served.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import stat

import numpy as np
import xxhash

from tpu_offload.core.fs import safedir
from tpu_offload.core.fs.auth import FsAuth
from tpu_offload.core.fs.fileio import read_all
from tpu_offload.core.fs.format import MAX_KEY_BYTES
from tpu_offload.core.fs.layout import DIR_MODE, FILE_MODE, make_dirs
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Medium
from tpu_offload.core.pool import HostChunkPool

log = logging.getLogger("tpu_offload.fs")


MAX_JSON_BYTES = 1 << 30


def open_safe(file: str) -> int:
    """fd of a regular file at ``file``: its last component never followed if a symlink, a FIFO never waited on.

    Raises FileNotFoundError, ``safedir.NotRegular`` or OSError.
    """
    parent, name = os.path.split(os.path.abspath(file))
    d = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: may hold symlinks
    try:
        return safedir.open_regular(name, d)[0]
    finally:
        os.close(d)


def read_json(file: str, what: str) -> dict | None:
    """A snapshot's JSON, or None: absent is a cold start; a symlink, FIFO, huge or unreadable file one warning."""
    try:
        fd = open_safe(file)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("%s %s unreadable (%s); starting cold", what, file, e)
        return None
    try:
        with open(fd, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        return json.loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        log.warning("%s %s unreadable (%s); starting cold", what, file, e)
        return None

class SnapshotPathError(ValueError):
    """The snapshot path holds something that is not ours to replace."""


def check_replaceable(path: str, is_ours=None) -> None:
    """Refuse to publish over anything but nothing, an empty directory, or our own snapshot.

    ``is_ours(path) -> bool`` recognises a snapshot (default: this module's
    ``index.json`` format). Raises ``SnapshotPathError`` naming what is there.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    what = None
    if stat.S_ISLNK(st.st_mode):
        what = "a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        what = "not a directory"
    else:
        try:
            empty = not os.listdir(path)
        except OSError as e:
            raise SnapshotPathError(f"snapshot path {path!r} cannot be listed ({e.strerror}); "
                                    "allowed: a new path, an empty directory or an earlier snapshot") from None
        if not empty and not (is_ours or _is_host_snapshot)(path):
            what = "a directory that is not a tpu-offload snapshot"
    if what:
        raise SnapshotPathError(
            f"snapshot path {path!r} is {what}; refusing to replace it. Allowed: a new path, an empty "
            "directory or an earlier snapshot written here (remove or move it yourself if it is disposable)"
        )


def is_snapshot_json(file: str, fmt: str) -> bool:
    """Does ``file`` hold a JSON object of format ``fmt``? (quietly: only to recognise our own files)"""
    try:
        with open(open_safe(file), "rb") as f:
            body = json.loads(f.read(MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("format") == fmt


def _is_host_snapshot(path: str) -> bool:
    return is_snapshot_json(os.path.join(path, INDEX), FORMAT)


@dataclasses.dataclass
class RestoreStats:
    """What a restore kept and dropped (rows that failed their MAC or checksum)."""

    restored: int = 0
    dropped: int = 0


def _row_context(fp_digest: str, key_hex: str) -> bytes:
    return f"host-row|{fp_digest}|{key_hex}".encode()


FORMAT = "tpu-offload-host-snapshot"
VERSION = 1
INDEX = "index.json"
DATA = "chunks.npy"


def snapshot_host_tier(
    manager: LRUChunkManager, pool: HostChunkPool, path: str, fingerprint: LayoutFingerprint,
    *, secret: bytes | None = None,
) -> int:
    """Write every ready, valid chunk to ``path``; returns how many were saved.

    With ``secret`` (the file tier's) the index is signed; restore then
    needs the same secret.

    ``path`` must be absent, an empty directory, or a snapshot this code
    wrote: anything else there (a symlink, a file, someone's directory) is
    refused with ``SnapshotPathError`` and left untouched, never replaced.
    """
    path = os.path.abspath(path)
    check_replaceable(path)
    items = [(k, s) for k, s in manager.items_lru_order() if pool.valid[s]]
    cb = pool.chunk_bytes
    parent = os.path.dirname(path)
    make_dirs(parent)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    os.mkdir(tmp, DIR_MODE)
    os.chmod(tmp, DIR_MODE)
    auth = FsAuth(secret) if secret else None
    fp_digest = fingerprint.digest().hex()
    try:
        sums, macs = [], []
        data_path = os.path.join(tmp, DATA)
        with open(data_path, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            np.lib.format.write_array_header_1_0(
                f, {"descr": "|u1", "fortran_order": False, "shape": (len(items), cb)}
            )
            offset = f.tell()
            for k, slot in items:
                row = pool.row(slot)
                sums.append(format(xxhash.xxh3_64_intdigest(row), "016x"))
                if auth is not None:
                    macs.append(auth.row_mac(_row_context(fp_digest, bytes(k).hex()), [memoryview(row)]))
                f.write(memoryview(row))
            f.flush()
            os.fsync(f.fileno())
        index = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": dataclasses.asdict(fingerprint),
            "fingerprint_digest": fingerprint.digest().hex(),
            "chunk_bytes": cb,
            "num_chunks": len(items),
            "data": DATA,
            "data_offset": offset,
            "keys": [bytes(k).hex() for k, _ in items],
            "slots": [int(s) for _, s in items],
            "checksums": sums,
        }
        if auth is not None:
            index["macs"] = macs
        index["index_xxh3"] = _index_digest(index)
        if secret:
            index["index_mac"] = _index_mac(index, secret)
        with open(os.path.join(tmp, INDEX), "w") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        _publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(items)


def restore_host_tier(
    path: str,
    fingerprint: LayoutFingerprint,
    num_slots: int,
    chunk_bytes: int,
    *,
    enable_events: bool = True,
    medium: Medium = Medium.CPU,
    secret: bytes | None = None,
    stats: RestoreStats | None = None,
) -> tuple[LRUChunkManager, HostChunkPool] | None:
    """A manager and pool holding the snapshot's chunks, or None if unusable.

    A snapshot of another layout, chunk size, format or a damaged index is
    refused whole (None, one warning). A row whose checksum (with a secret:
    whose MAC) fails is left out and counted in ``stats``. When the new tier
    is smaller, the most recent chunks are kept.
    """
    index = _load_index(path, fingerprint, chunk_bytes, secret)
    if index is None:
        return None
    keys = [ChunkKey(bytes.fromhex(h)) for h in index["keys"]]
    sums = index["checksums"]
    auth, macs = (FsAuth(secret), index["macs"]) if secret else (None, None)
    fp_digest = fingerprint.digest().hex()
    first = max(0, len(keys) - num_slots)  # drop the least recent that do not fit
    manager = LRUChunkManager(num_slots, chunk_bytes, medium=medium, enable_events=enable_events)
    pool = HostChunkPool(num_slots, chunk_bytes)
    alloc = manager.prepare_store(keys[first:])
    assert alloc is not None and len(alloc.keys) == len(keys) - first  # empty manager, fits
    good, bad = [], []
    offset = index["data_offset"] + first * chunk_bytes
    try:
        fd = open_safe(os.path.join(path, index["data"]))  # a bare name (checked): inside ``path``
        try:
            for i, (key, slot) in enumerate(zip(alloc.keys, alloc.slots), start=first):
                row = pool.row(int(slot))
                n = read_all(fd, [memoryview(row)], offset)
                offset += chunk_bytes
                ok = n == chunk_bytes and format(xxhash.xxh3_64_intdigest(row), "016x") == sums[i]
                if ok and auth is not None:
                    want = auth.row_mac(_row_context(fp_digest, index["keys"][i]), [memoryview(row)])
                    ok = hmac.compare_digest(want, macs[i])
                if ok:
                    pool.valid[slot] = True
                    good.append(key)
                else:
                    bad.append(key)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("host snapshot %s unreadable (%s); starting cold", path, e)
        return None
    manager.complete_store(good, success=True)  # in LRU order: recency is restored
    manager.complete_store(bad, success=False)
    if stats is not None:
        stats.restored, stats.dropped = len(good), len(bad)
    if bad:
        log.warning("host snapshot %s: %d of %d chunks failed their %s and were dropped",
                    path, len(bad), len(alloc.keys), "MAC or checksum" if auth else "checksum")
    return manager, pool


def _load_index(path: str, fingerprint: LayoutFingerprint, chunk_bytes: int,
                secret: bytes | None = None) -> dict | None:
    index = read_json(os.path.join(path, INDEX), "host snapshot index")
    if index is None:
        return None
    try:
        problem = _index_problem(index, fingerprint, chunk_bytes, secret)
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:  # a shape no check foresaw
        problem = f"malformed ({type(e).__name__}: {e})"
    if problem:
        log.warning("host snapshot %s rejected: %s; starting cold", path, problem)
        return None
    return index


_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEY_HEX = re.compile(r"^(?:[0-9a-f]{2}){1,%d}$" % MAX_KEY_BYTES)


def _is_int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _index_problem(index, fingerprint: LayoutFingerprint, chunk_bytes: int, secret: bytes | None) -> str | None:
    """Why the index must not be used, or None. Every field the restore reads is checked here."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return "not a host-tier snapshot"
    if index.get("version") != VERSION:
        return f"format version {index.get('version')!r}, expected {VERSION}"
    if index.get("index_xxh3") != _index_digest(index):
        return "index checksum mismatch"
    if secret:
        mac = index.get("index_mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _index_mac(index, secret)):
            return "index MAC missing or wrong (not signed with this secret)"
    if index.get("fingerprint_digest") != fingerprint.digest().hex():
        return "another model or KV layout (fingerprint differs)"
    if index.get("chunk_bytes") != chunk_bytes:
        return f"chunk size {index.get('chunk_bytes')!r}, expected {chunk_bytes}"
    data = index.get("data")
    if not isinstance(data, str) or data in ("", ".", "..") or os.sep in data or "\0" in data \
            or (os.altsep and os.altsep in data):
        return f"data {data!r} is not a bare file name inside the snapshot directory"
    keys, sums, slots, n = index.get("keys"), index.get("checksums"), index.get("slots"), index.get("num_chunks")
    if not (_is_int(n) and isinstance(keys, list) and isinstance(sums, list) and isinstance(slots, list)
            and len(keys) == len(sums) == len(slots) == n):
        return "inconsistent index"
    if not _is_int(index.get("data_offset")):
        return f"data_offset {index.get('data_offset')!r}"
    if not all(isinstance(k, str) and _KEY_HEX.match(k) for k in keys):
        return "a key that is not hex of 1..%d bytes" % MAX_KEY_BYTES
    if len(set(keys)) != len(keys):
        return "a key listed twice"
    if not all(isinstance(c, str) and _HEX16.match(c) for c in sums):
        return "a checksum that is not 16 hex digits"
    if not all(_is_int(s) for s in slots):
        return "a slot that is not an integer >= 0"
    if secret:
        macs = index.get("macs")
        if not (isinstance(macs, list) and len(macs) == n and all(isinstance(m, str) and _HEX64.match(m) for m in macs)):
            return "row MACs missing or malformed (not signed per row with this secret)"
    return None


def _index_digest(index: dict) -> str:
    body = {k: v for k, v in index.items() if k not in ("index_xxh3", "index_mac")}
    return format(xxhash.xxh3_64_intdigest(json.dumps(body, sort_keys=True).encode()), "016x")


def _index_mac(index: dict, secret: bytes) -> str:
    body = {k: v for k, v in index.items() if k != "index_mac"}
    return FsAuth(secret).index_mac(json.dumps(body, sort_keys=True).encode())


def _publish_dir(tmp: str, path: str) -> None:
    """Swap ``tmp`` in at ``path``; an old snapshot is removed only after."""
    old = None
    check_replaceable(path)  # again: something may have appeared while we wrote
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    os.rename(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)
