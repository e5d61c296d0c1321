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
                "transfer_path": "program", "sliding_window": "all", "decode_save": True, "load_bandwidth_gbps": 9}
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, **tpu_only}))
    (msg,) = [m for m in seen if "no effect with vLLM" in m]
    # Each named as given (an alias such as load_bandwidth_gbps under the setting it sets, with its key).
    assert all(f"{k}=" in msg or f"key '{k}'" in msg for k in tpu_only) and "host_memory_kind" not in msg, msg


def test_chunk_tokens_is_refused_where_vllm_reads_block_size():
    with pytest.raises(ConfigError, match="'chunk_tokens'.*allowed on vLLM: 'block_size'"):
        HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "chunk_tokens": 256}))


def test_a_write_back_lag_without_write_back_is_named(monkeypatch, tmp_path):
    import gpu_offload.vllm.spec as spec_mod

    seen = []
    monkeypatch.setattr(spec_mod.logger, "warning", lambda msg, *a: seen.append(msg % a))
    tier = {"num_cpu_chunks": 4, "shared_storage_path": str(tmp_path), "fs_allow_unauthenticated": True}
    HostOffloadSpec(offloading_config({**tier, "fs_write_mode": "write_back", "fs_write_back_lag_s": 2}))
    assert not any("fs_write_back_lag_s" in m for m in seen)
    HostOffloadSpec(offloading_config({**tier, "fs_write_back_lag_s": 2}))  # write-through default
    assert any("fs_write_back_lag_s=2.0" in m and "fs_write_mode is write_through" in m for m in seen), seen
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "fs_threads": 3}))  # no file tier at all
    assert any("fs_threads=3" in m and "shared_storage_path is unset" in m for m in seen), seen


def test_vllm_keys_our_spec_ignores_are_named_at_start(monkeypatch):
    """vLLM's own CPUOffloadingSpec/TieringOffloadingSpec keys do nothing with ours: one warning names each."""
    import gpu_offload.vllm.spec as spec_mod

    seen = []
    monkeypatch.setattr(spec_mod.logger, "warning", lambda msg, *a: seen.append(msg % a))
    HostOffloadSpec(offloading_config({"num_cpu_chunks": 4, "eviction_policy": "arc", "store_threshold": 2,
                                       "secondary_tiers": [{"type": "fs"}], "canonical_layout": True,
                                       "offload_prompt_only": True}))
    (msg,) = [m for m in seen if "no effect with vLLM" in m]
    for key in ("eviction_policy", "store_threshold", "secondary_tiers", "canonical_layout"):
        assert f"key {key!r}" in msg, msg
    assert "offload_prompt_only" not in msg and "spec_name" not in msg  # vLLM reads these for our spec too


# ---- host memory: refused with the figures before the slab is allocated -------------------------------


def _host(available_gib: float, limit_gib: float | None = None, total_gib: float = 64):
    from tpu_offload.core.hostmem import HostMemory

    gib = 1 << 30
    kw = dict(cgroup="/kubepods/pod", cgroup_limit=int(limit_gib * gib), cgroup_usage=gib) if limit_gib else {}
    return HostMemory(mem_total=int(total_gib * gib), mem_available=int(available_gib * gib), **kw)


class Allocated(Exception):
    """Raised where the worker would allocate its slab: every check before it passed."""


def _allocate(cls, *a, **k):
    raise Allocated


def test_a_tier_the_host_cannot_hold_is_refused_before_allocation(monkeypatch):
    from tpu_offload.core import hostmem

    import gpu_offload.vllm.spec as spec_mod
    from gpu_offload.vllm.worker import HostOffloadWorker

    monkeypatch.setattr(HostOffloadWorker, "from_canonical", classmethod(_allocate))
    chunk = PAGE * LAYERS  # 256 KiB per worker and chunk
    monkeypatch.setattr(hostmem, "read_host_memory", lambda: _host(60, limit_gib=3))  # a 3 GiB pod
    spec = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 4096 * chunk}, bytes_per_block=chunk))  # 1 GiB
    with pytest.raises(Allocated):  # fits: 3 GiB - 1 GiB used - 5% of 3 GiB
        spec.get_worker(canonical())
    spec = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 3 * 4096 * chunk}, bytes_per_block=chunk))
    with pytest.raises(ConfigError) as e:
        spec.get_worker(canonical())
    msg = str(e.value)
    assert "host tier needs 3.00 GiB of host memory in this worker (rank 0)" in msg, msg
    assert "cgroup /kubepods/pod: limit 3.00 GiB, 1.00 GiB in use" in msg and "MemAvailable 60.00 GiB" in msg
    assert "host_memory_margin=0.05" in msg and "Lower cpu_bytes_to_use" in msg
    spec = HostOffloadSpec(offloading_config({"cpu_bytes_to_use": 3 * 4096 * chunk, "host_memory_margin": 0},
                                             bytes_per_block=chunk))
    with pytest.raises(ConfigError, match="only 2.00 GiB may be used"):
        spec.get_worker(canonical())
    assert spec_mod.HostOffloadSpec is HostOffloadSpec


def test_the_workers_of_one_host_are_checked_together(monkeypatch):
    """TP=4 on one host: each worker's 1 GiB fits alone, four do not fit what the host had before any allocated."""
    from tpu_offload.core import hostmem

    import gpu_offload.vllm.spec as spec_mod
    from gpu_offload.vllm.worker import HostOffloadWorker

    monkeypatch.setattr(HostOffloadWorker, "from_canonical", classmethod(_allocate))
    monkeypatch.setattr(hostmem, "read_host_memory", lambda: _host(3.5, total_gib=4))  # 5%: 0.2 GiB kept
    monkeypatch.setattr(spec_mod, "local_workers", lambda: 4)
    chunk = PAGE * LAYERS
    extra = {"cpu_bytes_to_use": 4 * 4096 * chunk}  # 4 GiB over 4 workers
    spec = HostOffloadSpec(offloading_config(extra, bytes_per_block=chunk, world_size=4, rank=2))
    monkeypatch.setattr(hostmem, "read_host_memory", lambda: _host(1.5, total_gib=4))  # the others' slabs since
    with pytest.raises(ConfigError) as e:
        spec.get_worker(canonical())
    msg = str(e.value)
    assert "needs 4.00 GiB of host memory on this host (4 workers of 1.00 GiB each)" in msg, msg
    assert "MemAvailable 3.50 GiB" in msg and "num_cpu_chunks from 4096 to 3379" in msg, msg
    monkeypatch.setattr(spec_mod, "local_workers", lambda: 1)  # one worker per host (multi-node)
    with pytest.raises(Allocated):
        HostOffloadSpec(offloading_config(extra, bytes_per_block=chunk, world_size=4, rank=2)).get_worker(canonical())
