"""Warm restart, scheduler half: the chunk index as JSON (``snapshot_path``).

The two halves may run in different processes and save independently at
shutdown, so they are tied by a snapshot id: the scheduler keeps the id of
the index it restored and a new id for this run (a run that restored and
then failed to save its slabs must not pair its new index with the old
slabs), sends both in every step's metadata, and the workers save their
slabs under the new id. A worker whose restored slabs carry an id other
than the restored index's drops them when the first metadata arrives, so an index without matching slabs only costs load errors
(recomputed), never wrong KV. Keys are hex; nothing is pickled. The index
is read like a chunk (no symlink, no FIFO), every field is checked (anything
malformed is a cold start with one warning), and with the file tier's secret
it is signed (``index_mac``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets

import hmac

from tpu_offload.core.fs.auth import FsAuth
from tpu_offload.core.fs.format import MAX_KEY_BYTES
from tpu_offload.core.fs.snapshot import SnapshotPathError, is_snapshot_json, read_json
from tpu_offload.core.keys import ChunkKey, LayoutFingerprint
from tpu_offload.core.lru import LRUChunkManager

log = logging.getLogger(__name__)

FORMAT = "tpu-offload-tpu-index"
VERSION = 1
INDEX = "index.json"
HOST_DIR = "host"  # the workers' slabs (see jax_backend/snapshot.py)


def new_id() -> str:
    return secrets.token_hex(8)


def _mac(body: dict, secret: bytes) -> str:
    return FsAuth(secret).index_mac(json.dumps({k: v for k, v in body.items() if k != "index_mac"},
                                               sort_keys=True).encode())


def save_index(path: str, snapshot_id: str, fp: LayoutFingerprint, manager: LRUChunkManager,
               skip: set = frozenset(), secret: bytes | None = None) -> int:
    """Ready chunks with their slots, least recent first; published by rename. Returns the count."""
    items = [(k, s) for k, s in manager.items_lru_order() if k not in skip]
    body = {
        "format": FORMAT, "version": VERSION, "snapshot_id": snapshot_id,
        "fingerprint_digest": fp.digest().hex(), "num_slots": manager.num_chunks,
        "keys": [bytes(k).hex() for k, _ in items], "slots": [int(s) for _, s in items],
    }
    if secret:
        body["index_mac"] = _mac(body, secret)
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, INDEX)
    if os.path.lexists(target) and not is_snapshot_json(target, FORMAT):  # never overwrite someone's file
        raise SnapshotPathError(f"{target!r} exists and is not a tpu-offload index; refusing to replace it. "
                                "Allowed: a snapshot_path that is new, empty, or holds an earlier snapshot")
    tmp = os.path.join(path, f".{INDEX}.tmp.{os.getpid()}.{new_id()}")
    try:
        with open(tmp, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, INDEX))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(items)


def load_index(path: str, fp: LayoutFingerprint, num_slots: int,
               secret: bytes | None = None) -> tuple[str, list[tuple[ChunkKey, int]]] | None:
    """(snapshot id, items) if the index fits this layout and tier; else None (one warning)."""
    file = os.path.join(path, INDEX)
    body = read_json(file, "tpu_offload: snapshot index")
    if body is None:
        return None
    problem = None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        problem = "not a tpu-offload index of this version"
    elif body.get("fingerprint_digest") != fp.digest().hex():
        problem = "another model or KV layout (fingerprint differs)"
    elif body.get("num_slots") != num_slots:
        problem = f"{body.get('num_slots')} host slots, this tier has {num_slots}"
    elif secret and not (isinstance(body.get("index_mac"), str)
                         and hmac.compare_digest(body["index_mac"], _mac(body, secret))):
        problem = "index MAC missing or wrong (not signed with this secret)"
    elif not isinstance(body.get("snapshot_id"), str) or not isinstance(body.get("keys"), list) \
            or not isinstance(body.get("slots"), list) or len(body["keys"]) != len(body["slots"]):
        problem = "inconsistent index"
    if problem:
        log.warning("tpu_offload: snapshot index %s rejected: %s; starting cold", file, problem)
        return None
    try:
        items = [(ChunkKey(_key(h)), _slot(s, num_slots)) for h, s in zip(body["keys"], body["slots"])]
    except (TypeError, ValueError) as e:
        log.warning("tpu_offload: snapshot index %s rejected (%s); starting cold", file, e)
        return None
    return body["snapshot_id"], items


def _key(h) -> bytes:
    k = bytes.fromhex(h) if isinstance(h, str) else None
    if not k or len(k) > MAX_KEY_BYTES:
        raise ValueError(f"key {h!r} is not hex of 1..{MAX_KEY_BYTES} bytes")
    return k


def _slot(s, num_slots: int) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots:
        raise ValueError(f"slot {s!r} is not in [0, {num_slots})")
    return s


def restore_scheduler(path: str, fp: LayoutFingerprint, manager: LRUChunkManager,
                      secret: bytes | None = None) -> str:
    """Refill ``manager`` from the index; returns the restored snapshot's id ("" if cold)."""
    found = load_index(path, fp, manager.num_chunks, secret)
    if found is None:
        return ""
    snapshot_id, items = found
    try:
        n = manager.restore(items)
    except ValueError as e:
        log.warning("tpu_offload: snapshot index in %s rejected (%s); starting cold", path, e)
        return ""
    log.info("tpu_offload: warm start, %d host chunks from %s (snapshot %s)", n, path, snapshot_id)
    return snapshot_id
