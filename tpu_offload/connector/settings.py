"""Resolves the typed config against the engine: chunk size, capacity, staging.

Both halves of the connector call ``resolve`` with the same inputs and must
agree on the slot count (the scheduler hands out slots the worker's slabs
hold), so sizes come only from the config and the engine's KV-cache spec,
never from anything process-local. ``cpu_bytes`` sizes the whole replica's
tier (all hosts together): with KV heads sharded over hosts, each host holds
``cpu_bytes / hosts``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping

from tpu_offload.connector import budget, compat, models, sizing, windows as sliding
from tpu_offload.core import step_budget
from tpu_offload.core.config import TPU, ConfigError, OffloadConfig
from tpu_offload.core.config_checks import check_extras, warn_ignored

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
    config: OffloadConfig
    block_size: int  # tokens per engine block
    blocks_per_chunk: int
    num_slots: int  # host-tier capacity in chunks
    chunk_bytes: int  # distinct bytes of one chunk across all layers and shards (0 if unknown)
    staging_blocks: int  # whole chunks' worth of blocks
    kv_replicas: int = 1  # times tpu-inference repeats each KV head (TP > KV heads); stored once
    hbm_utilization: float | None = None  # vLLM's gpu_memory_utilization: 1 - it stays the model's
    windows: sliding.Windows | None = None  # sliding-window layers offloaded by their window only
    # Per vLLM KV-cache group: its sliding window (None: full attention) and its layers. More than
    # one group: vLLM's hybrid KV-cache manager is on, each group has its own block table.
    group_windows: tuple[int | None, ...] = (None,)
    group_layers: tuple[tuple[str, ...], ...] = ()
    dp: int = 1  # attention-DP ranks (tpu-inference's DPScheduler): one scheduler each, one host tier
    # The per-step budget (core/step_budget.py) in blocks, each direction: loads and stores the scheduler
    # sends per step, and (as bytes per device) what the worker's pacer dispatches per step. 0: staging_blocks
    step_blocks: int = 0
    device_block_bytes: int = 0  # bytes one device holds of one block (0: unknown)

    @property
    def failures_by_request(self) -> bool:
        """Failed loads reported per request (``failed_recving``), not by block ids: several KV-cache
        groups (ids vLLM cannot map back), or DP ranks (each numbers its blocks from 0)."""
        return self.hybrid or self.dp > 1

    @property
    def step_budget_blocks(self) -> int:
        """Blocks per step and direction the scheduler sends (whole chunks, at least one, at most staging)."""
        return self.step_blocks or self.staging_blocks

    @property
    def step_budget_bytes(self) -> int:
        """Bytes per device and step each direction may move: the pacer's budget (the config's figure)."""
        return self.config.step_budget_bytes

    @property
    def hybrid(self) -> bool:
        return len(self.group_windows) > 1

    @property
    def full_group(self) -> int:
        """The first full-attention group: its block ids name a chunk's blocks."""
        return next(g for g, w in enumerate(self.group_windows) if w is None)

    @property
    def tail_blocks(self) -> int:
        """Blocks before a prefix's end whose sliding-window KV a hit needs (0: no windowed layers)."""
        return self.windows.tail_blocks(self.block_size) if self.windows is not None else 0

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def staging_chunks(self) -> int:
        return self.staging_blocks // self.blocks_per_chunk


def kv_bytes_per_block(kv_cache_config, vllm_config=None) -> int:
    """Bytes of one block over all layers, from vLLM's KV-cache spec (0 if unknown); see ``sizing``."""
    return 0 if kv_cache_config is None else sizing.check_views(kv_cache_config, vllm_config)


def resolve(vllm_config, kv_cache_config, env: Mapping[str, str] | None = None) -> Settings:
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    cfg = OffloadConfig.from_sources(extra, os.environ if env is None else env)
    warn_ignored(cfg, TPU, log)  # vLLM's own keys and tpu-inference's variables given here, in one line
    check_extras(cfg, TPU)  # snapshot_path without orbax: now, not at the first save at shutdown
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ConfigError(f"pipeline_parallel_size={parallel.pipeline_parallel_size}: KV offloading supports PP=1 only")
    # first: MLA also implies DP, this names the model
    why = compat.unsupported_runner_mode(vllm_config) or models.unsupported_model(vllm_config, kv_cache_config)
    if why is not None:
        raise ConfigError(why)
    dp, source = compat.data_parallel(vllm_config)
    if dp > 1:
        dp = compat.dp_scheduler_ranks(vllm_config)
        if dp is None:
            raise ConfigError(
                f"data parallelism ({source}) outside tpu-inference's sharding: the offload connector supports "
                "DP only as tpu-inference's DPScheduler runs it (sharding_config.total_dp_size, one engine). "
                "Let tpu-inference's platform configure it, or run one engine per DP rank")
        if not getattr(vllm_config.cache_config, "enable_prefix_caching", True):
            raise ConfigError(
                f"enable_prefix_caching=False with {dp} attention-DP ranks ({source}): tpu-inference's DPScheduler "
                "hides the connector from vLLM's EngineCore, which then hashes request blocks only with prefix "
                "caching on, so no chunk could be named. Turn prefix caching on to offload KV under DP attention")
        for key, value in (("shared_storage_path", cfg.shared_storage_path), ("snapshot_path", cfg.snapshot_path),
                           ("sync_load", cfg.sync_load),
                           ("store_policy", cfg.store_policy if cfg.store_policy == "exclusive" else None)):
            if value:  # exclusive: its eviction copies are not carried through DPScheduler's merge
                raise ConfigError(f"{key}={value!r} with {dp} attention-DP ranks ({source}): not supported yet "
                                  "under DP attention; allowed: the host tier alone (write_through), "
                                  "asynchronous loads")
    else:
        dp = 1
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
        log.warning(
            "kv_load_failure_policy=%r: a chunk that fails to load fails its request; set "
            '"kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute it instead',
            ktc.kv_load_failure_policy,
        )
    block_size = vllm_config.cache_config.block_size
    bpc = cfg.resolve_blocks_per_chunk(block_size)
    group_windows = compat.group_windows(kv_cache_config) if kv_cache_config is not None else (None,)
    windows = sliding.for_groups(group_windows, cfg, vllm_config)
    kv_replicas = compat.kv_head_replicas(vllm_config, kv_cache_config)
    chunk_bytes = kv_bytes_per_block(kv_cache_config, vllm_config) * bpc // kv_replicas  # each distinct head once
    if cfg.num_cpu_chunks is None and chunk_bytes == 0:
        raise ConfigError("cannot size the host tier in bytes without the KV-cache spec; set num_cpu_chunks "
                          "(TPU_OFFLOAD_NUM_CPU_CHUNKS)")
    num_slots = cfg.resolve_num_chunks(chunk_bytes or 1)
    if dp > 1:  # the one host tier is partitioned: each rank's scheduler owns num_slots / dp slots
        if num_slots < dp:
            raise ConfigError(f"the host tier holds {num_slots} chunks, fewer than the {dp} attention-DP ranks "
                              "that each need their own; raise cpu_bytes / num_cpu_chunks")
        num_slots -= num_slots % dp
    if cfg.staging_blocks < bpc:
        raise ConfigError(
            f"staging_blocks={cfg.staging_blocks} cannot hold one chunk of {bpc} blocks; raise "
            f"staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) to at least {bpc} or lower blocks_per_chunk"
        )
    staging_blocks = cfg.staging_blocks // bpc * bpc
    dev_block = budget.device_block_bytes(chunk_bytes, bpc, budget.chunk_devices(vllm_config, kv_replicas))
    step_blocks = step_budget.blocks(cfg.step_budget_bytes, dev_block, bpc, staging_blocks)
    return Settings(
        config=cfg, block_size=block_size, blocks_per_chunk=bpc, num_slots=num_slots,
        chunk_bytes=chunk_bytes, staging_blocks=staging_blocks, kv_replicas=kv_replicas,
        step_blocks=step_blocks, device_block_bytes=dev_block,
        hbm_utilization=getattr(vllm_config.cache_config, "gpu_memory_utilization", None),
        windows=windows, group_windows=group_windows,
        group_layers=tuple(tuple(g.layer_names) for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ()),
        dp=dp,
    )
