"""``TPUOffloadConnector``: the vLLM ``KVConnectorBase_V1`` tpu-inference loads.

tpu-inference's platform accepts only a few connector *class names*, so the
class carries the built-in one's name while living in our module:
``{"kv_connector": "TPUOffloadConnector", "kv_connector_module_path":
"tpu_offload.connector"}``. The scheduler role runs ``OffloadScheduler``,
the worker role ``OffloadWorker``; this class only routes calls.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tpu_offload.connector import compat, dp
from tpu_offload.connector.compat import KVConnectorBase_V1, KVConnectorRole
from tpu_offload.connector.guard import Guard
from tpu_offload.connector.metadata import OffloadMetadata, OffloadReport
from tpu_offload.connector.metrics import ConnectorMetrics
from tpu_offload.connector.settings import resolve
from tpu_offload.connector.stats import OffloadStats

log = logging.getLogger(__name__)


class TPUOffloadConnector(KVConnectorBase_V1, compat.SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = resolve(vllm_config, kv_cache_config)
        metrics = ConnectorMetrics.get()
        fp = None
        cfg = self.settings.config
        if cfg.shared_storage_path or cfg.snapshot_path:
            from tpu_offload.connector.fs import fingerprint

            fp = fingerprint(vllm_config, kv_cache_config, self.settings.blocks_per_chunk)
        self.scheduler = self.worker = None
        self._dp = None  # DP attention, worker half: connector/dp.py's Unwrapper (made at registration)
        if role == KVConnectorRole.SCHEDULER:
            from tpu_offload.connector.scheduler import OffloadScheduler

            fs = None
            if cfg.shared_storage_path:
                from tpu_offload.connector.fs import FsLookup

                fs = FsLookup(self.settings.config, fp)
            settings = self.settings
            if settings.dp > 1:  # this rank's scheduler owns its share of the one host tier
                settings = dataclasses.replace(settings, num_slots=settings.num_slots // settings.dp)
            self.scheduler = OffloadScheduler(settings, metrics, fs=fs, fingerprint=fp)
            if settings.dp > 1:
                self.scheduler.shared = dp.SharedIndex(self.settings.num_slots)
            if cfg.shared_storage_path or cfg.snapshot_path:
                compat.install_executor_flush()  # Ray workers are killed, never shut down: flush them first
        else:
            from tpu_offload.connector.worker import OffloadWorker  # imports jax

            self.worker = OffloadWorker(self.settings, metrics, fs_fingerprint=fp)  # also the snapshot's
        # Every save, load and completion path below runs through it: no exception reaches the engine step.
        self.guard = self.worker.guard if self.worker is not None else Guard(metrics)

    # ---- class-level contract ---------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return "NHD"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats.from_data(data)

    # ---- scheduler side ------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.guard.lookup(self.scheduler, request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.guard.after_alloc(self.scheduler, request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        if not num_external_tokens or compat.HIT_HOST is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        disk = min(num_external_tokens, self.guard.call("file_hit_tokens", self.scheduler.file_hit_tokens,
                                                         request.request_id, default=0))
        hbm = min(num_external_tokens - disk, self.guard.call("hbm_hit_tokens", self.scheduler.hbm_hit_tokens,
                                                              request.request_id, default=0))
        out = {compat.HIT_HOST: num_external_tokens - disk - hbm, compat.HIT_DISK: disk, compat.HIT_DEVICE: hbm}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output) -> OffloadMetadata:
        meta = self.guard.build_meta(self.scheduler, scheduler_output)
        return dp.wrap(meta) if self.settings.dp > 1 else meta

    def update_connector_output(self, connector_output) -> None:
        self.guard.call("update_connector_output", self._update_connector_output, connector_output)

    def _update_connector_output(self, connector_output) -> None:
        if self.settings.dp > 1:  # every rank gets every rank's finished requests and stored chunks
            dp.keep_own(connector_output, self.scheduler.kv_cache_manager)
            raw = compat.extract_report(connector_output)
            if raw is not None:
                self.scheduler.shared.apply(OffloadReport.coerce(raw))
        self.scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.guard.request_finished(self.scheduler, request, block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Finished sends and receives, and (several KV-cache groups) the requests whose load failed."""
        results = super().get_transfer_results(finished_req_ids)
        if self.worker is not None:
            results.failed_recving = self.guard.call("take_failed_recving", self.worker.take_failed_recving,
                                                     default=set())
        return results

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.guard.request_finished(self.scheduler, request, block_ids)

    def take_events(self):
        if self.scheduler is None:
            return ()
        return self.guard.call("take_events", self.scheduler.take_events, default=())

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping while stores are in flight, so their
        # completions are collected even when no request is running.
        return self.scheduler is not None and bool(
            self.guard.call("has_pending_push_work", self.scheduler.has_pending_work, default=False))

    def get_finished_count(self) -> int | None:
        """Reports per request vLLM's aggregator must wait for: one per JAX process (host), not per chip."""
        n = compat.reporting_workers(self._vllm_config)
        if self.scheduler is not None:
            self.scheduler.expected_procs = n
        return n

    def reset_cache(self) -> bool | None:
        if self.scheduler is None:
            return None
        return self.guard.call("reset_cache", self._reset_cache, default=False)

    def _reset_cache(self) -> bool:
        if self.scheduler.shared is not None:  # every rank resets: no rank's chunk may come back
            self.scheduler.shared.clear()
        return self.scheduler.reset_cache()

    # ---- worker side ---------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        """Not used on TPU: tpu-inference calls ``register_runner`` instead."""

    def register_runner(self, runner) -> None:
        self.worker.register_runner(runner)
        if self.settings.dp > 1:
            self._dp = dp.Unwrapper(self.settings.dp, self.worker.engine.layout.num_blocks, self.settings.num_slots)
            self._dp.metrics = self.worker.metrics

    def _worker_meta(self):
        meta = self._get_connector_metadata()
        return self._dp(meta) if self._dp is not None else meta

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:  # before the forward (start_load_kv may come after it)
            self.guard.early_save(self.worker, self._worker_meta())

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.guard.start_load(self.worker, self._worker_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-model; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Stores run once per step in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        self.guard.save(self.worker, self._worker_meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.guard.finished(self.worker)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        return self.guard.load_errors(self.worker)

    def build_connector_worker_meta(self):
        if self.worker is None or not compat.HAS_WORKER_META:
            return None
        return self._take_report()

    def _take_report(self):
        report = self.guard.report(self.worker)
        return self._dp.localize(report) if self._dp is not None else report

    def get_kv_connector_stats(self) -> OffloadStats | None:
        return self.guard.call("get_kv_connector_stats", self._stats)

    def _stats(self) -> OffloadStats | None:
        if self.scheduler is not None:
            return self.scheduler.get_stats()
        stats = self.worker.get_stats()
        if not compat.HAS_WORKER_META:  # old vLLM: completions ride in the stats
            report = self._take_report()
            if report is not None:
                stats = stats or OffloadStats()
                stats.data[compat.STATS_REPORT_KEY] = report.to_dict()
        return stats

    def get_kv_connector_kv_cache_events(self):
        """Events come from the scheduler's index (``take_events``): it is the truth about the tier."""
        return None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            compat.shutdown_worker_half(self)  # tpu-inference's worker never shuts it down
            self.scheduler.shutdown()
