"""Our shared file tier as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

For a vLLM user who runs vLLM's native CPU offloading and wants only our
file tier under it: signed chunk files (a MAC per file, names that are keyed
hashes), one byte budget shared by every engine writing the directory, LRU
eviction by file mtime, rescans that find what other engines wrote,
deadlines on every read and write, a full disk or a denied directory that
turns the tier read-only instead of failing, and KV events for stores and
evictions. The tier itself is ``tpu_offload.core.fs.FileTier``, the one the
TPU connector and ``HostOffloadSpec`` use; this module only adapts it to
vLLM's ``SecondaryTierManager`` job interface, and patches nothing::

    "secondary_tiers": [{"type": "SharedFileTier", "module_path": "gpu_offload.vllm.secondary_tier",
                         "shared_storage_path": "/mnt/kv", "fs_secret_file": "/etc/kv/secret",
                         "fs_capacity_bytes": "500GiB"}]

vLLM's contract, and how it is kept (``vllm/v1/kv_offload/tiering/base.py``):

* Every method runs on the scheduler thread and must not block: stores and
  loads are queued on the tier's I/O threads (reads ahead of writes); a
  lookup is answered from a background thread (vLLM's ``AsyncLookupManager``:
  RETRY until the ``stat`` lands, then HIT or MISS).
* ``chunk_ids`` address rows of the primary tier's CPU buffer (``view[c]``,
  ``block_size_bytes`` each). A store reads its rows in place until its job
  is reported finished (vLLM keeps them pinned until then); a load writes
  its rows only with bytes that passed the checksum and MAC, and with
  ``fs_io_timeout_s`` only before its deadline.
* ``get_finished_jobs`` reports each job once. A load that fails for some
  keys reports the others in ``successful_keys`` and marks the failed ones
  a miss, so a forged or deleted file costs one recompute, not a loop.
* Back-pressure: vLLM's detector (the entry's ``backpressure``) is fed by
  the ``transfer_bytes``/``transfer_time`` each store reports; the tier
  itself drops writes past ``fs_queue_depth`` (counted), never blocks.

One file holds a whole primary row (every worker's share of the chunk), so
the namespace is its own: a fingerprint of the row, never confused with
``HostOffloadSpec``'s per-rank files.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import numpy as np
from prometheus_client import REGISTRY

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from gpu_offload._log import get_logger
from gpu_offload.vllm.compat import OffloadingConnectorStats
from gpu_offload.vllm.metrics import LEASED_BYTES, add_leases, lease_definitions
from gpu_offload.vllm.tier_settings import TierSettings, parse_tier_settings
from tpu_offload.core import leases
from tpu_offload.core.fs import FileTier, FsMetrics, WriteTicket
from tpu_offload.core.fs.journal import PUBLISHED, REMOVED, FileJournal
from tpu_offload.core.fs.reset import bind_weights
from tpu_offload.core.keys import LayoutFingerprint

logger = get_logger(__name__)


def _process_fs_metrics() -> FsMetrics:
    """The tier's series on the process's default registry, or, where the names are already taken there
    (an earlier engine of this process exported them through vLLM's stat logger, as ``HostOffloadSpec``
    does), on a private registry with one warning: metrics must never stop a tier from starting."""
    try:
        return FsMetrics.for_registry(REGISTRY)
    except ValueError as e:  # prometheus_client's DuplicateTimeseries
        logger.warning("tpu_offload_fs_* series are already registered in this process (%s); this tier's "
                       "file metrics are not exported", e)
        return FsMetrics()


def row_fingerprint(config, row_bytes: int, epoch_file: str | None) -> LayoutFingerprint:
    """The namespace of primary-tier rows: model, layout, parallelism and row size (from ``OffloadingConfig``).

    A row holds every worker's share of a chunk, so ``tp_rank`` is 0 and the
    row's byte count stands for the per-rank shapes vLLM does not give a spec.
    """
    groups = config.groups
    model = getattr(config, "model", None)
    fp = LayoutFingerprint(
        model=getattr(model, "name", "") or "model",
        dtype=getattr(model, "dtype", "") or "",
        block_size=groups[0].tokens_per_block if groups else 0,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        num_layers=len({name for g in groups for name in g.layer_names}),
        kv_heads_per_rank=0,
        head_dim=0,
        tp_rank=0,
        tp_size=max(1, config.parallel.world_size),
        engine=(f"vllm-tiering;row_bytes={row_bytes};bytes_per_block={config.worker_kv_bytes_per_block};"
                f"kv_layout={getattr(config, 'kv_cache_layout', None)};"
                f"groups={','.join(str(g.tokens_per_block) for g in groups)}"),
    )
    return bind_weights(fp, epoch_file)


class _FileLookups(AsyncLookupManager):
    """vLLM's async lookups over ``FileTier.contains`` (index, then a bounded ``stat``), off the scheduler thread."""

    def __init__(self, tier: FileTier, tier_type: str):
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return [self._tier.contains(k) for k in keys]


@dataclasses.dataclass
class _StoreJob:
    keys: list[OffloadKey]
    tickets: list[WriteTicket | None]  # None: dropped at once (queue full, read-only, off)
    t0: float


class _LoadJob:
    """The reads of one load job; the last read's callback (an I/O thread) queues its result."""

    def __init__(self, job_id: JobId, keys: list[OffloadKey], row_bytes: int, out: queue.SimpleQueue):
        self.job_id, self.keys, self.row_bytes, self._out = job_id, keys, row_bytes, out
        self.ok = [False] * len(keys)
        self._left = len(keys)
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.t0 = time.monotonic()
        if not keys:
            self._finish()

    def read_done(self, i: int, ok: bool) -> None:
        with self._lock:
            self.ok[i] = ok
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self._out.put(self)
        self.done.set()


class SharedFileTier(SecondaryTierManager):
    """``tpu_offload``'s signed, budgeted, shared file tier behind vLLM's secondary-tier interface."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **entry: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings: TierSettings = parse_tier_settings(entry)
        cfg = self.settings.fs
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        row = self.block_size_bytes
        # Rows of the primary buffer as byte arrays (views, never copies): row c is chunk id c.
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, row)
        fp = row_fingerprint(offloading_spec.config, row, cfg.fs_reset_epoch_file)
        # Its tpu_offload_fs_* series on the process's default registry: vLLM's /metrics, or its
        # PROMETHEUS_MULTIPROC_DIR (which FsMetrics mirrors into), since this runs in the engine's scheduler.
        self.tier: FileTier = FileTier.from_config(cfg, fp, row, name=f"vllm-{tier_type}",
                                                   fs_metrics=_process_fs_metrics())
        self._journal: FileJournal | None = None
        if self.settings.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._journal = FileJournal()
                self.tier.journal = self._journal
            else:
                logger.warning("enable_kv_events is set on secondary tier %r but KV cache events are off; "
                               "the tier emits none", tier_type)
        self._stores: dict[JobId, _StoreJob] = {}
        self._loads: dict[JobId, _LoadJob] = {}
        self._loads_done: queue.SimpleQueue[_LoadJob] = queue.SimpleQueue()
        self._lookups = _FileLookups(self.tier, tier_type)

    # ---- lookups and recency ------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:  # the index at once, the file's mtime (shared LRU order) on an I/O thread
            try:
                self.tier.touch(key)
            except ValueError:
                pass

    # ---- session leases (core/leases.py): the tier is in this process, so the hint reaches it directly ----
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.tier.leases is not None:  # the session came back: its lease runs ttl_s from now
            hint = leases.parse_hint(req_context.kv_transfer_params)
            if hint is not None:
                self.tier.renew(hint.session, hint.ttl_s)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        if self.tier.leases is not None and leases.has_hint(req_context.kv_transfer_params):
            hint = leases.parse_hint(req_context.kv_transfer_params)
            if hint is not None:  # its keys in prefix order: the head first, which every later turn needs
                positions = req_context._offload_key_positions
                self.tier.lease(hint.session, hint.ttl_s, sorted(positions, key=positions.__getitem__))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # ---- jobs -----------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        tickets = [self._queue_write(key, int(c)) for key, c in zip(keys, job_metadata.chunk_ids)]
        self._stores[job_metadata.job_id] = _StoreJob(keys, tickets, time.monotonic())

    def _queue_write(self, key: OffloadKey, chunk_id: int) -> WriteTicket | None:
        try:
            return self.tier.submit_write(key, self._rows[chunk_id])
        except ValueError as e:  # a key this tier cannot name: that chunk is not stored, the engine goes on
            logger.warning("secondary tier %r: not storing a chunk (%s)", self.tier_type, e)
            return None

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _LoadJob(job_metadata.job_id, keys, self.block_size_bytes, self._loads_done)
        self._loads[job.job_id] = job
        for i, (key, c) in enumerate(zip(keys, job_metadata.chunk_ids)):
            try:
                queued = self.tier.submit_read(key, self._rows[int(c)], functools.partial(job.read_done, i))
            except ValueError:  # a key this tier cannot name
                queued = False
            if not queued:
                job.read_done(i, False)  # the tier cannot read it now (off, closed): that chunk fails

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                job = self._loads_done.get_nowait()
            except queue.Empty:
                break
            self._loads.pop(job.job_id, None)
            good = [k for k, ok in zip(job.keys, job.ok) if ok]
            failed = [k for k, ok in zip(job.keys, job.ok) if not ok]
            if failed:
                self._lookups.mark_miss(failed)  # a rejected file is not offered again
            results.append(JobResult(job_id=job.job_id, success=not failed,
                                     successful_keys=tuple(good) if failed and good else None,
                                     transfer_time=time.monotonic() - job.t0,
                                     transfer_bytes=len(good) * job.row_bytes))
        for job_id in [j for j, s in self._stores.items() if self._store_ended(s)]:
            job = self._stores.pop(job_id)
            written = sum(1 for t in job.tickets if t is not None and t.succeeded())
            results.append(JobResult(job_id=job_id, success=written == len(job.keys),
                                     transfer_time=time.monotonic() - job.t0,
                                     transfer_bytes=written * self.block_size_bytes))
        return results

    def _store_ended(self, job: _StoreJob) -> bool:
        """Has every write of the job stopped reading its row? Past the deadline a stuck one is abandoned."""
        timeout = self.tier.io_timeout_s
        late = timeout is not None and time.monotonic() - job.t0 > timeout
        for t in job.tickets:
            if t is None or t.done():
                continue
            if not late or not t.cancel_or_wait(0):
                return False
        return True

    def has_pending_work(self) -> bool:
        return bool(self._stores or self._loads)

    def drain_jobs(self) -> None:
        """Wait for every job's I/O (no transfer is cut short); results stay for ``get_finished_jobs``."""
        for job in list(self._loads.values()):
            job.done.wait()
        for job in list(self._stores.values()):
            for t in job.tickets:
                if t is not None:
                    t.cancel_or_wait() if self.tier.io_timeout_s else t.wait()

    # ---- events and lifecycle ------------------------------------------
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Files published and files removed (our evictions, rejected files), in order."""
        if self._journal is None:
            return []
        events: list[OffloadingEvent] = []
        for kind, key in self._journal.take():
            if kind not in (PUBLISHED, REMOVED):
                continue
            removed = kind == REMOVED
            if events and events[-1].removed == removed:
                events[-1].keys.append(OffloadKey(key))
            else:
                events.append(OffloadingEvent(keys=[OffloadKey(key)], medium=self.medium, removed=removed,
                                              locality=self.locality))
        return events

    # ---- metrics: vLLM's per-tier stats channel (its API server exports them) --------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The lease series (``tpu_offload_tier_leased_bytes``, ``..._lease_honoured_chunks``,
        ``..._leases_expired``), labelled with this tier's name; the file series go to the process registry."""
        return lease_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Leased bytes now, leases honoured and expired since the last call (None: leases off)."""
        if self.tier.leases is None:
            return None
        leased, honoured, expired = self.tier.take_lease_counts()
        out = OffloadingConnectorStats()
        label = (self.tier.name,)
        out.set_gauge(LEASED_BYTES, leased, label)
        add_leases(out, honoured, expired, label)
        return out

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.tier.close()
        self._rows = None  # vLLM then closes the primary buffer, which it cannot while a view of it is held
