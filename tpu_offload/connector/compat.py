"""Every vLLM / tpu-inference API difference the connector depends on, in one place.

Targets vLLM 0.32 (what tpu-inference 0.32 runs on). Newer vLLM has a
dedicated worker->scheduler channel (``KVConnectorWorkerMetadata``); where it
is missing, the worker's report rides inside the connector stats instead, the
way tpu-inference's own connector does it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: F401

try:  # vLLM >= 0.24
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

    HAS_WORKER_META = True
except ImportError:  # pragma: no cover - exercised by monkeypatching HAS_WORKER_META
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]
    HAS_WORKER_META = False

try:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
except ImportError:  # pragma: no cover - very old vLLM: no offload medium field
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    MEDIUM_CPU = "CPU"

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # pragma: no cover
    def maybe_convert_block_hash(h):
        return h

try:  # vLLM >= 0.31: per-tier hit accounting
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HIT_HOST, HIT_DISK = CacheHitSource.HOST, CacheHitSource.DISK
except ImportError:  # pragma: no cover
    HIT_HOST, HIT_DISK = None, None

# Connector class names tpu-inference's platform accepts (tpu_platform.py, #2336).
TPU_INFERENCE_CONNECTOR_NAMES = ("TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector", "RaidenOffloadConnector")
# Key under which the report travels inside the stats when there is no worker-meta channel.
STATS_REPORT_KEY = "_tpu_offload_report"


def blocks_of_group0(blocks) -> list[int]:
    """Block ids of KV group 0 from a ``KVCacheBlocks`` (or a tuple of id lists)."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    return list(ids[0]) if ids and isinstance(ids[0], (list, tuple)) else list(ids)


def request_block_ids(kv_cache_manager, req_id: str) -> list[int]:
    return list(kv_cache_manager.get_block_ids(req_id)[0])


def lora_of(request) -> tuple[int | None, str | None]:
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None, None
    return getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None)), getattr(lora, "name", None)


def extract_report(output) -> Any:
    """The worker report carried by a ``KVConnectorOutput``, whichever channel it used."""
    if HAS_WORKER_META:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if meta is not None:
            return meta
    stats = getattr(output, "kv_connector_stats", None)
    if stats is not None and isinstance(getattr(stats, "data", None), dict):
        return stats.data.get(STATS_REPORT_KEY)
    return None
