"""The scheduler side of the file tier: lookups fall through to files, loads promote.

Files are published by a real ``FileTier`` (the workers' writer) under the
namespaces the spec derives from vLLM's ``OffloadingConfig``; the manager
only sees them through its read-only ``FileView``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.auth import make_secret_file

from gpu_offload.vllm import metrics
from gpu_offload.vllm.fs_specs import FileView, HostLoadSpec, HostStoreSpec, fingerprint
from gpu_offload.vllm.manager import HostTierManager
from gpu_offload.spec import HostOffloadSpec
from gpu_fs_helpers import offloading_config

CTX = ReqContext(req_id="r")
CHUNK = 8192


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def publish(root, cfg, rank: int, keys, secret=None) -> None:
    with FileTier(str(root), fingerprint(cfg, rank), CHUNK, capacity_bytes=None, threads=1, secret=secret) as tier:
        for k in keys:
            assert tier.submit_write(k, np.full(CHUNK, 7, np.uint8)) is not None
        tier.flush()


@pytest.fixture
def cfg():
    return offloading_config({"num_cpu_chunks": 4})


@pytest.fixture
def mgr(tmp_path, cfg):
    view = FileView(str(tmp_path), [fingerprint(cfg, 0)], CHUNK)
    m = HostTierManager(4, CHUNK, blocks_per_chunk=1, tokens_per_block=128, files=view)
    yield m
    m.shutdown()


def stored(m, keys):
    out = m.prepare_store(keys, CTX)
    m.complete_store(out.keys_to_store, CTX)
    return out


def test_lookup_falls_through_host_then_files(tmp_path, cfg, mgr):
    publish(tmp_path, cfg, 0, [key(1), key(2)])
    out = mgr.prepare_store([key(3)], CTX)
    assert mgr.lookup(key(3), CTX) is LookupResult.HIT_PENDING  # host pending wins
    mgr.complete_store([key(3)], CTX)
    stats = mgr.files.stats
    assert mgr.lookup(key(3), CTX) is LookupResult.HIT and mgr.files.stats == stats  # host hit: no stat
    assert mgr.lookup(key(1), CTX) is LookupResult.HIT  # from files
    assert mgr.lookup(key(9), CTX) is LookupResult.MISS
    assert isinstance(out.store_spec, HostStoreSpec) and out.store_spec.keys == [key(3)]


def test_prepare_load_promotes_file_chunks_into_pinned_host_slots(tmp_path, cfg, mgr):
    publish(tmp_path, cfg, 0, [key(1), key(2)])
    stored(mgr, [key(3)])
    spec = mgr.prepare_load([key(1), key(3), key(2)], CTX)
    assert isinstance(spec, HostLoadSpec)
    assert spec.keys == [key(1), key(3), key(2)] and spec.promote.tolist() == [True, False, True]
    slots = spec.block_ids.tolist()
    assert len(set(slots)) == 3 and min(slots) >= 0
    assert mgr.get_load_source(key(1), CTX) == CacheHitSource.DISK
    assert mgr.get_load_source(key(3), CTX) == CacheHitSource.HOST
    assert (mgr.hit_chunks, mgr.fs_hit_chunks) == (1, 2)
    # all three are pinned: a store needing two slots cannot evict them
    assert mgr.prepare_store([key(7), key(8)], CTX) is None
    mgr.complete_load({key(1), key(2), key(3)}, CTX)
    assert mgr.get_load_source(key(1), CTX) == CacheHitSource.HOST  # now a host chunk
    assert mgr.lookup(key(2), CTX) is LookupResult.HIT and mgr.index.slot_of(key(2)) == slots[2]
    assert mgr.ignored_completions == 0
    assert (mgr.hit_chunks, mgr.fs_hit_chunks) == (1, 2)
    assert metrics.HIT_CHUNKS not in mgr.get_stats().data["data"]  # exported by the worker, once loaded


def test_promotion_evictions_reach_the_worker_and_spare_the_pinned(tmp_path, cfg, mgr):
    publish(tmp_path, cfg, 0, [key(1)])
    stored(mgr, [key(10), key(11), key(12), key(13)])  # full
    spec = mgr.prepare_load([key(13), key(1)], CTX)
    assert spec.evicted == [key(10)]  # least recent, and not the host chunk of this load
    assert spec.block_ids.tolist()[1] >= 0 and mgr.lookup(key(10), CTX) is LookupResult.MISS


def test_no_free_slot_marks_the_chunk_unplaced(tmp_path, cfg, mgr):
    publish(tmp_path, cfg, 0, [key(1)])
    stored(mgr, [key(10), key(11), key(12), key(13)])
    mgr.prepare_load([key(10), key(11), key(12), key(13)], CTX)  # every slot pinned
    spec = mgr.prepare_load([key(1)], CTX)
    assert spec.block_ids.tolist() == [-1] and mgr.unplaced_chunks == 1 and mgr.fs_hit_chunks == 0
    mgr.complete_load({key(1)}, CTX)
    assert mgr.ignored_completions == 0


def test_a_chunk_counts_only_when_every_rank_has_its_file(tmp_path):
    cfg = offloading_config({"num_cpu_chunks": 4}, world_size=2)
    view = FileView(str(tmp_path), [fingerprint(cfg, r) for r in range(2)], CHUNK)
    assert len(set(view.ns_dirs)) == 2
    publish(tmp_path, cfg, 0, [key(1), key(2)])
    publish(tmp_path, cfg, 1, [key(2)])
    assert not view.contains(key(1)) and view.contains(key(2))


def test_fingerprint_separates_layouts():
    base = fingerprint(offloading_config({}), 0)
    assert fingerprint(offloading_config({}), 0) == base
    assert fingerprint(offloading_config({}, bytes_per_block=4096), 0) != base
    assert fingerprint(offloading_config({}, blocks_per_chunk=2), 0) != base
    assert fingerprint(offloading_config({}, world_size=2), 0).namespace() != base.namespace()


def test_without_a_path_specs_are_vllms_own(cfg):
    m = HostTierManager(4, CHUNK, blocks_per_chunk=1, tokens_per_block=128)
    out = stored(m, [key(1)])
    assert type(out.store_spec) is CPULoadStoreSpec
    assert type(m.prepare_load([key(1)], CTX)) is CPULoadStoreSpec
    assert m.lookup(key(2), CTX) is LookupResult.MISS
    m.shutdown()


def test_shipped_config_wires_the_file_tier(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("TPU_OFFLOAD_")]:
        monkeypatch.delenv(name)
    ktc = json.loads((Path(__file__).parents[2] / "configs/vllm/offload-host-fs.json").read_text())
    extra = ktc["kv_connector_extra_config"]
    assert ktc["kv_load_failure_policy"] == "recompute" and extra["shared_storage_path"]
    assert extra["fs_secret_file"] == "/etc/tpu-offload/fs-secret/secret"  # the pod's mounted Secret
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    make_secret_file(str(secret))
    extra.update(shared_storage_path=str(tmp_path), cpu_bytes_to_use=16 << 20,  # the shipped ones are for real hosts
                 fs_secret_file=str(secret))
    spec = HostOffloadSpec(offloading_config(extra, blocks_per_chunk=2))
    manager = spec.get_manager()
    page = 131072
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(8, page, dtype=torch.int8), page) for _ in range(2)],
                               [[CanonicalKVCacheRef(i, page) for i in range(2)]])
    worker = spec.get_worker(caches)
    assert manager.files is not None and worker.fs is not None
    assert worker.fs.write_mode == "write_through" and worker.fs.ring is None  # replicas share at once
    assert worker.fs.tier.capacity_bytes == 4 << 40
    assert manager.files.ns_dirs == [worker.fs.tier.ns_dir]  # scheduler and worker agree on the namespace
    assert manager.files.file_bytes == worker.fs.tier.file_bytes
    worker.shutdown()
    manager.shutdown()


@pytest.mark.parametrize("plant", ["symlink_file", "symlink_dir", "fifo"])
def test_file_view_never_follows_a_planted_path(tmp_path, cfg, plant):
    """The scheduler's presence check must not count another tenant's symlink or FIFO as a chunk."""
    from tpu_offload.core.fs.layout import chunk_dir_and_path, key_hex

    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    publish(outside, cfg, 0, [key(9)])  # a real chunk, but outside our root
    ns = os.path.join(str(root), fingerprint(cfg, 0).namespace())
    d, path = chunk_dir_and_path(ns, key_hex(key(9)))
    real = chunk_dir_and_path(os.path.join(str(outside), fingerprint(cfg, 0).namespace()), key_hex(key(9)))
    if plant == "symlink_dir":
        os.makedirs(os.path.dirname(d), exist_ok=True)
        os.symlink(real[0], d)
    else:
        os.makedirs(d, exist_ok=True)
        if plant == "symlink_file":
            os.symlink(real[1], path)
        else:
            os.mkfifo(path)
    assert not FileView(str(root), [fingerprint(cfg, 0)], CHUNK).contains(key(9))


def test_view_with_the_workers_secret_finds_their_files_and_only_with_it(tmp_path, cfg):
    """With a secret the workers name files by keyed hashes: the scheduler's view must derive the same."""
    secret = b"a-secret-of-32-bytes-0123456789ab"
    publish(tmp_path, cfg, 0, [key(1)], secret=secret)
    fps = [fingerprint(cfg, 0)]
    assert FileView(str(tmp_path), fps, CHUNK, secret=secret).contains(key(1))
    assert not FileView(str(tmp_path), fps, CHUNK, secret=secret).contains(key(2))
    assert not FileView(str(tmp_path), fps, CHUNK).contains(key(1))
    assert not FileView(str(tmp_path), fps, CHUNK, secret=b"another-secret-0123456789abcdef").contains(key(1))


def test_the_request_salt_reaches_the_file_lookup_and_the_specs(tmp_path, cfg):
    """vLLM's ReqContext has no cache_salt: our hook keeps it, the manager names files and specs with it."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched

    from gpu_offload.vllm import patches
    from gpu_offload.vllm.manager import request_salt

    patches.install()
    req = SimpleNamespace(request_id="r1", kv_transfer_params=None, kv_hints=None, cache_salt="tenant-a")
    ctx = sched._create_req_context(req)
    assert request_salt(ctx) == b"tenant-a"
    assert request_salt(sched._create_req_context(SimpleNamespace(**{**vars(req), "cache_salt": None}))) == b""
    secret = b"a-secret-of-32-bytes-0123456789ab"
    with FileTier(str(tmp_path), fingerprint(cfg, 0), CHUNK, capacity_bytes=None, threads=1, secret=secret) as t:
        assert t.submit_write(key(1), np.full(CHUNK, 7, np.uint8), b"tenant-a").wait(10)
    view = FileView(str(tmp_path), [fingerprint(cfg, 0)], CHUNK, secret=secret)
    m = HostTierManager(4, CHUNK, blocks_per_chunk=1, tokens_per_block=128, files=view)
    try:
        assert m.lookup(key(1), ctx) is LookupResult.HIT
        assert m.lookup(key(1), CTX) is LookupResult.MISS  # another tenant (no salt)
        spec = m.prepare_load([key(1)], ctx)
        assert spec.salt == b"tenant-a" and spec.promote.tolist() == [True]
        assert m.prepare_store([key(2)], ctx).store_spec.salt == b"tenant-a"
    finally:
        m.shutdown()


def test_a_failed_load_hides_only_the_chunks_that_failed(tmp_path, cfg):
    """One KV group: vLLM reports block ids only. Our workers list the failed chunks; only those are hidden."""
    from types import SimpleNamespace

    from gpu_offload.vllm import hooks
    from gpu_offload.vllm.file_events import FileTierWorkerMetadata

    m = HostTierManager(8, CHUNK, blocks_per_chunk=1, tokens_per_block=128)
    try:
        stored(m, [key(i) for i in range(1, 6)])
        m.prepare_load([key(1), key(2), key(3)], CTX)
        m.prepare_load([key(4), key(5)], CTX)
        jobs = {7: SimpleNamespace(is_store=False, req_id="r", keys=[key(1), key(2), key(3)]),
                8: SimpleNamespace(is_store=False, req_id="s", keys=[key(4), key(5)])}
        meta = FileTierWorkerMetadata(completed_jobs={7: 1, 8: 1}, load_failures={7: (key(2),)},
                                      reports_load_failures=True)
        conn = SimpleNamespace(connector_scheduler=SimpleNamespace(manager=m, _jobs=jobs))
        out = SimpleNamespace(failed_recving=set(), invalid_block_ids={42}, kv_connector_worker_meta=meta)
        hooks._forget_failed_loads(conn, out)
        assert m.lookup(key(2), CTX) is LookupResult.MISS
        assert all(m.lookup(key(i), CTX) is not LookupResult.MISS for i in (1, 3, 4, 5)), "healthy chunks hidden"
    finally:
        m.shutdown()


def test_a_connector_reset_hides_the_files_of_the_old_weights(tmp_path, cfg):
    """reset_prefix_cache(reset_connector=True) after a weight update: files written before it are not found."""
    publish(tmp_path, cfg, 0, [key(1)])
    epoch = tmp_path / "epoch"
    epoch.write_text("weights-v2")
    view = FileView(str(tmp_path), [fingerprint(cfg, 0)], CHUNK)
    m = HostTierManager(4, CHUNK, blocks_per_chunk=1, tokens_per_block=128, files=view,
                        reset_epoch_file=str(epoch))
    try:
        assert m.lookup(key(1), CTX) is LookupResult.HIT
        m.reset_cache()
        assert m.lookup(key(1), CTX) is LookupResult.MISS, "old weights' KV came back from a file"
        assert m.epoch.startswith("epoch-")
        assert m.prepare_store([key(2)], CTX).store_spec.epoch == m.epoch  # the workers follow
    finally:
        m.shutdown()
