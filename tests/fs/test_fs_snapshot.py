"""Warm restart of the host tier: snapshot at shutdown, restore at start."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from fs_helpers import key, layout, payload, run_child
from tpu_offload.core.fs import restore_host_tier, snapshot_host_tier
from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Lookup
from tpu_offload.core.pool import HostChunkPool

CB = 8 << 10


def _host_tier(n_slots=8, n_keys=6):
    mgr = LRUChunkManager(n_slots, CB)
    pool = HostChunkPool(n_slots, CB)
    keys = [key(i) for i in range(n_keys)]
    alloc = mgr.prepare_store(keys)
    for k, s in zip(alloc.keys, alloc.slots):
        pool.row(s)[:] = payload(int.from_bytes(k[:4], "big"), CB)
        pool.valid[s] = True
    mgr.complete_store(keys)
    mgr.take_events()
    return mgr, pool, keys


def _content(mgr, pool, k):
    return pool.row(mgr.slot_of(k))


def test_round_trip_keeps_bytes_and_lru_order(tmp_path):
    mgr, pool, keys = _host_tier()
    mgr.touch([keys[1]])  # 1 becomes most recent
    mgr.prepare_load([keys[3]])  # 3 pinned: saved, counted as most recent
    inflight = mgr.prepare_store([key(77)])  # a write in flight: not ready, not saved
    pool.valid[inflight.slots[0]] = False
    order = [k for k, _ in mgr.items_lru_order()]
    assert order == [keys[i] for i in (0, 2, 4, 5, 1, 3)]
    path = tmp_path / "snap"
    assert snapshot_host_tier(mgr, pool, str(path), layout()) == 6
    got = restore_host_tier(str(path), layout(), 8, CB)
    assert got is not None
    m2, p2 = got
    assert m2.keys_lru_order() == order
    assert m2.lookup(key(77)) is Lookup.MISS
    for k in keys:
        assert m2.lookup(k) is Lookup.HIT and p2.valid[m2.slot_of(k)]
        assert np.array_equal(_content(m2, p2, k), _content(mgr, pool, k))
    ev = m2.take_events()  # the restored chunks are announced as stored
    assert sum(len(e.keys) for e in ev if not e.removed) == 6
    # and it behaves as a live tier: the least recent is evicted first
    alloc = m2.prepare_store([key(100), key(101), key(102)])
    assert alloc.evicted == [keys[0]]


def test_invalid_slots_are_not_saved(tmp_path):
    mgr, pool, keys = _host_tier()
    pool.valid[mgr.slot_of(keys[2])] = False  # the worker knows this store failed
    assert snapshot_host_tier(mgr, pool, str(tmp_path / "s"), layout()) == 5
    m2, _ = restore_host_tier(str(tmp_path / "s"), layout(), 8, CB)
    assert m2.lookup(keys[2]) is Lookup.MISS


def test_smaller_tier_keeps_the_most_recent(tmp_path):
    mgr, pool, keys = _host_tier()
    snapshot_host_tier(mgr, pool, str(tmp_path / "s"), layout())
    m2, p2 = restore_host_tier(str(tmp_path / "s"), layout(), 4, CB)
    assert m2.keys_lru_order() == keys[2:]
    for k in keys[2:]:
        assert np.array_equal(_content(m2, p2, k), _content(mgr, pool, k))


def test_foreign_fingerprint_and_chunk_size_are_rejected(tmp_path, caplog):
    mgr, pool, _ = _host_tier()
    snapshot_host_tier(mgr, pool, str(tmp_path / "s"), layout())
    with caplog.at_level(logging.WARNING, logger="tpu_offload.fs"):
        assert restore_host_tier(str(tmp_path / "s"), layout(tp_rank=1, tp_size=2), 8, CB) is None
        assert restore_host_tier(str(tmp_path / "s"), layout(), 8, CB * 2) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert any("layout" in m for m in msgs) and any("chunk size" in m for m in msgs)
    assert restore_host_tier(str(tmp_path / "absent"), layout(), 8, CB) is None


def test_damage_is_detected(tmp_path):
    mgr, pool, keys = _host_tier()
    path = tmp_path / "s"
    snapshot_host_tier(mgr, pool, str(path), layout())
    idx = json.loads((path / "index.json").read_text())
    # one flipped row: only that chunk is dropped
    with open(path / "chunks.npy", "r+b") as f:
        f.seek(idx["data_offset"] + 2 * CB + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    m2, p2 = restore_host_tier(str(path), layout(), 8, CB)
    bad = [k for k, _ in mgr.items_lru_order()][2]  # row 2 of the file
    assert m2.lookup(bad) is Lookup.MISS
    assert sum(m2.lookup(k) is Lookup.HIT for k in keys) == 5
    assert int(p2.valid.sum()) == 5
    # an edited index: the whole snapshot is refused
    idx["keys"][0] = key(999).hex()
    (path / "index.json").write_text(json.dumps(idx))
    assert restore_host_tier(str(path), layout(), 8, CB) is None
    # the data file is a standard .npy
    (path / "index.json").unlink()
    arr = np.load(path / "chunks.npy", mmap_mode="r")
    assert arr.shape == (6, CB) and arr.dtype == np.uint8


def test_snapshot_replaces_the_previous_one(tmp_path):
    mgr, pool, keys = _host_tier()
    snapshot_host_tier(mgr, pool, str(tmp_path / "s"), layout())
    mgr.reset()
    mgr.take_events()
    snapshot_host_tier(mgr, pool, str(tmp_path / "s"), layout())
    m2, _ = restore_host_tier(str(tmp_path / "s"), layout(), 8, CB)
    assert len(m2) == 0
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_core_fs_imports_neither_jax_nor_torch():
    r = run_child(
        "import sys, tpu_offload.core.fs, tpu_offload.core.fs.cli, tpu_offload.core.fs.snapshot;"
        "print(sorted(m for m in ('jax', 'torch', 'orbax', 'orbax.checkpoint') if m in sys.modules))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ---- a snapshot on a shared volume is not trusted -----------------------------------


def _craft(path, **change):
    """Edit the index and make it self-consistent again (its xxh3 is unkeyed: anyone can)."""
    from tpu_offload.core.fs.snapshot import _index_digest

    file = os.path.join(path, "index.json")
    with open(file) as f:
        index = json.load(f)
    for k, v in change.items():
        if v is None:
            index.pop(k, None)
        else:
            index[k] = v
    index.pop("index_mac", None)
    index["index_xxh3"] = _index_digest(index)
    with open(file, "w") as f:
        json.dump(index, f)
    return index


def _saved(tmp_path, **kw):
    mgr, pool, keys = _host_tier()
    path = str(tmp_path / "snap")
    snapshot_host_tier(mgr, pool, path, layout(), **kw)
    return path, keys



@pytest.mark.parametrize("change", [
    {"keys": ["zz"] * 6},                       # not hex
    {"keys": None},                            # a missing field
    {"slots": None},
    {"checksums": ["x"] * 6},
    {"data_offset": "0"},
    {"chunk_bytes": None},
    {"keys": [key(1).hex()] * 6},              # one key six times
])
def test_a_malformed_index_is_a_cold_start_with_a_warning(tmp_path, caplog, change):
    path, _ = _saved(tmp_path)
    _craft(path, **change)
    with caplog.at_level(logging.WARNING, logger="tpu_offload.fs"):
        assert restore_host_tier(path, layout(), 8, CB) is None
    assert any("starting cold" in r.getMessage() for r in caplog.records)


def test_data_outside_the_snapshot_directory_is_never_read(tmp_path):
    """``"data": "<absolute path>"`` would read any file into the host tier."""
    path, keys = _saved(tmp_path)
    outside = tmp_path / "outside.npy"
    with open(os.path.join(path, "chunks.npy"), "rb") as f:
        outside.write_bytes(f.read())  # a readable file with the right rows: only the path is wrong
    for data in (str(outside), "../outside.npy", "sub/chunks.npy"):
        _craft(path, data=data)
        assert restore_host_tier(path, layout(), 8, CB) is None, data


def test_a_fifo_or_symlink_at_the_index_never_hangs_or_is_followed(tmp_path):
    import threading

    path, _ = _saved(tmp_path)
    real = os.path.join(path, "index.json")
    os.rename(real, str(tmp_path / "elsewhere.json"))
    os.symlink(str(tmp_path / "elsewhere.json"), real)
    assert restore_host_tier(path, layout(), 8, CB) is None, "a symlinked index was followed"
    os.unlink(real)
    os.mkfifo(real)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", restore_host_tier(path, layout(), 8, CB)), daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "restore hung on a FIFO at index.json"
    assert box["r"] is None


def test_a_signed_index_needs_the_same_secret(tmp_path):
    secret = b"a-secret-of-32-bytes-0123456789ab"
    path, keys = _saved(tmp_path, secret=secret)
    got = restore_host_tier(path, layout(), 8, CB, secret=secret)
    assert got is not None and set(k for k, _ in got[0].items_lru_order()) == set(keys)
    assert restore_host_tier(path, layout(), 8, CB, secret=b"another-secret-0123456789abcdef") is None
    _craft(path, slots=list(range(6)))  # self-consistent again, but unsigned
    assert restore_host_tier(path, layout(), 8, CB, secret=secret) is None


def test_the_tpu_index_rejects_malformed_and_unsigned_indexes(tmp_path):
    from tpu_offload.connector.snapshot import INDEX, load_index, save_index

    secret = b"a-secret-of-32-bytes-0123456789ab"
    mgr, _, keys = _host_tier()
    path = str(tmp_path / "tpu")
    save_index(path, "abc", layout(), mgr, secret=secret)
    assert load_index(path, layout(), 8, secret)[0] == "abc"
    assert load_index(path, layout(), 8, b"another-secret-0123456789abcdef") is None
    file = os.path.join(path, INDEX)
    with open(file) as f:
        body = json.load(f)
    for change in ({"snapshot_id": None}, {"keys": ["zz"] * 6}, {"slots": [99] * 6}, {"keys": 5}):
        b = dict(body)
        b.pop("index_mac")
        for k, v in change.items():
            if v is None:
                b.pop(k)
            else:
                b[k] = v
        with open(file, "w") as f:
            json.dump(b, f)
        assert load_index(path, layout(), 8) is None, change
    os.unlink(file)
    os.mkfifo(file)
    assert load_index(path, layout(), 8) is None


# ---- rows are authenticated one by one ----

SECRET = b"Zr4kT9wQ2mV7xN1pL6sB3hD8fJ0cY5gA"


def _weak_xxh3(monkeypatch):
    """Every row "collides": what an attacker gets by keeping a rewritten row's xxh3 (modular arithmetic)."""
    import types

    from tpu_offload.core.fs import snapshot as snap

    monkeypatch.setattr(snap, "xxhash", types.SimpleNamespace(xxh3_64_intdigest=lambda b: 0))


def _rewrite_row(path: str, row: int, data: np.ndarray) -> None:
    with open(os.path.join(path, "index.json")) as f:
        off = json.load(f)["data_offset"]
    with open(os.path.join(path, "chunks.npy"), "r+b") as f:
        f.seek(off + row * CB)
        f.write(data.tobytes())


def test_a_row_rewritten_under_an_intact_index_is_served_without_a_secret(tmp_path, monkeypatch):
    """The attack: the index (and its MAC) covers only xxh3 sums; a row keeping its xxh3 passes."""
    _weak_xxh3(monkeypatch)
    path, keys = _saved(tmp_path)
    evil = np.full(CB, 0x66, np.uint8)
    _rewrite_row(path, 2, evil)
    mgr, pool = restore_host_tier(path, layout(), 8, CB)
    assert any(np.array_equal(pool.row(s), evil) for _, s in mgr.items_lru_order())


def test_with_a_secret_a_rewritten_row_is_dropped_counted_and_the_rest_served(tmp_path, monkeypatch):
    from tpu_offload.core.fs.snapshot import RestoreStats

    _weak_xxh3(monkeypatch)
    path, keys = _saved(tmp_path, secret=SECRET)
    with open(os.path.join(path, "index.json")) as f:
        forged_key = json.load(f)["keys"][2]
    index_before = open(os.path.join(path, "index.json"), "rb").read()
    _rewrite_row(path, 2, np.full(CB, 0x66, np.uint8))
    _rewrite_row(path, 4, np.zeros(CB, np.uint8))
    assert open(os.path.join(path, "index.json"), "rb").read() == index_before  # the index is intact
    stats = RestoreStats()
    mgr, pool = restore_host_tier(path, layout(), 8, CB, secret=SECRET, stats=stats)
    assert (stats.restored, stats.dropped) == (4, 2)
    served = {bytes(k).hex(): pool.row(s) for k, s in mgr.items_lru_order()}
    assert forged_key not in served and len(served) == 4
    for k in keys:
        if bytes(k).hex() in served:
            assert np.array_equal(served[bytes(k).hex()], payload(int.from_bytes(k[:4], "big"), CB))


def test_with_a_secret_an_index_without_row_macs_is_refused(tmp_path):
    path, _ = _saved(tmp_path, secret=SECRET)
    with open(os.path.join(path, "index.json")) as f:
        body = json.load(f)
    from tpu_offload.core.fs.snapshot import _index_digest, _index_mac

    del body["macs"]  # a snapshot signed as before this change: index MAC only
    body.pop("index_mac")
    body["index_xxh3"] = _index_digest(body)
    body["index_mac"] = _index_mac(body, SECRET)
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(body, f)
    assert restore_host_tier(path, layout(), 8, CB, secret=SECRET) is None
