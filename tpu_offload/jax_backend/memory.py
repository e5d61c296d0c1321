"""Checks that the staging buffer fits in HBM and the host tier in RAM.

tpu-inference deducts staging HBM before it sizes the KV cache only for its
own connector's module path (``TPUWorker.determine_available_memory``), so
an out-of-tree connector must check once the cache exists, and the operator
must leave room with a lower ``--gpu-memory-utilization``. The check counts
the compiled transfer programs' scratch (from XLA's memory analysis), not
just the staging buffer: failing at registration with the exact shortfall
beats an out-of-memory error mid-serving.
"""

from __future__ import annotations

import logging
import math

import jax

from tpu_offload.core.config import ConfigError

GIB = 1 << 30
log = logging.getLogger(__name__)


def device_hbm(device) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) from the allocator; None where unknown (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def check_staging_fits(staging_bytes: int, scratch_bytes: int, staging_blocks: int, devices=None, *,
                       utilization: float | None = None, free_bytes: int | None = None,
                       limit_bytes: int | None = None) -> None:
    """Raise ConfigError unless staging + transfer scratch fit in the HBM the KV cache left free.

    Called once the KV cache exists: tpu-inference sizes it first and deducts
    staging only for its own connector. All figures are per device;
    ``free_bytes``/``limit_bytes`` override the allocator's (tests, or
    backends that report none). What is free then is tpu-inference's
    ``1 - gpu_memory_utilization`` headroom for the model's own scratch, which
    nothing here can measure: taking a share of it is logged with the
    utilization that would keep the model's headroom whole.
    """
    devices = list(devices if devices is not None else jax.local_devices())
    need = staging_bytes + scratch_bytes
    for d in devices:
        stats = device_hbm(d)
        limit = limit_bytes if limit_bytes is not None else (stats[0] if stats else None)
        free = free_bytes if free_bytes is not None else (stats[0] - stats[1] if stats else None)
        if free is None:
            continue
        keep = _util_for(utilization, need, limit)
        if need > free:
            per_block = max(1, need // max(1, staging_blocks))  # staging and scratch both grow with the blocks
            lower = ""
            if keep is not None:
                short = _util_for(utilization, need - free, limit)
                lower = (f", or lower --gpu-memory-utilization from {utilization} to at most {short} so the KV "
                         f"cache leaves room for it ({keep} also keeps the model's own headroom whole)")
            raise ConfigError(
                f"the offload connector needs {need / GIB:.3f} GiB of HBM on {d}: a staging buffer of "
                f"{staging_blocks} blocks ({staging_bytes / GIB:.3f} GiB) and {scratch_bytes / GIB:.3f} GiB of "
                f"transfer-program scratch, but only {free / GIB:.3f} GiB is free after the KV cache (missing "
                f"{(need - free) / GIB:.3f} GiB). Lower staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) from "
                f"{staging_blocks} to at most {free // per_block}{lower}."
            )
        if keep is not None and need > 0:
            log.warning(
                "tpu_offload: staging and transfer scratch take %.3f GiB of the %.3f GiB of HBM on %s that "
                "tpu-inference left free for the model's own scratch (1 - gpu_memory_utilization); if the model "
                "runs out of HBM, lower --gpu-memory-utilization from %s to %s", need / GIB, free / GIB, d,
                utilization, keep)


def _util_for(utilization: float | None, nbytes: int, limit: int | None) -> float | None:
    """The gpu_memory_utilization that shrinks the KV cache by ``nbytes`` (3 decimals, rounded down)."""
    if utilization is None or not limit:
        return None
    return max(0.0, math.floor((utilization - nbytes / limit) * 1000) / 1000)


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_fits(tier_bytes: int, num_slots: int, available: int | None = None) -> None:
    """Raise ConfigError if this process's share of the host tier exceeds available RAM."""
    available = available if available is not None else available_host_bytes()
    if available is None or tier_bytes <= available:
        return
    per_slot = max(1, tier_bytes // max(1, num_slots))
    raise ConfigError(
        f"the host tier needs {tier_bytes / GIB:.2f} GiB of host memory in this process, but only "
        f"{available / GIB:.2f} GiB is available (missing {(tier_bytes - available) / GIB:.2f} GiB). "
        f"Lower num_cpu_chunks (TPU_OFFLOAD_NUM_CPU_CHUNKS) from {num_slots} to at most "
        f"{available // per_slot}, or cpu_bytes accordingly."
    )
