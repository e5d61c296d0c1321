"""Spec sizing (incl. tensor parallelism) and configuration errors, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from tpu_offload.core.config import ConfigError

from gpu_offload.spec import HostOffloadSpec  # the configured spec_module_path
from gpu_offload.testing import offloading_config

PAGE = 128 * 2 * 2 * 64 * 4  # tokens x (K,V) x kv heads x head_dim x fp32 = 128 KiB
LAYERS = 2


def canonical(num_blocks=16):
    tensors = [CanonicalKVCacheTensor(torch.zeros(num_blocks, PAGE, dtype=torch.int8), PAGE) for _ in range(LAYERS)]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])


def test_budget_is_for_the_whole_engine_and_split_across_tp_workers(monkeypatch):
    monkeypatch.delenv("TPU_OFFLOAD_CPU_BYTES", raising=False)
    chunk = PAGE * LAYERS * 4  # 1 MiB per worker with 4 blocks per chunk
    one = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 64 * chunk, "blocks_per_chunk": 4}, blocks_per_chunk=4))
    assert one.num_chunks == 64
    tp4 = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 64 * chunk, "blocks_per_chunk": 4}, blocks_per_chunk=4, world_size=4))
    assert tp4.num_chunks == 16  # each of 4 workers holds its own 1 MiB shard of a chunk
    m = tp4.get_manager()
    assert m.num_chunks == 16 and m.index.stats().capacity_bytes == 64 * chunk
    m.shutdown()


def test_worker_pool_matches_the_manager_and_is_created_once():
    spec = HostOffloadSpec(offloading_config({"num_cpu_chunks": 5, "blocks_per_chunk": 2}, blocks_per_chunk=2))
    kv = canonical()
    w = spec.get_worker(kv)
    assert spec.get_worker(kv) is w
    assert w.pool.num_slots == 5 and w.layout.chunk_bytes == 2 * LAYERS * PAGE
    w.shutdown()


def test_size_in_gib_and_from_env(monkeypatch):
    spec = HostOffloadSpec(offloading_config({"cpu_gib": 0.25}))
    assert spec.num_chunks == (1 << 28) // (PAGE * LAYERS)
    monkeypatch.setenv("TPU_OFFLOAD_NUM_CPU_CHUNKS", "7")
    assert HostOffloadSpec(offloading_config({})).num_chunks == 7


@pytest.mark.parametrize(
    "extra, kw, match",
    [
        ({}, {}, "no host-tier size"),
        ({"cpu_bytes_to_use": 1000}, {}, "smaller than one chunk"),
        ({"cpu_bytes_to_use": 1 << 30, "cpu_bytez": 1}, {}, "did you mean 'cpu_bytes'"),
        ({"cpu_bytes_to_use": "lots"}, {}, "allowed: a byte count"),
        ({"cpu_bytes_to_use": 1 << 30, "blocks_per_chunk": 4}, {"blocks_per_chunk": 2}, "vLLM uses blocks_per_chunk=2"),
    ],
)
def test_config_errors_are_ours_and_clear(monkeypatch, extra, kw, match):
    for name in ("TPU_OFFLOAD_NUM_CPU_CHUNKS", "TPU_OFFLOAD_CPU_BYTES", "TPU_OFFLOAD_CPU_GIB"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=match):
        HostOffloadSpec(offloading_config(extra, **kw))


def test_unsized_engine_is_refused_when_used():
    spec = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 1 << 30}, bytes_per_block=0))
    with pytest.raises(ConfigError, match="cannot be sized"):
        spec.get_manager()


def test_tpu_only_settings_are_named_not_silently_ignored(monkeypatch):
    import gpu_offload.vllm.spec as spec_mod

    seen = []
    monkeypatch.setattr(spec_mod.logger, "warning", lambda msg, *a: seen.append(msg % a))
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4}))
    assert not any("no effect" in m for m in seen)
    tpu_only = {"snapshot_path": "/tmp/snap", "verify_checksums": True, "store_policy": "exclusive",
                "transfer_path": "program", "sliding_window": "all", "decode_save": True, "load_bandwidth_gbps": 9,
                "host_memory_margin": "8GiB"}
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, **tpu_only}))
    (msg,) = [m for m in seen if "no effect with vLLM" in m]
    assert all(f"{k}=" in msg for k in tpu_only) and "host_memory_kind" not in msg, msg


def test_chunk_tokens_is_refused_where_vllm_reads_block_size():
    with pytest.raises(ConfigError, match="'chunk_tokens'.*allowed on vLLM: 'block_size'"):
        HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "chunk_tokens": 256}))


def test_a_write_back_lag_without_write_back_is_named(monkeypatch):
    import gpu_offload.vllm.spec as spec_mod

    seen = []
    monkeypatch.setattr(spec_mod.logger, "warning", lambda msg, *a: seen.append(msg % a))
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "fs_write_mode": "write_back", "fs_write_back_lag_s": 2}))
    assert not any("fs_write_back_lag_s" in m for m in seen)
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "fs_write_back_lag_s": 2}))  # write-through default
    assert any("fs_write_back_lag_s=2 is ignored" in m for m in seen)
