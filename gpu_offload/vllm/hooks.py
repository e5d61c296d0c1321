"""What we add to vLLM's ``OffloadingConnector`` (installed by ``gpu_offload.vllm.spec``).

vLLM 0.32's connector asserts ``TransferResult.success``, has no
``get_block_ids_with_load_errors`` and sends no worker-side stats, so:

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
* Worker metrics. ``get_kv_connector_stats`` on a worker returns what our
  worker measured (hits that landed, the file tier's series); vLLM merges it
  with the scheduler's stats into ``/metrics``.
* File-tier KV events. Each worker ships its file tier's journal in the
  worker metadata (``build_connector_worker_meta``); the scheduler side hands
  it to our manager, which publishes ``STORAGE`` events (``file_events``).
* Step timing. The scheduler side numbers each step's metadata
  (``build_connector_meta``); the worker metadata echoes it, so our manager
  times each step from its scheduling to its output (the load decision).
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

Each is installed only when the class has no such member of its own (a later
vLLM may implement one), and only once.
"""

from __future__ import annotations

from gpu_offload._log import get_logger
from gpu_offload.vllm.compat import OffloadingConnector, device_source_group
from gpu_offload.vllm.device_source import DeviceSource
from gpu_offload.vllm.file_events import FileTierWorkerMetadata
from gpu_offload.vllm.manager import HostTierManager, RequestSalt
from gpu_offload.vllm.worker import HostOffloadWorker

logger = get_logger(__name__)

_MARK = "_tpu_offload_hook"

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

def _get_transfer_results(orig):
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


def _get_block_ids_with_load_errors(self) -> set[int]:
    blocks = getattr(self, "_tpu_offload_error_blocks", None)
    if not blocks:
        return set()
    self._tpu_offload_error_blocks = set()
    return blocks


def _get_kv_connector_stats(orig):
    def get_kv_connector_stats(self):
        worker = _our_worker(self)
        if worker is not None and getattr(self, "connector_scheduler", None) is None:
            return worker.take_connector_stats()
        return orig(self)

    return get_kv_connector_stats


STEP_ATTR = "tpu_offload_step"  # our number on vLLM's step metadata, echoed by the workers


def _build_connector_worker_meta(orig):
    def build_connector_worker_meta(self):
        meta = orig(self)
        worker = _our_worker(self)
        if worker is None:
            return meta
        journal = worker.fs.tier.journal if worker.fs is not None else None
        entries = journal.take() if journal is not None else []
        failures = getattr(self, "_tpu_offload_load_failures", None) or {}
        self._tpu_offload_load_failures = {}
        step = getattr(getattr(self, "_connector_metadata", None), STEP_ATTR, -1)
        if meta is None and not entries and not failures and step < 0:
            return None
        # Always ours once our worker runs: vLLM aggregates ranks into the first one's type.
        out = FileTierWorkerMetadata.wrap(meta, entries)
        out.load_failures, out.reports_load_failures = failures, True
        out.steps = [step] if step >= 0 else []  # echoed: the step's output is back (scheduler: update_connector_output)
        return out

    return build_connector_worker_meta


def _register_kv_caches(orig):
    def register_kv_caches(self, kv_caches):
        if _our_worker(self) is not None:
            raise RuntimeError(SECOND_ENGINE_ERROR)
        return orig(self, kv_caches)

    return register_kv_caches


# ---- scheduler side ------------------------------------------------------------

def _our_manager(connector) -> HostTierManager | None:
    m = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    return m if isinstance(m, HostTierManager) else None


def _build_connector_meta(orig):
    def build_connector_meta(self, scheduler_output):
        meta = orig(self, scheduler_output)
        manager = _our_manager(self)
        if manager is not None:  # the step clock of the load decision (manager.py): workers echo the id
            step = manager.step_sent(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
            try:
                setattr(meta, STEP_ATTR, step)
            except (AttributeError, TypeError):  # a metadata type without a __dict__: timed by schedule intervals
                pass
        return meta

    return build_connector_meta


def _update_connector_output(orig):
    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, FileTierWorkerMetadata) and meta.steps:
            manager = _our_manager(self)
            if manager is not None:
                manager.steps_done(meta.steps)
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


def _bind_gpu_block_pool(self, gpu_block_pool) -> None:
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


def _get_num_new_matched_tokens(orig):
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


def _update_state_after_alloc(orig):
    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kw):
        try:
            return orig(self, request, blocks, num_external_tokens, *args, **kw)
        finally:
            manager = _our_manager(self)
            if manager is not None and manager.device is not None:
                manager.device.settle(request.request_id)

    return update_state_after_alloc


# ---- installation ----------------------------------------------------------------

def _install(name: str, make, wrap: bool) -> bool:
    own = vars(OffloadingConnector).get(name)
    if own is not None and getattr(own, _MARK, False):
        return True  # already ours
    if wrap:
        if own is None:
            return False
        new = make(own)
        new.__wrapped__ = own
    else:
        if own is not None:
            return False  # vLLM implements it now: leave it alone
        new = make
    setattr(new, _MARK, True)
    setattr(OffloadingConnector, name, new)
    return True


def _install_request_salt() -> bool:
    """Wrap the offloading scheduler's ``_create_req_context`` to keep the request's ``cache_salt``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched
    except ImportError:  # pragma: no cover - another vLLM layout
        return False
    orig = getattr(sched, "_create_req_context", None)
    if orig is None or getattr(orig, _MARK, False):
        return orig is not None

    def create_req_context(req):
        ctx = orig(req)
        salt = getattr(req, "cache_salt", None)
        if salt and hasattr(ctx, "set_state"):
            ctx.set_state(RequestSalt(str(salt).encode()))
        return ctx

    create_req_context.__wrapped__ = orig
    setattr(create_req_context, _MARK, True)
    sched._create_req_context = create_req_context
    return True


def install() -> bool:
    """Install every hook (idempotent). True when load-error reporting is ours."""
    if not _install_request_salt():
        logger.warning("could not hook vLLM's request contexts: with fs_secret, every request's files use "
                       "the deployment's keys (cache_salt is not applied to file names and MACs)")
    ok = _install("get_block_ids_with_load_errors", _get_block_ids_with_load_errors, wrap=False)
    if ok:
        _install("get_transfer_results", _get_transfer_results, wrap=True) \
            or _install_missing_transfer_results()
    _install("update_connector_output", _update_connector_output, wrap=True)
    _install("build_connector_meta", _build_connector_meta, wrap=True)
    _install("build_connector_worker_meta", _build_connector_worker_meta, wrap=True)
    _install("get_kv_connector_stats", _get_kv_connector_stats, wrap=True)
    _install("register_kv_caches", _register_kv_caches, wrap=True)
    if _install("bind_gpu_block_pool", _bind_gpu_block_pool, wrap=False):
        _install("get_num_new_matched_tokens", _get_num_new_matched_tokens, wrap=True)
        _install("update_state_after_alloc", _update_state_after_alloc, wrap=True)
    return ok


def _install_missing_transfer_results() -> bool:
    """The connector inherits ``get_transfer_results`` from its base: wrap that."""
    base = getattr(OffloadingConnector, "get_transfer_results", None)
    if base is None:
        return False
    new = _get_transfer_results(base)
    new.__wrapped__ = base
    setattr(new, _MARK, True)
    OffloadingConnector.get_transfer_results = new
    return True
