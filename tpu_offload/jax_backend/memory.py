"""Checks that the staging buffer fits in HBM and the host tier in RAM.

tpu-inference reserves staging HBM only for its own connector's module path,
so an out-of-tree connector must check (and the operator must leave room,
e.g. with a lower ``--gpu-memory-utilization``). Failing at registration with
the exact shortfall beats an out-of-memory error mid-serving.
"""

from __future__ import annotations

import jax

from tpu_offload.core.config import ConfigError

GIB = 1 << 30


def free_device_bytes(device) -> int | None:
    """Free HBM on ``device`` from its allocator stats; None where unknown (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_staging_fits(per_device_bytes: int, staging_blocks: int, devices=None,
                       free_bytes: int | None = None) -> None:
    """Raise ConfigError if ``per_device_bytes`` of staging exceed free HBM.

    ``free_bytes`` overrides the allocator's figure (tests, or backends that
    report none).
    """
    devices = list(devices if devices is not None else jax.local_devices())
    for d in devices:
        free = free_bytes if free_bytes is not None else free_device_bytes(d)
        if free is None or per_device_bytes <= free:
            continue
        per_block = max(1, per_device_bytes // max(1, staging_blocks))
        fits = max(0, free // per_block)
        raise ConfigError(
            f"the HBM staging buffer needs {per_device_bytes / GIB:.2f} GiB on {d}, but only "
            f"{free / GIB:.2f} GiB is free (missing {(per_device_bytes - free) / GIB:.2f} GiB). "
            f"Lower staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) from {staging_blocks} to at most "
            f"{fits}, or lower --gpu-memory-utilization so the KV cache leaves room for it."
        )


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
