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

    HIT_HOST, HIT_DISK, HIT_DEVICE = CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.DEVICE
except ImportError:  # pragma: no cover
    HIT_HOST, HIT_DISK, HIT_DEVICE = None, None, None

# Connector class names tpu-inference's platform accepts (tpu_platform.py, #2336).
TPU_INFERENCE_CONNECTOR_NAMES = ("TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector", "RaidenOffloadConnector")
# Key under which the report travels inside the stats when there is no worker-meta channel.
STATS_REPORT_KEY = "_tpu_offload_report"


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults, SupportsHMA
except ImportError:  # pragma: no cover - vLLM without the hybrid KV-cache manager's connector API
    SupportsHMA = object  # type: ignore[misc,assignment]
    KVConnectorTransferResults = None  # type: ignore[misc,assignment]

NULL_BLOCK = 0  # vLLM's null block: what a sliding-window group's table holds outside the window


def block_ids_by_group(blocks) -> tuple[list[int], ...]:
    """Block ids per KV-cache group from a ``KVCacheBlocks``, a tuple of id lists, or one list."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if ids and isinstance(ids[0], (list, tuple)):
        return tuple(list(g) for g in ids)
    return (list(ids),)


def request_block_ids(kv_cache_manager, req_id: str) -> tuple[list[int], ...]:
    return tuple(list(g) for g in kv_cache_manager.get_block_ids(req_id))


def block_tag_reader(kv_cache_manager):
    """block id -> the hash vLLM's prefix cache files that block under (None: not cached); None if
    this vLLM's ``KVCacheManager.block_pool.blocks[i].block_hash`` is not there. Read-only."""
    blocks = getattr(getattr(kv_cache_manager, "block_pool", None), "blocks", None)
    if not blocks or not hasattr(blocks[0], "block_hash"):
        return None
    return lambda i: blocks[i].block_hash


def hbm_block_pool(kv_cache_manager):
    """The block pool vLLM's scheduler allocates HBM blocks from, if it has what an interleaved lookup uses
    (``get_cached_block``, ``touch``, ``free_blocks``, ``blocks[i].block_hash``); else None.

    vLLM 0.32 binds it through ``KVConnectorBase_V1.bind_kv_cache_manager`` (``kv_cache_manager.block_pool``).
    tpu-inference keeps vLLM's ``KVCacheManager``; with Mamba layers its coordinator swaps in a
    ``TPUDualBlockPool`` that routes the same calls to its attention pool, but the connector refuses Mamba
    groups (``group_windows``), so here it is vLLM's own ``BlockPool``."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    if pool is None or not all(hasattr(pool, a) for a in ("get_cached_block", "touch", "free_blocks", "blocks")):
        return None
    if not pool.blocks or not hasattr(pool.blocks[0], "block_hash"):
        return None
    return pool


def group_windows(kv_cache_config) -> tuple[int | None, ...]:
    """Per vLLM KV-cache group: its sliding window in tokens, or None (every block is read).

    More than one group exists only with vLLM's hybrid KV-cache manager, which
    the connector keeps on (``SupportsHMA``); tpu-inference's vLLM-model path
    then gives gpt-oss a sliding-window group and a full-attention one."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if "Mamba" in kind or "ChunkedLocal" in kind or "CrossAttention" in kind:
            raise ValueError(f"KV-cache group with {kind} (layers {list(g.layer_names)[:3]}...): the offload "
                             "connector stores attention KV only (full or sliding-window)")
        # A FullAttentionSpec may carry a sliding_window too (vLLM's hybrid manager off merges sliding layers
        # into full attention and records the window): every block of it is allocated and kept, as full.
        window = getattr(spec, "sliding_window", None) if "SlidingWindow" in kind else None
        out.append(int(window) if window else None)
    return tuple(out) or (None,)


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


def reporting_workers(vllm_config) -> int:
    """Worker processes whose outputs vLLM's ``KVOutputAggregator`` merges each step.

    The aggregator waits for ``get_finished_count() or parallel_config.world_size``
    reports of a request before it counts it finished. tpu-inference runs one
    JAX process per host (SPMD over all of that host's chips), not one per
    device, so ``world_size`` (TP x PP, e.g. 16) overcounts: a TP 16 job on 2
    hosts sends 2 reports and would wait forever. The count is read the way
    tpu-inference's executors create their workers:

    * single host (``"uni"``): one worker (the aggregator is not even used);
    * Ray (``RayDistributedExecutor`` / ``RayDistributedExecutorV2``): one
      worker per placement-group bundle that holds TPUs, or per entry of
      ``VLLM_RAY_BUNDLE_INDICES``.
    """
    import os

    pc = vllm_config.parallel_config
    backend = getattr(pc, "distributed_executor_backend", None)
    name = backend if isinstance(backend, str) or backend is None else getattr(backend, "__name__", str(backend))
    if name in (None, "uni", "external_launcher"):
        return 1
    if "ray" not in str(name).lower():
        raise RuntimeError(
            f"distributed_executor_backend={name!r}: the offload connector knows how many workers report "
            "only for tpu-inference's executors (uni, RayDistributedExecutor, RayDistributedExecutorV2)")
    indices = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "").strip()
    if indices:
        return len(indices.split(","))
    pg = getattr(pc, "placement_group", None)
    bundles = list(getattr(pg, "bundle_specs", None) or [])
    if not bundles:
        raise RuntimeError(f"distributed_executor_backend={name!r} but the Ray placement group is not known yet: "
                           "cannot tell how many worker processes report")
    with_tpu = [b for b in bundles if b.get(RAY_DEVICE_KEY, 0)]
    return len(with_tpu) or len(bundles)


RAY_DEVICE_KEY = "TPU"  # tpu-inference's TpuPlatform.ray_device_key


def data_parallel(vllm_config) -> tuple[int, str]:
    """The engine's data-parallel degree and where it was configured.

    tpu-inference folds DP into its mesh (``ShardingConfigManager``): it reads
    ``data_parallel_size`` and ``additional_config.sharding.sharding_strategy``
    (``enable_dp_attention``, ``attn_dp_size``), then resets
    ``data_parallel_size`` to 1 so vLLM starts one engine, and switches to its
    ``DPScheduler`` when ``sharding_config.total_dp_size > 1``.
    """
    sharding = getattr(vllm_config, "sharding_config", None)
    if sharding is not None and hasattr(sharding, "total_dp_size"):
        n = int(sharding.total_dp_size)
        if n > 1:
            st = sharding.sharding_strategy
            return n, (f"tpu-inference sharding: data_parallelism={st.data_parallelism}, "
                       f"attention_data_parallelism={st.attention_data_parallelism}, "
                       f"attention_data_expert_parallelism={st.attention_data_expert_parallelism}")
    sched_cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    name = sched_cls if isinstance(sched_cls, str) else getattr(sched_cls, "__name__", "")
    if name and name.rsplit(".", 1)[-1] == "DPScheduler":
        return 2, f"scheduler_cls={name}"
    strategy = ((getattr(vllm_config, "additional_config", None) or {}).get("sharding") or {}).get(
        "sharding_strategy") or {}
    if sharding is None:  # not configured by tpu-inference's platform (yet): read what it would read
        attn = strategy.get("attn_dp_size")
        if strategy.get("enable_dp_attention") and (attn is None or int(attn) > 1):
            return int(attn or 2), (f"additional_config.sharding.sharding_strategy.enable_dp_attention="
                                    f"{strategy.get('enable_dp_attention')}")
    n = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    return n, f"data_parallel_size={n}"


def dp_scheduler_ranks(vllm_config) -> int | None:
    """The ranks tpu-inference's DPScheduler runs (``sharding_config.total_dp_size``; None: not configured
    by tpu-inference's platform, so no DPScheduler merges our metadata)."""
    sharding = getattr(vllm_config, "sharding_config", None)
    n = getattr(sharding, "total_dp_size", None)
    return int(n) if n is not None and int(n) > 1 else None


# Speculative methods with no draft model: no draft KV layers in runner.kv_caches. Exactly those
# tpu-inference 0.32 runs with a host-side vLLM proposer (runner/tpu_runner.py _init_speculative_decoding
# builds only NgramProposer without a model and raises NotImplementedError for any other method it does not
# know; vLLM's "ngram_gpu" and "suffix" are refused there). tests/tpu/test_tpu_config.py reads that source.
MODEL_FREE_SPEC_METHODS = ("ngram",)


def unsupported_runner_mode(vllm_config) -> str | None:
    """Why tpu-inference's runner, as configured, breaks the connector's ordering (None if it does not).

    * ``additional_config.enable_continue_decode``: the fused decode loop takes
      ``runner.kv_caches`` as a donated argument inside the connector context
      and rebinds the result only after it, so ``wait_for_save`` (and an
      async ``start_load_kv``) would read deleted arrays.
    * speculative decoding with a draft model (eagle3, dflash, mtp, ...): the
      drafter writes its own KV layers after the connector context has closed,
      so a stored chunk would hold the draft layers' previous bytes for the
      step's positions, and a restored one would feed them to the drafter.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    if extra.get("enable_continue_decode"):
        return (f"additional_config.enable_continue_decode={extra.get('enable_continue_decode')!r}: tpu-inference's "
                "fused decode loop donates runner.kv_caches before the runner rebinds them, so the connector "
                "would read deleted caches. Turn enable_continue_decode off to offload KV")
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    if spec is not None and method not in MODEL_FREE_SPEC_METHODS:
        return (f"speculative_config.method={method!r}: the draft model writes its KV layers after the connector "
                "has stored the step's chunks, so stored draft layers would be stale. Allowed with offloading: "
                f"no speculative decoding, or a method without a draft model ({', '.join(MODEL_FREE_SPEC_METHODS)})")
    return None


def kv_head_replicas(vllm_config, kv_cache_config) -> int:
    """How many times tpu-inference repeats each KV head in the cache (1: not at all).

    With fewer KV heads than the head-sharding degree, tpu-inference pads the
    heads to that degree by repeating each one (``get_padded_num_heads``,
    weight loading with ``jnp.repeat``), and the KV-cache spec it hands vLLM
    counts the padded heads. Padded / real is the repeat count.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    model = getattr(vllm_config, "model_config", None)
    if not groups or model is None or getattr(model, "use_mla", False):
        return 1
    total = int(model.get_total_num_kv_heads())
    found = set()
    from tpu_offload.connector.sizing import layer_specs

    specs = [s for g in groups for s in (layer_specs(g.kv_cache_spec) or {"": g.kv_cache_spec}).values()]
    for spec in specs:
        heads = getattr(spec, "num_kv_heads", None)
        if heads and total and heads > total and heads % total == 0:
            found.add(heads // total)
        else:
            found.add(1)
    if len(found) > 1:
        raise ValueError(f"KV-cache groups repeat their heads differently ({sorted(found)}); not supported")
    return found.pop()


def shutdown_worker_half(scheduler_connector) -> None:
    """Shut down this process's worker half of the connector, if it is ours and still up.

    vLLM's GPU worker calls ``ensure_kv_transfer_shutdown`` when it shuts down;
    tpu-inference's ``TPUWorker`` has no ``shutdown``, so its worker half would
    never drain, flush file writes or save the warm-restart slabs. On a single
    host (uni executor) both halves live in the EngineCore process, whose
    shutdown reaches the scheduler half: it shuts the worker half down first.
    """
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = getattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    if agent is None or agent is scheduler_connector or getattr(agent, "worker", None) is None:
        return
    if not type(agent).__module__.startswith("tpu_offload.connector"):
        return
    kv_transfer_state.ensure_kv_transfer_shutdown()


# Executors whose shutdown never reaches the workers' connectors: a multi-host replica's Ray workers
# are killed (tpu-inference's RayDistributedExecutorV2: ray.kill) or simply left to die with the job
# (vLLM's RayDistributedExecutor, which tpu-inference's v1 executor inherits), and the EngineCore
# shuts the executor down before its scheduler, so the scheduler half's shutdown comes too late.
RAY_EXECUTOR_MODULES = (
    "vllm.v1.executor.ray_executor",
    "vllm.v1.executor.ray_executor_v2",
    "tpu_inference.executors.ray_distributed_executor",
    "tpu_inference.executors.ray_distributed_executor_v2",
)
_FLUSH_MARK = "_tpu_offload_flushes_workers"
FLUSH_TIMEOUT_S = 120.0


def shut_down_worker_connector(worker=None) -> bool:
    """Run on every worker by ``collective_rpc``: shut our worker half down (drain transfers, land file
    writes, save the warm-restart slabs). True if this process had one up."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = getattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    half = getattr(agent, "worker", None)
    if half is None or not type(agent).__module__.startswith("tpu_offload.connector") or half.engine is None:
        return False
    half.shutdown()
    return True


def _flush_workers(executor) -> None:
    if getattr(executor, "_tpu_offload_flushed", False) or getattr(executor, "shutting_down", False):
        return
    executor._tpu_offload_flushed = True
    try:
        executor.collective_rpc(shut_down_worker_connector, timeout=FLUSH_TIMEOUT_S)
    except Exception as e:  # a dead or hung worker: the executor's own shutdown still runs
        import logging

        logging.getLogger(__name__).warning("tpu_offload: could not shut the workers' connectors down before the "
                                            "executor (%s): their pending file writes and snapshots may be lost", e)


def install_executor_flush(modules=None) -> int:
    """Make the Ray executors' ``shutdown`` shut our workers' connectors down first (idempotent).

    Only executor classes already imported are wrapped (in the EngineCore the
    executor exists before the scheduler's connector). Returns the classes wrapped now.
    """
    import sys

    done = 0
    for name in RAY_EXECUTOR_MODULES if modules is None else modules:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for cls in list(vars(mod).values()):
            if not (isinstance(cls, type) and cls.__module__ == name and "shutdown" in vars(cls)
                    and hasattr(cls, "collective_rpc")):
                continue
            orig = vars(cls)["shutdown"]
            if getattr(orig, _FLUSH_MARK, False):
                continue

            def shutdown(self, *args, _orig=orig, **kwargs):
                _flush_workers(self)
                return _orig(self, *args, **kwargs)

            shutdown.__wrapped__ = orig
            setattr(shutdown, _FLUSH_MARK, True)
            cls.shutdown = shutdown
            done += 1
    return done
