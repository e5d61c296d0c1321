"""Settings that mean one thing: one scope each, one name per variable, units that are not guesses.

Each rule of docs/reference/settings.md has a test here; the page itself is checked against the
code by tests/docs/test_reference_pages.py.
"""

from __future__ import annotations

import logging

import pytest

from tpu_offload.core import config as C
from tpu_offload.core import config_checks as CC
from tpu_offload.core.config import BOTH, TPU, VLLM, ConfigError, OffloadConfig
from tpu_offload.core.config_checks import ignored_settings, warn_ignored


def test_every_setting_has_one_scope_and_a_meaning():
    for s in C.SETTINGS:
        assert s.scope in (TPU, VLLM, BOTH), f"{s.field}: declare scope=TPU, VLLM or BOTH in core/settings.py"
        assert s.doc.strip().endswith("."), f"{s.field}: give doc=, one sentence of meaning"
    by_field: dict[str, set] = {}
    for s in C.SETTINGS:
        by_field.setdefault(s.field, set()).add(s.scope)
    assert all(len(v) == 1 for v in by_field.values()), by_field


def test_variable_names_follow_keys():
    """TPU_OFFLOAD_ + the canonical key, upper-cased; older spellings stay readable as aliases."""
    for s in C.SETTINGS:
        if s.env and s.keys:
            assert s.env == "TPU_OFFLOAD_" + s.keys[0].upper(), (s.env, s.keys[0])
    env = {"TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64", "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1",
           "TPU_OFFLOAD_FS_CAPACITY": "1GiB"}
    old = OffloadConfig.from_sources({}, env=env)
    new = OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_STAGING_BLOCKS": "64", "TPU_OFFLOAD_SKIP_PRECOMPILE": "1",
                                              "TPU_OFFLOAD_FS_CAPACITY_BYTES": "1GiB"})
    assert old == new and (old.staging_blocks, old.skip_precompile, old.fs_capacity_bytes) == (64, True, 1 << 30)
    with pytest.raises(ConfigError, match="TPU_OFFLOAD_NUM_STAGING_BLOCKS.*TPU_OFFLOAD_STAGING_BLOCKS.*set only one"):
        OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_NUM_STAGING_BLOCKS": "64", "TPU_OFFLOAD_STAGING_BLOCKS": "8"})


def test_chunk_tokens_is_block_size_in_extra_config():
    """'block_size' in kv_connector_extra_config is tokens per chunk (vLLM's name), never the engine's block."""
    assert OffloadConfig.from_sources({"chunk_tokens": 256}, env={}).resolve_blocks_per_chunk(16) == 16
    assert OffloadConfig.from_sources({"block_size": 256}, env={}).resolve_blocks_per_chunk(16) == 16
    with pytest.raises(ConfigError, match="set only one"):
        OffloadConfig.from_sources({"block_size": 256, "chunk_tokens": 256}, env={})


@pytest.mark.parametrize("text,n", [("720GB", 720 * 10**9), ("2TB", 2 * 10**12), ("1.5 GB", 1_500_000_000),
                                    ("512MB", 512 * 10**6), ("720GiB", 720 << 30), ("720gib", 720 << 30),
                                    ("2Ti", 2 << 40), ("4KB", 4000), ("4KiB", 4096), ("16Gi", 16 << 30)])
def test_decimal_and_binary_units(text, n):
    assert OffloadConfig.from_sources({"cpu_bytes": text}, env={}).cpu_bytes == n
    assert C.parse_size(text) == n


@pytest.mark.parametrize("text,meant", [("720G", "720GiB or 720GB"), ("1.5t", "1.5TiB or 1.5TB"),
                                        ("64 M", "64MiB or 64MB"), ("4K", "4KiB or 4KB")])
@pytest.mark.parametrize("key,env", [("cpu_bytes", "TPU_OFFLOAD_CPU_BYTES"),
                                     ("fs_capacity_bytes", "TPU_OFFLOAD_FS_CAPACITY_BYTES"),
                                     ("host_memory_margin", "TPU_OFFLOAD_HOST_MEMORY_MARGIN"),
                                     ("transfer_piece_bytes", "TPU_OFFLOAD_TRANSFER_PIECE_BYTES")])
def test_a_bare_unit_is_refused_with_both_readings(text, meant, key, env):
    """dd reads '720G' as 720 GiB, Kubernetes (memory: 720G) as 720x10**9: 49 GiB apart, so neither is guessed."""
    for extra, environ, name in (({key: text}, {}, f"key {key!r}"), ({}, {env: text}, env)):
        with pytest.raises(ConfigError) as e:
            OffloadConfig.from_sources(extra, env=environ)
        msg = str(e.value)
        assert name in msg and repr(text) in msg and f"did you mean {meant}?" in msg, msg
    with pytest.raises(ValueError, match=f"did you mean {meant}"):  # the tpu-offload-fs CLI's --budget
        C.parse_size(text)


def test_contradictions_within_one_source_name_both():
    """Two settings that cannot both hold are one error naming both, with their values and sources."""
    cases = [
        ({}, {"TPU_OFFLOAD_HOST_MEMORY_KIND": "pinned_host", "TPU_OFFLOAD_USE_UNPINNED_HOST": "1"},
         ["TPU_OFFLOAD_HOST_MEMORY_KIND='pinned_host'", "TPU_OFFLOAD_USE_UNPINNED_HOST='1'", "contradict"]),
        ({}, {"TPU_OFFLOAD_HOST_MEMORY_KIND": "unpinned_host", "TPU_OFFLOAD_USE_UNPINNED_HOST": "no"},
         ["TPU_OFFLOAD_HOST_MEMORY_KIND='unpinned_host'", "TPU_OFFLOAD_USE_UNPINNED_HOST='no'"]),
        ({"snapshot_path": "/mnt/snap", "transfer_path": "device_put"}, {},
         ["snapshot_path='/mnt/snap'", "transfer_path='device_put'", "contradict"]),
    ]
    for extra, env, parts in cases:
        with pytest.raises(ConfigError) as e:
            OffloadConfig.from_sources(extra, env=env)
        msg = str(e.value)
        assert all(p in msg for p in parts) and "allowed" in msg, (parts, msg)
    # the same names agreeing are fine
    both = {"TPU_OFFLOAD_HOST_MEMORY_KIND": "unpinned_host", "TPU_OFFLOAD_USE_UNPINNED_HOST": "1"}
    assert OffloadConfig.from_sources({}, env=both).host_memory_kind == "unpinned_host"
    # the in-flight bound is accepted and named as doing nothing (the per-step budget bounds a forward's wait)
    cfg = OffloadConfig.from_sources({"transfer_piece_bytes": "32MiB", "transfer_inflight_bytes": "16MiB"}, env={})
    assert "transfer_inflight_bytes" in CC.inert_settings(cfg, TPU)


@pytest.mark.parametrize("engine", [TPU, VLLM])
def test_settings_without_effect_here_are_named_with_why(engine, caplog):
    """File-tier settings without shared_storage_path, a write-back lag under write_through, a bias without
    load_decision auto: each named once at start, with why; a setting that acts is not."""
    extra = {"num_cpu_chunks": 4, "fs_threads": 4, "fs_capacity_bytes": "1TiB", "fs_write_mode": "write_back",
             "load_decision": "always", "load_decision_bias": 2}
    items = ignored_settings(OffloadConfig.from_sources(extra, env={}), engine)
    for field in ("fs_threads", "fs_capacity_bytes", "fs_write_mode"):
        (item,) = [i for i in items if i.startswith(field + "=")]
        assert f"key '{field}': no file tier: shared_storage_path is unset" in item, item
    (bias,) = [i for i in items if i.startswith("load_decision_bias=")]
    assert "load_decision is always" in bias
    with_tier = {"num_cpu_chunks": 4, "shared_storage_path": "/mnt/kv", "fs_allow_unauthenticated": True,
                 "fs_threads": 4, "fs_write_back_lag_s": 2, "load_decision": "auto", "load_decision_bias": 2}
    items = ignored_settings(OffloadConfig.from_sources(with_tier, env={}), engine)
    assert len(items) == 1 and "fs_write_back_lag_s=2.0" in items[0] and "fs_write_mode is write_through" in items[0]
    log = logging.getLogger("test_settings_rules.inert")
    with caplog.at_level(logging.WARNING, logger=log.name):
        warn_ignored(OffloadConfig.from_sources({**with_tier, "fs_mac": "gmac", "fs_threads": 5}, env={}), engine, log)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "fs_mac='gmac'" in msg and "no secret: chunks are not signed" in msg and "fs_threads" not in msg


def test_pacing_settings_do_nothing_without_pacing():
    """Pieces only matter when paced; the per-step budget (bandwidth, stall) also bounds what the scheduler
    sends, so it acts with pacing off too."""
    cfg = OffloadConfig.from_sources({"transfer_pacing": "off", "transfer_piece_bytes": "8MiB",
                                      "transfer_stall_ms": 5, "sliding_window": "all",
                                      "window_every_chunks": 4}, env={})
    items = ignored_settings(cfg, TPU)
    assert any(i.startswith("transfer_piece_bytes=8388608") and "transfer_pacing is off" in i for i in items), items
    assert not any(i.startswith("transfer_stall_ms") for i in items), items
    assert any(i.startswith("window_every_chunks=4") and "sliding_window is all" in i for i in items), items
    assert ignored_settings(OffloadConfig.from_sources({"transfer_stall_ms": 5}, env={}), TPU) == []


def test_snapshot_path_needs_orbax_at_start(monkeypatch):
    """Refused at start naming the extra, not at the first save at shutdown; found without importing it."""
    import importlib.util

    cfg = OffloadConfig.from_sources({"snapshot_path": "/mnt/snap"}, env={})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("orbax") else real(name, *a))
    with pytest.raises(ConfigError) as e:
        CC.check_extras(cfg, TPU)
    msg = str(e.value)
    assert "snapshot_path='/mnt/snap'" in msg and "orbax-checkpoint" in msg and "[tpu]" in msg, msg
    CC.check_extras(cfg, VLLM)  # vLLM never saves one (snapshot_path is named as TPU-only instead)
    CC.check_extras(OffloadConfig.from_sources({}, env={}), TPU)
    monkeypatch.undo()
    assert CC.missing_extras(cfg, TPU) == []  # where it is installed


def test_vllm_names_each_of_its_own_keys_our_spec_ignores():
    """vLLM 0.32's CPUOffloadingSpec/TieringOffloadingSpec keys pass through and do nothing with our spec."""
    ignored = {"eviction_policy": "arc", "cache_policy_module_path": "x.y", "store_threshold": 2,
               "max_tracker_size": 10, "secondary_tiers": [], "backpressure": {}, "canonical_layout": True}
    read = {"spec_name": "HostOffloadSpec", "spec_module_path": "gpu_offload.spec", "offload_prompt_only": True,
            "self_describing_kv_events": True}
    assert set(ignored) == set(C.VLLM_KEYS_IGNORED) and set(read) == set(C.VLLM_KEYS_READ)
    cfg = OffloadConfig.from_sources({"num_cpu_chunks": 4, **ignored, **read}, env={})
    items = ignored_settings(cfg, VLLM)
    for key in ignored:
        assert sum(f"key {key!r}" in i for i in items) == 1, (key, items)
    assert not any(f"key {key!r}" in i for key in read for i in items), items
    assert len(ignored_settings(cfg, TPU)) == len(ignored) + len(read)  # the TPU connector reads none


@pytest.mark.parametrize("bare", [1, 5, 50, 100, "5", " 10 ", 5.0])
def test_bare_margin_from_1_to_100_is_refused(bare):
    for extra, env in (({"host_memory_margin": bare}, {}), ({}, {"TPU_OFFLOAD_HOST_MEMORY_MARGIN": str(bare)})):
        with pytest.raises(ConfigError) as e:
            OffloadConfig.from_sources(extra, env=env)
        msg = str(e.value)
        assert "ambiguous" in msg and "'10%'" in msg and "'16GiB'" in msg and "host_memory_margin" in msg.lower(), msg


@pytest.mark.parametrize("value,parsed", [(0, 0.0), (0.05, 0.05), ("5%", 0.05), ("16GiB", 16 << 30),
                                          (101, 101), (17179869184, 17179869184)])
def test_margin_forms_allowed(value, parsed):
    assert OffloadConfig.from_sources({"host_memory_margin": value}, env={}).host_memory_margin == parsed


@pytest.mark.parametrize("key", ["block_buckets", "save_threads", "metrics_interval_s", "batched_save"])
def test_settings_that_did_nothing_are_gone(key):
    with pytest.raises(ConfigError, match="is unknown"):
        OffloadConfig.from_sources({key: 1}, env={})


def test_vllm_names_each_ignored_tpu_setting_once(caplog):
    extra = {"num_cpu_chunks": 4, "store_policy": "exclusive", "transfer_path": "program", "sliding_window": "all",
             "decode_save": True, "load_bandwidth_gbps": 10, "host_memory_margin": "1GiB", "block_size": 256}
    env = {"TPU_OFFLOAD_SAVE_THREADS": "4"}
    cfg = OffloadConfig.from_sources(extra, env=env)
    items = ignored_settings(cfg, VLLM)
    for name in ("store_policy", "transfer_path", "sliding_window", "decode_save", "load_bandwidth_gbps",
                 "TPU_OFFLOAD_SAVE_THREADS"):
        assert sum(name in i for i in items) == 1, (name, items)
    assert not any(i.startswith(("num_cpu_chunks", "chunk_tokens", "host_memory_margin")) for i in items)
    assert ignored_settings(OffloadConfig.from_sources({**extra, "store_policy": "write_through",
                                                        "transfer_path": "auto"}, env={}), VLLM) == [
        i for i in items if not i.startswith(("store_policy", "transfer_path", "environment"))]
    log = logging.getLogger("test_settings_rules")
    with caplog.at_level(logging.WARNING, logger=log.name):
        msg = warn_ignored(cfg, VLLM, log)
        warn_ignored(cfg, VLLM, log)  # the scheduler and each worker resolve the same config
    assert [r.getMessage() for r in caplog.records] == [msg]
    assert msg.startswith("6 setting(s) have no effect with vLLM: ") and "store_policy='exclusive'" in msg


def test_tpu_names_vllm_keys_it_does_not_read():
    cfg = OffloadConfig.from_sources({"num_cpu_chunks": 4, "eviction_policy": "lru", "offload_prompt_only": False},
                                     env={"TPU_OFFLOAD_BLOCK_SIZE_BUCKETS": "1,2"})
    items = ignored_settings(cfg, TPU)
    assert len(items) == 3 and any("'eviction_policy'" in i for i in items), items
    assert ignored_settings(OffloadConfig.from_sources({"num_cpu_chunks": 4, "store_policy": "exclusive"}, env={}),
                            TPU) == []
