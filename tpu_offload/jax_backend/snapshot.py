"""Warm restart, worker half: the host slabs with orbax, validity as JSON.

Layout under ``snapshot_path/host``: ``slabs/`` (an orbax checkpoint of the
sharded host-memory slabs; every process writes its own shards) and
``meta-p<process>.json`` (snapshot id, layout digest, slab shapes, and the
slots this process held valid with an xxh3-64 of their local bytes). The
whole directory is written under a temporary name and renamed into place.

Restore frees the preallocated slabs first and lets orbax allocate them
once, with the same shardings and memory kind, so a start never holds two
copies of the tier. A slot is valid again only if its checksum matches:
damaged bytes become load errors (recomputed), never served.

With the file tier's secret (the snapshot may sit on a shared volume) the
meta file is signed (``meta_mac``: a meta without it, or not signed with
this secret, is a cold start) and every valid slot carries an HMAC-SHA256
of its bytes bound to the snapshot id, process and slot (``macs``): xxh3
alone can be kept while bytes change. A slot that fails is dropped and
counted, the rest are served.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import hmac
import re

import jax
import numpy as np

from tpu_offload.core.fs.auth import FsAuth
from tpu_offload.core.fs.snapshot import check_replaceable, is_snapshot_json, read_json
from tpu_offload.jax_backend import agree, hostview

log = logging.getLogger(__name__)

FORMAT = "tpu-offload-tpu-slabs"
VERSION = 1
SLABS = "slabs"


def _meta_name(pidx: int) -> str:
    return f"meta-p{pidx}.json"


def _shapes(engine) -> list:
    return [[list(a.shape), str(a.dtype)] for a in jax.tree.leaves(engine.slabs)]


def _checksum(engine, slot: int) -> str:
    k, row = divmod(slot, engine.rows_per_slab)
    return format(hostview.row_checksum([g[k] for g in engine.slabs], row), "016x")


def _slot_mac(auth: FsAuth, engine, slot: int, snapshot_id: str, fp_digest: str) -> str:
    k, row = divmod(slot, engine.rows_per_slab)
    views = [v for g in engine.slabs for v in hostview.row_views(g[k], row)]
    return auth.row_mac(f"slab|{snapshot_id}|{fp_digest}|p{jax.process_index()}|{slot}".encode(), views)


def _meta_mac(auth: FsAuth, meta: dict) -> str:
    return auth.index_mac(json.dumps({k: v for k, v in meta.items() if k != "meta_mac"}, sort_keys=True).encode())


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def save_slabs(engine, host_dir: str, snapshot_id: str, fp_digest: str, secret: bytes | None = None,
               timeout_s: float = 300.0) -> int:
    """Save the slabs and this process's valid slots; returns the slots saved (signed with ``secret``).

    Several JAX processes meet twice, through the coordination service (``agree.unanimous``, no
    program, bounded by ``timeout_s``): after process 0 made the temporary directory, and after every
    process wrote its part. The snapshot is renamed into place only if every process wrote its part;
    else no host keeps a partial one and every host raises the same error, naming the host that failed
    (a device barrier there would leave the others waiting on one that had raised)."""
    import orbax.checkpoint as ocp

    pidx, nproc = jax.process_index(), jax.process_count()
    valid = [int(s) for s in np.flatnonzero(engine.valid)]
    parent = os.path.dirname(os.path.abspath(host_dir))
    base = os.path.basename(host_dir)
    suffix = snapshot_id if nproc > 1 else f"{snapshot_id}.{os.getpid()}"  # every process must agree
    tmp = os.path.join(parent, f".{base}.tmp-{suffix}")

    def start():
        # Never replace a directory at host_dir that is not an earlier slab snapshot.
        check_replaceable(os.path.abspath(host_dir),
                          lambda p: is_snapshot_json(os.path.join(p, _meta_name(0)), FORMAT))
        if pidx == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    _agree("snapshot_mkdir", _failed(start), timeout_s)
    error = _failed(lambda: _write(engine, tmp, snapshot_id, fp_digest, secret, valid, pidx, nproc, ocp))
    try:
        _agree("snapshot_written", error, timeout_s)
    except BaseException:
        if pidx == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if pidx == 0:
        old = f"{tmp}.old"
        if os.path.exists(host_dir):
            os.rename(host_dir, old)
        os.rename(tmp, host_dir)
        shutil.rmtree(old, ignore_errors=True)
    return len(valid)


def _write(engine, tmp: str, snapshot_id: str, fp_digest: str, secret, valid: list, pidx: int, nproc: int, ocp):
    """This process's part: its shards of the slabs (orbax) and its meta file, synced to disk."""
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(tmp, SLABS), engine.slabs)
        ck.wait_until_finished()
    meta = {
        "format": FORMAT, "version": VERSION, "snapshot_id": snapshot_id, "fingerprint_digest": fp_digest,
        "process_count": nproc, "num_slots": engine.num_slots, "rows_per_slab": engine.rows_per_slab,
        "slabs": _shapes(engine), "valid": valid, "checksums": [_checksum(engine, s) for s in valid],
    }
    if secret:
        auth = FsAuth(secret)
        meta["macs"] = [_slot_mac(auth, engine, s, snapshot_id, fp_digest) for s in valid]
        meta["meta_mac"] = _meta_mac(auth, meta)
    _write_meta(os.path.join(tmp, _meta_name(pidx)), meta)


def _write_meta(path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())


def _failed(step) -> str:
    """"" if ``step()`` ran, else why it failed (the other hosts are told rather than left waiting)."""
    try:
        step()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _agree(name: str, error: str, timeout_s: float) -> None:
    ok, why = agree.unanimous(name, not error, error, timeout_s=timeout_s)
    if not ok:
        raise RuntimeError(f"slab snapshot not saved, on any host: {why}")


def restore_slabs(engine, host_dir: str, fp_digest: str, secret: bytes | None = None,
                  stats: dict | None = None, timeout_s: float = 300.0) -> str | None:
    """Refill ``engine``'s slabs and valid slots; returns the snapshot id, or None (cold).

    ``stats`` (a dict) gets ``restored`` and ``dropped`` (slots whose checksum or MAC failed).
    Several JAX processes start warm only if every one has a snapshot that fits (``agree.unanimous``):
    a host that restored (or re-allocated its slabs) alone would launch what its peers do not.
    """
    meta = _read_meta(engine, host_dir, fp_digest, secret)
    warm, why = agree.unanimous("snapshot", meta is not None, f"no slab snapshot in {host_dir} fits this engine",
                                timeout_s=timeout_s)
    if not warm:
        if meta is not None:
            log.warning("tpu_offload: starting cold on every host: %s", why)
        return None
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), engine.slabs)
    old, engine.slabs = engine.slabs, None
    jax.tree.map(lambda a: a.delete(), old)  # the restore is the only full allocation
    del old
    error = ""
    try:
        with ocp.StandardCheckpointer() as ck:
            restored = ck.restore(os.path.join(host_dir, SLABS), abstract)
        engine.slabs = jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(restored))
        jax.block_until_ready(engine.slabs)
    except Exception as e:  # damaged or missing data: start cold
        error = f"host slabs in {host_dir} unreadable ({e})"
    ok, why = agree.unanimous("snapshot_restored", not error, error, timeout_s=timeout_s)
    if not ok:  # every host re-allocates, so all launch the same program
        log.warning("tpu_offload: starting cold: %s", why)
        if engine.slabs is not None:
            jax.tree.map(lambda a: a.delete(), engine.slabs)
        engine.slabs = engine.alloc_slabs()
        return None
    auth = FsAuth(secret) if secret else None
    sid = str(meta["snapshot_id"])
    macs = meta["macs"] if auth is not None else [None] * len(meta["valid"])
    good = [s for s, c, m in zip(meta["valid"], meta["checksums"], macs)
            if isinstance(s, int) and 0 <= s < engine.num_slots and _checksum(engine, s) == c
            and (auth is None or hmac.compare_digest(_slot_mac(auth, engine, s, sid, fp_digest), m))]
    engine.complete_store(good, True)
    dropped = len(meta["valid"]) - len(good)
    if stats is not None:
        stats["restored"], stats["dropped"] = len(good), dropped
    if dropped:
        log.warning("tpu_offload: %d of %d restored host chunks failed their %s; dropped, they will be recomputed",
                    dropped, len(meta["valid"]), "MAC or checksum" if auth else "checksum")
    log.info("tpu_offload: warm start, %d host chunks restored from %s", len(good), host_dir)
    return str(meta["snapshot_id"])


def _read_meta(engine, host_dir: str, fp_digest: str, secret: bytes | None = None) -> dict | None:
    file = os.path.join(host_dir, _meta_name(jax.process_index()))
    meta = read_json(file, "tpu_offload: slab snapshot")
    if meta is None:
        return None
    want = {"format": FORMAT, "version": VERSION, "fingerprint_digest": fp_digest,
            "process_count": jax.process_count(), "num_slots": engine.num_slots,
            "rows_per_slab": engine.rows_per_slab, "slabs": _shapes(engine)}
    bad = [k for k, v in want.items() if not isinstance(meta, dict) or meta.get(k) != v]
    if not bad and len(meta.get("valid", ())) != len(meta.get("checksums", ())):
        bad = ["valid/checksums"]
    if not bad and secret:
        mac, macs = meta.get("meta_mac"), meta.get("macs")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _meta_mac(FsAuth(secret), meta)):
            bad = ["meta_mac (missing, or not signed with this secret)"]
        elif not (isinstance(macs, list) and len(macs) == len(meta["valid"])
                  and all(isinstance(m, str) and _HEX64.match(m) for m in macs)):
            bad = ["macs (one per valid slot)"]
    if bad:
        log.warning("tpu_offload: slab snapshot %s does not fit this engine (%s); starting cold", file, ", ".join(bad))
        return None
    return meta
