"""Across engine processes: the file tier and the warm restart, TP 1 and TP 2.

A writer engine in this process runs with configs/tpu-inference/offload-fs.json
(file tier written through, plus a snapshot path) and shuts down; then a
second process starts fresh engines on the same directories: one with only
the file tier, one with only the snapshot. Both must hit what the writer
stored and produce the no-connector tokens.
"""

from __future__ import annotations

import pytest

from engine_child import run_jobs
from engine_run import kv_transfer_config
from offload_helpers import OURS, SETUPS, hit_tokens, settle, totals, wrk
from workloads import ROUNDTRIP

pytestmark = pytest.mark.engine


def fs_config(fs_dir=None, snapshot_dir=None) -> dict:
    over = {**OURS, "fs_capacity_bytes": "256MiB", "fs_write_mode": "write_through"}
    cfg = kv_transfer_config("offload-fs.json", **over)
    extra = cfg["kv_connector_extra_config"]
    extra.pop("shared_storage_path")
    if fs_dir:
        extra["shared_storage_path"] = str(fs_dir)
    if snapshot_dir:
        extra["snapshot_path"] = str(snapshot_dir)
    return cfg


@pytest.fixture(scope="module")
def runs(engines, model_dir, tmp_path_factory):
    out, jobs = {}, []
    for name, shape in sorted(SETUPS.items()):
        w = ROUNDTRIP[shape.block_size]
        base = engines.baseline(shape, w)
        fs_dir, snap_dir = tmp_path_factory.mktemp(f"fs-{name}"), tmp_path_factory.mktemp(f"snap-{name}")
        eng = engines.get(("writer", shape), shape, fs_config(fs_dir, snap_dir))
        tokens = w.run(eng)
        settle(eng)
        worker = wrk(eng)
        stored = totals(eng)["stored_chunks"]
        dropped = worker.fs.dropped_writes
        eng.stop()  # as a tpu-inference server exits
        shut_by_engine = worker.engine is None
        engines.close()  # then what vLLM's GPU worker does: our worker flushes files, saves its host slabs
        out[name] = {"base": base, "writer": tokens, "stored": stored, "shut_by_engine": shut_by_engine,
                     "dropped_writes": dropped,
                     "want_hits": sum(hit_tokens(len(p), shape.block_size) for p in w.prompts)}
        common = {"shape": shape.__dict__, "model_dir": model_dir(shape.model, shape.dtype), "workload": w.name}
        jobs += [{**common, "kv": fs_config(fs_dir=fs_dir)}, {**common, "kv": fs_config(snapshot_dir=snap_dir)}]
    results = run_jobs(jobs, tmp_path_factory.mktemp("child"))
    for i, name in enumerate(sorted(SETUPS)):
        out[name]["files"], out[name]["snapshot"] = results[2 * i], results[2 * i + 1]
    return out


DROPS = pytest.mark.xfail(strict=True, reason=(
    "write_through drops a chunk's file write when its 8 copy buffers are busy (FsMover.write): "
    "one 3-prompt prefill (20 chunks) lost 2 of them, and a burst of N chunks per step loses all but ~8"))


@pytest.mark.parametrize("setup", [pytest.param(s, marks=DROPS) if SETUPS[s].block_size == 16 else s
                                   for s in sorted(SETUPS)])
def test_second_process_hits_the_files_with_identical_tokens(runs, setup):
    r = runs[setup]
    assert r["writer"] == r["base"]
    assert r["stored"] > 0
    assert r["files"]["tokens"] == r["base"]
    assert r["dropped_writes"] == 0, "every chunk stored to the host tier is written through to its file"
    got = r["files"]
    assert got["tokens"] == r["base"]
    assert got["totals"]["hit_tokens"] == r["want_hits"]
    assert got["totals"].get("load_errors", 0) == 0


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_warm_restart_from_a_snapshot_hits_with_identical_tokens(runs, setup):
    r = runs[setup]
    got = r["snapshot"]
    assert got["tokens"] == r["base"]
    assert got["totals"]["hit_tokens"] == r["want_hits"]
    assert got["totals"].get("load_errors", 0) == 0


@pytest.mark.xfail(strict=True, reason=(
    "tpu-inference's TPUWorker has no shutdown(): unlike vLLM's GPU worker it never calls "
    "ensure_kv_transfer_shutdown(), so our worker half never drains, flushes its file writes "
    "or saves the warm-restart host slabs when a tpu-inference server exits"))
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_engine_shutdown_shuts_our_worker_down(runs, setup):
    assert runs[setup]["shut_by_engine"]
