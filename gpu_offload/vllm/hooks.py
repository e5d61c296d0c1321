"""What each of our patches of vLLM's ``OffloadingConnector`` does; ``patches`` puts them in place.

Plain functions over a connector, so each can be tested on a stand-in; why
each is needed (what vLLM's API lacks) is in ``patches.PATCHES``. vLLM
0.32's connector asserts ``TransferResult.success``, has no
``get_block_ids_with_load_errors`` and gives its manager no worker report, so:

* Load errors. A failed load job is reported finished; its engine blocks go
  to the scheduler through ``get_block_ids_with_load_errors`` (one KV-cache
  group: vLLM recomputes just those blocks). With more than one group
  (hybrid models such as Gemma 3: sliding window + full attention) vLLM
  cannot map block ids back to requests and raises, so there the request is
  reported in ``failed_recving`` instead and vLLM recomputes it whole.
  Both need ``kv_load_failure_policy: "recompute"``.
* No reload loop. When a load fails on a request's first block, vLLM frees
  its blocks and looks it up again; a chunk that still reads as a hit would
  be loaded, fail and be retried forever. So the scheduler side drops the
  chunks of failed loads from our manager first (``update_connector_output``):
  exactly the failed jobs when they arrive as ``failed_recving``; with only
  block ids (one group), just the chunks that failed, which our workers list
  in their step metadata (``load_failures``), or every load job completing in
  the step if that list is missing (another worker).
* Worker metrics. Each worker's stats (hits that landed, the file tier's
  series) ride in its step metadata (``build_connector_worker_meta``); the
  scheduler side hands them to our manager, whose ``get_stats`` (vLLM's own
  channel for a spec's metrics) returns them with its own.
* File-tier KV events. Each worker ships its file tier's journal in the
  worker metadata (``build_connector_worker_meta``); the scheduler side hands
  it to our manager, which publishes ``STORAGE`` events (``file_events``).
* Step timing. The scheduler side numbers each step's metadata
  (``build_connector_meta``); the worker metadata echoes it, so our manager
  times each step from its scheduling to its output (the load decision).
* File-tier leases. A request's lease hint reaches our manager (vLLM's
  ``ReqContext``), but the file tier lives in each worker: the manager's
  renewals and leases of the step ride on the same metadata, and each worker
  applies them to its file tier (``build_connector_worker_meta``).
* Tenant salts. vLLM's ``ReqContext`` does not carry the request's
  ``cache_salt``; with the file tier's secret our manager needs it (files are
  named and signed per tenant), so the context factory of vLLM's offloading
  scheduler is wrapped to store it (``RequestSalt``).
* Device sources (``device_source``). vLLM binds its device block pool to
  every connector (``bind_gpu_block_pool``); ours hands it to our manager
  when the KV layout allows (``compat.device_source_group``), so a chunk the
  device still caches is a hit even past a chunk only our tier holds. The
  request's lookup (``get_num_new_matched_tokens``) and allocation
  (``update_state_after_alloc``) are wrapped to scope the references it
  holds on source blocks.
* One engine per process. vLLM keeps one worker-side connector per process;
  a second engine in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
  would register its KV caches on the first engine's connector, and its
  restores would land in the first engine's KV. ``register_kv_caches``
  refuses that with a clear error.

Each hook runs vLLM's own code unchanged on a connector whose manager or
worker is not ours.
"""

from __future__ import annotations

from gpu_offload._log import get_logger
from gpu_offload.vllm.compat import device_source_group
from gpu_offload.vllm.device_source import DeviceSource
from gpu_offload.vllm.file_events import FileTierWorkerMetadata
from gpu_offload.vllm.manager import HostTierManager, RequestSalt
from gpu_offload.vllm.worker import HostOffloadWorker

logger = get_logger(__name__)

SECOND_ENGINE_ERROR = (
    "gpu_offload: a second vLLM engine with KV offloading was started in this process while "
    "another one is alive. vLLM keeps one worker-side KV connector per process, so this "
    "engine's KV caches would be registered on the other engine's host tier and its restores "
    "would land in the other engine's KV cache. Shut the first engine down before starting "
    "the next (del llm, or llm.llm_engine.engine_core.shutdown()), or run each engine in its "
    "own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default)."
)


def _our_worker(connector) -> HostOffloadWorker | None:
    w = getattr(getattr(connector, "connector_worker", None), "worker", None)
    return w if isinstance(w, HostOffloadWorker) else None


def _hybrid(connector) -> bool:
    cfg = getattr(connector, "_kv_cache_config", None)
    return cfg is not None and len(cfg.kv_cache_groups) > 1


# ---- worker side ---------------------------------------------------------------

def wrap_get_transfer_results(orig):
    def get_transfer_results(self, finished_req_ids):
        cw = getattr(self, "connector_worker", None)
        load_jobs = dict(getattr(cw, "_load_jobs", {}))  # job id -> request id, popped by orig
        results = orig(self, finished_req_ids)
        worker = _our_worker(self)
        if worker is None:
            return results
        blocks, failures = worker.take_load_failures()
        jobs = set(failures)
        if not jobs:
            return results
        if _hybrid(self):
            failed = {load_jobs[j] for j in jobs if j in load_jobs}
            if len(failed) < len(jobs):  # cannot happen while vLLM pops _load_jobs only in get_finished
                logger.error("failed load job(s) %s belong to no known request; their KV is not reported",
                             sorted(j for j in jobs if j not in load_jobs))
            results.failed_recving = set(results.failed_recving or ()) | failed
        else:
            pending = getattr(self, "_tpu_offload_error_blocks", set())
            self._tpu_offload_error_blocks = pending | blocks
            failed = getattr(self, "_tpu_offload_load_failures", {})
            failed.update({j: None if k is None else tuple(k) for j, k in failures.items()})
            self._tpu_offload_load_failures = failed  # shipped in this step's worker metadata
        return results

    return get_transfer_results


def get_block_ids_with_load_errors(self) -> set[int]:
    blocks = getattr(self, "_tpu_offload_error_blocks", None)
    if not blocks:
        return set()
    self._tpu_offload_error_blocks = set()
    return blocks


STEP_ATTR = "tpu_offload_step"  # our number on vLLM's step metadata, echoed by the workers
LEASE_ATTR = "tpu_offload_fs_leases"  # the manager's file-tier lease orders of the step, for every worker


def wrap_build_connector_worker_meta(orig):
    def build_connector_worker_meta(self):
        meta = orig(self)
        worker = _our_worker(self)
        if worker is None:
            return meta
        journal = worker.fs.tier.journal if worker.fs is not None else None
        entries = journal.take() if journal is not None else []
        failures = getattr(self, "_tpu_offload_load_failures", None) or {}
        self._tpu_offload_load_failures = {}
        bound = getattr(self, "_connector_metadata", None)
        step = getattr(bound, STEP_ATTR, -1)
        orders = getattr(bound, LEASE_ATTR, None)
        if orders is not None and worker.fs is not None:
            try:
                worker.lease_files(*orders)
            except Exception:  # never let bookkeeping take the engine down
                logger.exception("could not apply the step's file-tier leases")
        stats = worker.take_connector_stats()  # to our manager's get_stats, vLLM's channel for spec metrics
        if meta is None and not entries and not failures and step < 0 and stats is None:
            return None
        # Always ours once our worker runs: vLLM aggregates ranks into the first one's type.
        out = FileTierWorkerMetadata.wrap(meta, entries)
        out.load_failures, out.reports_load_failures = failures, True
        out.worker_stats = stats
        out.steps = [step] if step >= 0 else []  # echoed: the step's output is back (scheduler: update_connector_output)
        return out

    return build_connector_worker_meta


def wrap_register_kv_caches(orig):
    def register_kv_caches(self, kv_caches):
        if _our_worker(self) is not None:
            raise RuntimeError(SECOND_ENGINE_ERROR)
        return orig(self, kv_caches)

    return register_kv_caches


# ---- scheduler side ------------------------------------------------------------

def _our_manager(connector) -> HostTierManager | None:
    m = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    return m if isinstance(m, HostTierManager) else None


def wrap_build_connector_meta(orig):
    def build_connector_meta(self, scheduler_output):
        meta = orig(self, scheduler_output)
        manager = _our_manager(self)
        if manager is not None:  # the step clock of the load decision (manager.py): workers echo the id
            step = manager.step_sent(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
            orders = manager.take_fs_leases()
            try:
                setattr(meta, STEP_ATTR, step)
                if orders is not None:
                    setattr(meta, LEASE_ATTR, orders)
            except (AttributeError, TypeError):  # a metadata type without a __dict__: timed by schedule intervals
                pass
        return meta

    return build_connector_meta


def wrap_update_connector_output(orig):
    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, FileTierWorkerMetadata) and meta.steps:
            manager = _our_manager(self)
            if manager is not None:
                manager.steps_done(meta.steps)
        if isinstance(meta, FileTierWorkerMetadata) and meta.worker_stats is not None:
            manager = _our_manager(self)
            if manager is not None:  # vLLM reads them back through the manager's get_stats in this step
                manager.note_worker_stats(meta.worker_stats)
        if isinstance(meta, FileTierWorkerMetadata) and meta.has_files():
            manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
            if isinstance(manager, HostTierManager):
                try:
                    manager.note_file_outcomes(meta)
                except Exception:  # never let bookkeeping take the engine down
                    logger.exception("could not account the file tier's outcomes for KV events")
        if getattr(connector_output, "failed_recving", None) or getattr(connector_output, "invalid_block_ids", None):
            try:
                _forget_failed_loads(self, connector_output)
            except Exception:  # never let bookkeeping take the engine down
                logger.exception("could not drop the chunks of a failed load")
        return orig(self, connector_output)

    return update_connector_output


def _forget_failed_loads(connector, connector_output) -> None:
    sched = getattr(connector, "connector_scheduler", None)
    manager = getattr(sched, "manager", None)
    jobs = getattr(sched, "_jobs", None)
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    completed = getattr(meta, "completed_jobs", None)
    if not isinstance(manager, HostTierManager) or jobs is None or not completed:
        return
    failed_reqs = set(getattr(connector_output, "failed_recving", None) or ())
    by_blocks = bool(getattr(connector_output, "invalid_block_ids", None))
    listed = isinstance(meta, FileTierWorkerMetadata) and meta.reports_load_failures
    for job_id in completed:
        status = jobs.get(job_id)
        if status is None or status.is_store:
            continue
        if status.req_id in failed_reqs or (by_blocks and not listed):
            manager.forget_chunks(status.keys)
        elif by_blocks and job_id in meta.load_failures:
            keys = meta.load_failures[job_id]
            manager.forget_chunks(status.keys if keys is None else [k for k in status.keys if k in set(keys)])


def bind_gpu_block_pool(self, gpu_block_pool) -> None:
    manager = _our_manager(self)
    if manager is None:
        return
    try:
        got = device_source_group(self, gpu_block_pool)
        if isinstance(got, str):
            logger.info("device prefix cache is not a load source (%s): a hit stops at the first chunk "
                        "our tiers lack", got)
            return
        group_id, tokens_per_block = got
        manager.bind_device(DeviceSource(gpu_block_pool, group_id, manager.blocks_per_chunk, tokens_per_block))
        logger.info("device prefix cache bound as a load source (KV group %d)", group_id)
    except Exception:  # never let this take the engine down: plain prefix lookups
        logger.exception("could not bind the device block pool as a load source")


def wrap_get_num_new_matched_tokens(orig):
    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kw):
        manager = _our_manager(self)
        device = manager.device if manager is not None else None
        if device is None:
            return orig(self, request, num_computed_tokens, *args, **kw)
        req_id = request.request_id
        device.begin(req_id, request.block_hashes, num_computed_tokens)
        hit = None
        try:
            out = orig(self, request, num_computed_tokens, *args, **kw)
            hit = out[0] if isinstance(out, tuple) else out
            return out
        finally:
            device.end(req_id, hit)

    return get_num_new_matched_tokens


def wrap_update_state_after_alloc(orig):
    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kw):
        try:
            return orig(self, request, blocks, num_external_tokens, *args, **kw)
        finally:
            manager = _our_manager(self)
            if manager is not None and manager.device is not None:
                manager.device.settle(request.request_id)

    return update_state_after_alloc


def wrap_create_req_context(orig):
    """vLLM's offloading scheduler builds each request's ``ReqContext`` here: keep its ``cache_salt``."""
    def create_req_context(req):
        ctx = orig(req)
        salt = getattr(req, "cache_salt", None)
        if salt and hasattr(ctx, "set_state"):
            ctx.set_state(RequestSalt(str(salt).encode()))
        return ctx

    return create_req_context
