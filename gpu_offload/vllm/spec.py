"""``HostOffloadSpec``: our host tier as a vLLM ``OffloadingSpec``.

Select it with::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"spec_name":"HostOffloadSpec",
        "spec_module_path":"gpu_offload.spec","cpu_bytes_to_use":68719476736}}'

``kv_load_failure_policy`` must be ``"recompute"``: a chunk that cannot be
loaded (failed transfer, slot whose store failed) is then recomputed; with
vLLM's default ``"fail"`` the request fails instead (never wrong KV either way).

Sizing and tensor parallelism. ``cpu_bytes_to_use`` (or ``cpu_bytes`` /
``cpu_gib`` / ``TPU_OFFLOAD_CPU_BYTES``) is the host budget of the whole
engine, as for vLLM's own CPU spec and ``--kv-offloading-size``: with TP=N
each worker allocates ``cpu_bytes / N`` for its own KV shard. A chunk on one
worker is ``worker_kv_bytes_per_block * blocks_per_chunk`` bytes, rounded up
to 4 KiB; every worker has the same number of slots, which is the manager's
capacity. ``num_cpu_chunks`` sets that slot count directly instead.
``blocks_per_chunk`` / ``block_size`` are read by vLLM itself; the spec only
checks that our config agrees.

The spec object exists once in the scheduler process (``get_manager``) and
once per worker (``get_worker``); the API server only calls the classmethods.

File tier: with ``shared_storage_path`` every worker puts a ``FileTier``
under its host slab (its own per-rank namespace; ``fs_write_mode``
``write_through`` (default: other replicas see a chunk as soon as it is
written) or ``write_back`` (written within ``fs_write_back_lag_s``, on
eviction, and at shutdown)) and does all file I/O; the manager only checks
which chunk files exist (``FileView``) and asks the workers to promote them.
See ``torch_backend.fs_link`` and ``fs_specs``.

We subclass vLLM's ``CPUOffloadingSpec`` (skipping its ``__init__``: nothing
of its host buffer is used) only because vLLM feeds the ``vllm:kv_offload_*``
series users check (``total_bytes``, ``total_time``, ``size``, by
``transfer_type`` CPU_to_GPU / GPU_to_CPU) for that class alone; their
meaning is ours: bytes between device and host RAM.

Building the spec (not importing this module) checks the installed vLLM and
puts our remaining patches of vLLM's ``OffloadingConnector`` in place
(``patches``: load-error reporting, worker reports, interleaved device
lookups, one offloading engine per process; the table with the reasons is in
``docs/vllm.md``). A vLLM whose connector no longer matches them is refused
there, with one error.
"""

from __future__ import annotations

import weakref
from typing import Any

from tpu_offload.core import hostmem
from tpu_offload.core.config import VLLM, ConfigError, OffloadConfig
from tpu_offload.core.config_checks import warn_ignored
from tpu_offload.core.pool import PAGE

from gpu_offload._log import get_logger
from gpu_offload.vllm import hooks, metrics, patches
from gpu_offload.vllm.compat import HostSpecBase, OffloadingSpec, current_load_failure_policy, local_workers
from gpu_offload.vllm.file_events import FileEvents

logger = get_logger(__name__)

class HostOffloadSpec(HostSpecBase):
    # Managers and workers alive in this process: how gpu_offload.testing finds
    # an in-process engine's parts (weak: never keeps an engine alive).
    live_parts: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        """vLLM calls this when an engine creates its offloading metrics: the
        moment to release names an earlier engine of this process registered."""
        metrics.release_prometheus_names()
        return metrics.metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any] | None = None) -> tuple[str, ...]:
        return metrics.CONFIG_INFO_KEYS

    def __init__(self, config):
        patches.install()  # first: a vLLM we do not match is refused before anything else happens
        OffloadingSpec.__init__(self, config)  # not CPUOffloadingSpec's: no vLLM host buffer
        if "chunk_tokens" in self.extra_config:  # vLLM sized its chunks before this spec exists
            raise ConfigError(
                f"kv_connector_extra_config key 'chunk_tokens' (value {self.extra_config['chunk_tokens']!r}) is "
                "not read by vLLM, which sizes chunks itself; allowed on vLLM: 'block_size' (tokens per chunk, "
                "vLLM's name for chunk_tokens) or 'blocks_per_chunk'")
        self.offload_config = OffloadConfig.from_sources(dict(self.extra_config))
        oc = self.offload_config
        self.tokens_per_block_0 = config.groups[0].tokens_per_block if config.groups else 0
        if self.tokens_per_block_0:
            ours = oc.resolve_blocks_per_chunk(self.tokens_per_block_0)
            if ours != self.blocks_per_chunk:
                raise ConfigError(
                    f"chunk size: vLLM uses blocks_per_chunk={self.blocks_per_chunk} (from "
                    f"kv_connector_extra_config) but the tpu_offload config resolves {ours} "
                    f"(TPU_OFFLOAD_BLOCKS_PER_CHUNK?); set the chunk size only in kv_connector_extra_config"
                )
        self.world_size = max(1, config.parallel.world_size)
        self.worker_chunk_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_chunks = 0
        if self.worker_chunk_bytes > 0:
            stride = -(-self.worker_chunk_bytes // PAGE) * PAGE
            self.num_chunks = oc.resolve_num_chunks(stride * self.world_size)
        elif oc.num_cpu_chunks is None and oc.cpu_bytes is None:
            oc.resolve_num_chunks(1)  # raises the "no host-tier size" ConfigError
        self._manager = None
        self._worker = None
        # This host's memory before any worker of this engine allocated its slab: every worker builds its spec
        # when vLLM creates its connector, before it allocates KV caches and registers them (get_worker).
        self._local_workers = local_workers()
        self._host_at_start = hostmem.read_host_memory() if self._local_workers > 1 else None
        self._warn_about_config()

    def _warn_about_config(self) -> None:
        policy = current_load_failure_policy()
        if policy is not None and policy != "recompute":
            logger.warning(
                "kv_load_failure_policy=%r: a host-tier chunk that fails to load will fail its "
                "request; set \"kv_load_failure_policy\":\"recompute\" to recompute it instead", policy,
            )
        # In one line: every TPU-only setting given, every setting this configuration leaves without effect,
        # and each of vLLM's own keys only its own specs read (canonical_layout, eviction_policy, ...).
        warn_ignored(self.offload_config, VLLM, logger)

    def _check_sized(self) -> None:
        if self.num_chunks < 1:
            raise ConfigError(
                "host tier cannot be sized: vLLM reported "
                f"worker_kv_bytes_per_block={self.config.worker_kv_bytes_per_block}"
            )

    def get_manager(self):
        if self._manager is None:
            self._check_sized()
            from gpu_offload.vllm.manager import HostTierManager

            stride = -(-self.worker_chunk_bytes // PAGE) * PAGE
            files = self._file_view()
            self._manager = HostTierManager(
                self.num_chunks,
                stride * self.world_size,
                blocks_per_chunk=self.blocks_per_chunk,
                tokens_per_block=self.tokens_per_block_0,
                enable_events=self._events_on(),
                files=files,
                file_events=FileEvents(self.world_size) if files is not None and self._events_on() else None,
                write_back=self.offload_config.fs_write_mode == "write_back",
                reset_epoch_file=self.offload_config.fs_reset_epoch_file,
                load_decision=self.offload_config.load_decision,
                load_decision_bias=self.offload_config.load_decision_bias,
                lease_max_fraction=self.offload_config.lease_max_fraction,
                lease_max_sessions=self.offload_config.lease_max_sessions,
                lease_files=files is not None and self.offload_config.lease_max_fraction > 0
                and self.offload_config.fs_capacity_bytes is not None,
            )
            HostOffloadSpec.live_parts.add(self._manager)
            logger.info(
                "host tier: %d chunks x %d blocks, %.1f MiB per chunk over %d worker(s)",
                self.num_chunks, self.blocks_per_chunk, stride * self.world_size / 2**20, self.world_size,
            )
        return self._manager

    def _events_on(self) -> bool:
        return bool(self.kv_events_config.enable_kv_cache_events and self.offload_config.enable_events)

    def get_worker(self, kv_caches):
        tensors = [ct.tensor for ct in kv_caches.tensors]
        if self._worker is not None:
            if not self._worker.owns(tensors):
                raise RuntimeError(hooks.SECOND_ENGINE_ERROR)
            return self._worker
        self._check_sized()
        self._check_host_memory()
        from gpu_offload.vllm.worker import HostOffloadWorker

        groups = self.config.groups  # the offloaded groups, in the order of group_data_refs
        self._worker = HostOffloadWorker.from_canonical(
            kv_caches,
            num_slots=self.num_chunks,
            blocks_per_chunk=self.blocks_per_chunk,
            staging_blocks=self.offload_config.staging_blocks,
            tokens_per_block=[g.tokens_per_block for g in groups]
            if len(groups) == len(kv_caches.group_data_refs) else None,
            rank=self.config.parallel.rank,
        )
        HostOffloadSpec.live_parts.add(self._worker)
        actual = self._worker.layout.chunk_bytes
        self._attach_files(self._worker)
        if actual > self.worker_chunk_bytes:
            logger.warning(
                "worker chunk is %d B, vLLM sized %d B: the host tier uses %d B more than budgeted",
                actual, self.worker_chunk_bytes, (actual - self.worker_chunk_bytes) * self.num_chunks,
            )
        return self._worker

    def _check_host_memory(self) -> None:
        """Refuse, with the figures, a slab the host cannot hold, before it is allocated and prefaulted (or
        pinned): past the cgroup's limit that is an OOM kill (exit 137) with no message.

        Two checks (``core.hostmem``, the TPU connector's): this worker's slab against what the host leaves
        now; and, with several workers on this host, all their slabs against what it left when this spec
        was built, before any of them allocated one (each worker prefaults its own slab while the others do,
        so figures read now would count theirs twice)."""
        oc = self.offload_config
        stride = -(-self.worker_chunk_bytes // PAGE) * PAGE
        mine, n = self.num_chunks * stride, self._local_workers

        def fix(chunks: int) -> str:  # what fits, in chunks per worker
            return (f"Lower cpu_bytes_to_use (or cpu_bytes / cpu_gib) from {mine * self.world_size} to at most "
                    f"{chunks * stride * self.world_size} ({chunks} chunks of {stride} bytes per worker), or "
                    f"num_cpu_chunks from {self.num_chunks} to {chunks}, or lower host_memory_margin "
                    "(TPU_OFFLOAD_HOST_MEMORY_MARGIN).")

        if n > 1 and self._host_at_start is not None:
            hostmem.check_host_fits(mine * n, self.num_chunks * n, margin=oc.host_memory_margin,
                                    host=self._host_at_start, fix=lambda fit: fix(fit // n),
                                    where=f"on this host ({n} workers of {hostmem.size_str(mine)} each)")
        hostmem.check_host_fits(mine, self.num_chunks, margin=oc.host_memory_margin,
                                host=hostmem.read_host_memory(), fix=fix,
                                where=f"in this worker (rank {self.config.parallel.rank})")

    # ---- file tier -----------------------------------------------------------------
    def _file_view(self):
        path = self.offload_config.shared_storage_path
        if not path:
            return None
        from gpu_offload.vllm.fs_specs import FileView, fingerprint

        view = FileView(path, [fingerprint(self.config, r) for r in range(self.world_size)],
                        self.worker_chunk_bytes, secret=self.offload_config.fs_secret,
                        io_timeout_s=self.offload_config.fs_io_timeout_s)
        logger.info("file tier: looking up chunks under %s (%d rank namespace(s))", view.root, len(view.ns_dirs))
        return view

    def _attach_files(self, worker) -> None:
        oc = self.offload_config
        if not oc.shared_storage_path:
            return
        from tpu_offload.core.fs import FileTier
        from tpu_offload.core.fs.journal import FileJournal

        from gpu_offload.vllm.fs_specs import fingerprint

        chunk = worker.pool.chunk_bytes
        if chunk != self.worker_chunk_bytes:
            logger.warning(
                "file tier: worker chunks are %d B but the scheduler expects %d B files; "
                "every file lookup will miss", chunk, self.worker_chunk_bytes,
            )
        worker.fs_metrics = metrics.worker_fs_metrics()
        fp = fingerprint(self.config, self.config.parallel.rank)
        tier = FileTier.from_config(oc, fp, chunk, fs_metrics=worker.fs_metrics)
        # Shipped to the scheduler each step (hooks): file outcomes for KV events, and the tier's state (no file
        # hits are offered while it is off), so also with events off.
        tier.journal = FileJournal()

        def after_reset(epoch: str) -> FileTier:  # the namespace of a reset epoch (core/fs/reset.py)
            from tpu_offload.core.fs.reset import salted

            return FileTier.from_config(oc, salted(fp, epoch), chunk, fs_metrics=worker.fs_metrics)

        worker.attach_files(tier, oc.fs_write_mode, write_back_lag_s=oc.fs_write_back_lag_s, make_tier=after_reset)
        logger.info("file tier: %s, %s%s, %s", tier.ns_dir, oc.fs_write_mode,
                    f" (lag {oc.fs_write_back_lag_s:g} s)" if oc.fs_write_mode == "write_back" else "",
                    tier.state.value)
