"""Settings that mean one thing: one scope each, one name per variable, units that are not guesses.

Each rule of docs/reference/settings.md has a test here; the page itself is checked against the
code by tests/docs/test_reference_pages.py.
"""

from __future__ import annotations

import logging

import pytest

from tpu_offload.core import config as C
from tpu_offload.core.config import BOTH, TPU, VLLM, ConfigError, OffloadConfig, ignored_settings, warn_ignored


def test_every_setting_has_one_scope_and_a_meaning():
    for s in C._SETTINGS:
        assert s.scope in (TPU, VLLM, BOTH), f"{s.field}: declare scope=TPU, VLLM or BOTH in core/config.py"
        assert s.doc.strip().endswith("."), f"{s.field}: give doc=, one sentence of meaning"
    by_field: dict[str, set] = {}
    for s in C._SETTINGS:
        by_field.setdefault(s.field, set()).add(s.scope)
    assert all(len(v) == 1 for v in by_field.values()), by_field


def test_variable_names_follow_keys():
    """TPU_OFFLOAD_ + the canonical key, upper-cased; older spellings stay readable as aliases."""
    for s in C._SETTINGS:
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
                                    ("512MB", 512 * 10**6), ("720GiB", 720 << 30), ("720G", 720 << 30),
                                    ("2Ti", 2 << 40), ("4KB", 4000), ("4KiB", 4096)])
def test_decimal_and_binary_units(text, n):
    assert OffloadConfig.from_sources({"cpu_bytes": text}, env={}).cpu_bytes == n
    assert C.parse_size(text) == n


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
                 "host_memory_margin", "TPU_OFFLOAD_SAVE_THREADS"):
        assert sum(name in i for i in items) == 1, (name, items)
    assert not any(i.startswith(("num_cpu_chunks", "chunk_tokens")) for i in items)
    assert ignored_settings(OffloadConfig.from_sources({**extra, "store_policy": "write_through",
                                                        "transfer_path": "auto"}, env={}), VLLM) == [
        i for i in items if not i.startswith(("store_policy", "transfer_path", "environment"))]
    log = logging.getLogger("test_settings_rules")
    with caplog.at_level(logging.WARNING, logger=log.name):
        msg = warn_ignored(cfg, VLLM, log)
        warn_ignored(cfg, VLLM, log)  # the scheduler and each worker resolve the same config
    assert [r.getMessage() for r in caplog.records] == [msg]
    assert msg.startswith("7 setting(s) have no effect with vLLM: ") and "store_policy='exclusive'" in msg


def test_tpu_names_vllm_keys_it_does_not_read():
    cfg = OffloadConfig.from_sources({"num_cpu_chunks": 4, "eviction_policy": "lru", "offload_prompt_only": False},
                                     env={"TPU_OFFLOAD_BLOCK_SIZE_BUCKETS": "1,2"})
    items = ignored_settings(cfg, TPU)
    assert len(items) == 3 and any("'eviction_policy'" in i for i in items), items
    assert ignored_settings(OffloadConfig.from_sources({"num_cpu_chunks": 4, "store_policy": "exclusive"}, env={}),
                            TPU) == []
