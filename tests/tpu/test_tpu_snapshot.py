"""Warm restart of the host tier (``snapshot_path``): index JSON + orbax slabs.

A fresh connector pair restores what the last one saved at shutdown; the
stand-in forward checks every KV position it reads, so a wrong restore fails.
"""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.lru import LRUChunkManager
from tpu_standin import Harness, prompt

pytestmark = pytest.mark.engine

BS = 16
CHUNKS = 4


@pytest.fixture
def make(mesh, tiny_model_dir, tmp_path):
    made = []

    def _make(dtype=jnp.float32, **extra):
        extra.setdefault("num_cpu_chunks", 16)
        extra.setdefault("staging_blocks", 8)
        extra.setdefault("blocks_per_chunk", 2)
        extra.setdefault("snapshot_path", str(tmp_path / "snap"))
        h = Harness(mesh, tiny_model_dir, block_size=BS, extra=extra, dtype=dtype)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.conn_w.shutdown()
        h.conn_s.shutdown()


def run_and_stop(h, p):
    h.add(p, max_tokens=1)
    h.run()
    assert h.check_tier() == CHUNKS
    saved = {h.sch.manager.slot_of(k): k for k in h.sch.manager.keys_lru_order()}
    eng = h.wrk.engine
    rows = {s: [np.asarray(g[s // eng.rows_per_slab])[s % eng.rows_per_slab].copy() for g in eng.slabs]
            for s in saved}
    h.conn_s.shutdown()
    h.conn_w.shutdown()
    return saved, rows


def matched_of(h):
    out = []
    orig = h.conn_s.get_num_new_matched_tokens
    h.conn_s.get_num_new_matched_tokens = lambda r, n: out.append(orig(r, n)) or out[-1]
    return out


def test_lru_restore_keeps_slots_and_order():
    m = LRUChunkManager(4, 8)
    keys = [make_chunk_key(bytes([i]) * 32) for i in range(3)]
    assert m.restore([(keys[0], 3), (keys[1], 0), (keys[2], 2)]) == 3
    assert [m.slot_of(k) for k in keys] == [3, 0, 2]
    alloc = m.prepare_store([make_chunk_key(b"\x09" * 32), make_chunk_key(b"\x0a" * 32)])
    assert sorted(alloc.slots) == [1, 3] and alloc.evicted == [keys[0]]  # the free slot, then the least recent
    with pytest.raises(ValueError):
        m.restore([(keys[0], 1)])  # not empty
    with pytest.raises(ValueError):
        LRUChunkManager(4, 8).restore([(keys[0], 1), (keys[1], 1)])  # one slot twice


@pytest.mark.parametrize("change", ["dtype", "blocks_per_chunk"])
def test_foreign_layout_starts_cold(make, change, caplog):
    p = prompt(CHUNKS * 2 * BS, 2)
    run_and_stop(make(), p)
    b = make(dtype=jnp.bfloat16) if change == "dtype" else make(blocks_per_chunk=1)
    assert b.sch.manager.stats().used_chunks == 0 and not b.wrk.engine.valid.any()
    assert any("starting cold" in r.getMessage() for r in caplog.records)
    matched = matched_of(b)
    b.add(p, max_tokens=1)
    b.run()
    assert matched[0] == (0, False)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "stale"])
def test_bad_slabs_with_intact_index_are_recomputed(make, tmp_path, damage):
    p = prompt(CHUNKS * 2 * BS, 3)
    run_and_stop(make(), p)
    host = tmp_path / "snap" / "host"
    if damage == "missing":
        shutil.rmtree(host)
    elif damage == "corrupt":  # flip bytes in the middle of the largest data file
        files = [os.path.join(d, f) for d, _, fs in os.walk(host / "slabs") for f in fs]
        big = max(files, key=os.path.getsize)
        with open(big, "r+b") as f:
            size = os.path.getsize(big)
            f.seek(size // 2)
            f.write(bytes(255 - x for x in f.read(64)[:64]) if size > 200 else b"\xff")
    else:  # slabs from an older run than the index
        old = tmp_path / "old-host"
        shutil.copytree(host, old)
        mid = make()
        mid.add(prompt(2 * 2 * BS, 4), max_tokens=1)
        mid.run()
        mid.conn_s.shutdown()
        mid.conn_w.shutdown()
        shutil.rmtree(host)
        shutil.copytree(old, host)
    b = make()
    assert b.sch.manager.stats().used_chunks >= CHUNKS  # the index still claims the chunks
    matched = matched_of(b)
    b.add(p + [7], max_tokens=2)
    b.run()  # the stand-in fails the run if any wrong KV is read without a reported load error
    assert matched[0][0] > 0
    assert b.wrk.totals.get("load_errors", 0) >= 1
    assert not b.runner.failures
    assert b.sch.manager.stats().pinned_chunks == 0 and not b.sch.has_pending_work()


def test_no_snapshot_after_a_reset(make, tmp_path):
    """After reset_connector (new weights) the tier holds the new weights' KV; a snapshot would
    hand it to whatever weights the next start loads, so none is saved (an older one stays)."""
    h = make()
    h.add(prompt(CHUNKS * 2 * BS, 5), max_tokens=1)
    h.run()
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.add(prompt(CHUNKS * 2 * BS, 6), max_tokens=1)
    h.run()
    h.conn_s.shutdown()
    h.conn_w.shutdown()
    assert not (tmp_path / "snap").exists() or not any((tmp_path / "snap").iterdir())
    b = make()
    out = matched_of(b)
    b.add(prompt(CHUNKS * 2 * BS, 6), max_tokens=1)
    b.run()
    assert out[0] == (0, False)


def test_engine_shutdown_saves_both_halves(make, tmp_path):
    """tpu-inference's EngineCore.shutdown reaches only the scheduler half (its TPUWorker has no
    shutdown()); on one host both halves share that process, so the scheduler half shuts the
    worker half down: slabs and index are both saved, and the next start hits."""
    h = make()
    p = prompt(CHUNKS * 2 * BS, 7)
    h.add(p, max_tokens=1)
    h.run()
    h.conn_s.shutdown()  # what EngineCore.shutdown -> Scheduler.shutdown does; nothing calls conn_w
    assert h.wrk.engine is None  # drained and saved
    assert os.path.exists(tmp_path / "snap" / "host" / "meta-p0.json")
    b = make()
    out = matched_of(b)
    b.add(p + [3], max_tokens=1)
    b.run()
    assert out[0] == (CHUNKS * 2 * BS, True)



# ---- signed slabs: a signed meta and a MAC per slot ----


def _same_xxh3(monkeypatch):
    """Every slot "keeps its xxh3": what an attacker gets from xxh3's modular arithmetic."""
    from tpu_offload.jax_backend import snapshot as slab_snap

    monkeypatch.setattr(slab_snap, "_checksum", lambda engine, slot: "0" * 16)


def test_a_slot_rewritten_under_a_signed_meta_is_dropped_counted_and_the_rest_served(make, tmp_path,
                                                                                     monkeypatch):
    from tpu_offload.jax_backend import hostview
    from tpu_standin import fs_secret_file

    _same_xxh3(monkeypatch)
    secret = fs_secret_file(tmp_path)
    p = prompt(CHUNKS * 2 * BS, 8)
    saved, _ = run_and_stop(make(fs_secret_file=secret), p)
    snap = tmp_path / "snap"
    keep = tmp_path / "signed"
    shutil.copytree(snap, keep)  # the victim's index and signed meta, intact
    b = make(fs_secret_file=secret)  # restores, then someone rewrites one slot's bytes before they are saved
    eng = b.wrk.engine
    assert b.wrk.totals["snapshot_dropped"] == 0 and int(eng.valid.sum()) == CHUNKS
    b.add(prompt(2 * BS, 10), max_tokens=1)  # a step, so this run saves its slabs at shutdown
    b.run()
    slot = sorted(saved)[1]
    k, row = divmod(slot, eng.rows_per_slab)
    for g in eng.slabs:
        for v in hostview.row_views(g[k], row):
            v[:] = 0x3C
    b.conn_s.shutdown()
    b.conn_w.shutdown()
    shutil.copy(keep / "index.json", snap / "index.json")  # the victim's signed index and meta over those slabs
    shutil.copy(keep / "host" / "meta-p0.json", snap / "host" / "meta-p0.json")
    c = make(fs_secret_file=secret)
    assert c.wrk.totals["snapshot_dropped"] == 1
    assert int(c.wrk.engine.valid.sum()) == CHUNKS - 1 and not c.wrk.engine.valid[slot]
    c.add(p + [5], max_tokens=2)
    c.run()  # the stand-in fails the run if any wrong KV is read without a reported load error
    assert not c.runner.failures and c.wrk.totals.get("load_errors", 0) >= 1


def test_a_slab_meta_not_signed_with_the_secret_starts_cold(make, tmp_path, caplog):
    import json

    from tpu_standin import fs_secret_file

    secret = fs_secret_file(tmp_path)
    run_and_stop(make(fs_secret_file=secret), prompt(CHUNKS * 2 * BS, 9))
    meta_file = tmp_path / "snap" / "host" / "meta-p0.json"
    meta = json.loads(meta_file.read_text())
    assert meta["meta_mac"] and len(meta["macs"]) == CHUNKS
    meta.pop("meta_mac")
    meta_file.write_text(json.dumps(meta))
    b = make(fs_secret_file=secret)
    assert not b.wrk.engine.valid.any()
    assert any("meta_mac" in r.getMessage() for r in caplog.records)
