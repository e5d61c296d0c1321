"""Checks that the staging buffer fits in HBM and the host tier in RAM.

Each check is a function of its own, for the worker at registration and for
a self-check run before the engine. Host RAM is the least of ``MemAvailable``
and the cgroup's free memory, less a margin (``host_memory_margin``), as
``core.hostmem`` reads and checks it for both engines; the host tier's
memory kind must be one every local device offers.

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

from tpu_offload.core import hostmem
from tpu_offload.core.config import ConfigError
from tpu_offload.core.hostmem import (  # noqa: F401  (re-exported: the selfcheck and tests read them here)
    GIB,
    HostMemory,
    available_host_bytes,
    host_margin_bytes,
    host_tier_budget,
    read_cgroup_memory,
    read_host_memory,
    read_meminfo,
    size_str,
)

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
                f"the offload connector needs {size_str(need, 3)} of HBM on {d}: a staging buffer of "
                f"{staging_blocks} blocks ({size_str(staging_bytes, 3)}) and {size_str(scratch_bytes, 3)} of "
                f"transfer-program scratch, but only {size_str(free, 3)} is free after the KV cache (missing "
                f"{size_str(need - free, 3)}). Lower staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) from "
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


# ---- host memory: the backend-neutral figures and check live in core.hostmem ------------------------------
def check_host_fits(tier_bytes: int, num_slots: int, available: int | None = None, *,
                    margin: int | float = 0.05, host: HostMemory | None = None) -> None:
    """``core.hostmem.check_host_fits`` for this process's share of the TPU host tier (this module's
    ``read_host_memory``, so a test can stand in for the host's figures)."""
    hostmem.check_host_fits(tier_bytes, num_slots, available, margin=margin,
                            host=host if host is not None else read_host_memory())


# ---- host memory kind ------------------------------------------------------------
HOST_KINDS = ("pinned_host", "unpinned_host")


def device_memory_kinds(device) -> frozenset[str]:
    """The memory kinds ``device`` can address (empty where it reports none)."""
    try:
        return frozenset(m.kind for m in device.addressable_memories())
    except Exception:  # a backend without the memories API
        return frozenset()


def check_memory_kind(kind: str, devices=None) -> None:
    """Raise ConfigError unless every device (default: this process's) offers
    memory kind ``kind``, where the host tier would live."""
    devices = list(devices if devices is not None else jax.local_devices())
    offered = {d: device_memory_kinds(d) for d in devices}
    lacking = [d for d, kinds in offered.items() if kind not in kinds]
    if not lacking:
        return
    common = [k for k in HOST_KINDS if all(k in kinds for kinds in offered.values())]
    d = lacking[0]
    fix = (f"Allowed: a host memory kind every local device offers: {', '.join(map(repr, common))} (set "
           "kv_connector_extra_config key 'host_memory_kind', or TPU_OFFLOAD_USE_UNPINNED_HOST=1 for unpinned_host)"
           if common else "No host memory kind is offered by every local device: this backend cannot hold the "
           "host tier")
    raise ConfigError(
        f"host_memory_kind={kind!r} is not offered by {len(lacking)} of {len(devices)} local devices (e.g. {d}, "
        f"{getattr(d, 'device_kind', '?')}, offers {', '.join(sorted(offered[d])) or 'no memory kinds'}). {fix}."
    )


# ---- host mappings -----------------------------------------------------------------
MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
DMA_ENTRY_FILE = "/sys/module/vfio_iommu_type1/parameters/dma_entry_limit"
MAP_SHARE = 0.9  # of the limit the tier's own buffers may take; the rest is the engine's


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def check_host_buffers(num_slots: int, local_devices: int, groups: int, *,
                       max_map_count: int | None = None, dma_entry_limit: int | None = None,
                       map_count_file: str | None = None, dma_entry_file: str | None = None) -> None:
    """Raise ConfigError if a host path that allocates one host buffer per stored chunk, device and
    layer group (``device_put``) would pass 90% of the kernel's limits once the tier is full.

    Each pinned host buffer is a memory mapping (``vm.max_map_count``, 65530 by default) and, on
    a TPU host, a vfio DMA entry (``dma_entry_limit``, 65535): the shipped tier of 23,040 chunks on
    8 devices needs ~184,000 of each. Neither sysctl is namespaced, so a pod raises them only with
    a privileged init container (configs/kustomize/tpu-v7). Limits not readable here are not checked."""
    need = num_slots * local_devices * groups
    map_count_file, dma_entry_file = map_count_file or MAP_COUNT_FILE, dma_entry_file or DMA_ENTRY_FILE
    limits = {"vm.max_map_count": (max_map_count if max_map_count is not None else _read_int(map_count_file),
                                   map_count_file),
              "vfio_iommu_type1 dma_entry_limit": (dma_entry_limit if dma_entry_limit is not None
                                                   else _read_int(dma_entry_file), dma_entry_file)}
    for name, (limit, where) in limits.items():
        if limit is None or need <= MAP_SHARE * limit:
            continue
        fit = int(MAP_SHARE * limit) // max(1, local_devices * groups)
        raise ConfigError(
            f"transfer_path=device_put allocates one host buffer per stored chunk, device and layer group: "
            f"{num_slots} chunks x {local_devices} local devices x {groups} groups = {need} buffers, more than "
            f"{int(MAP_SHARE * 100)}% of {name} = {limit} ({where}). Raise {name} on the node to at least "
            f"{-(-need * 10 // 9)} (a privileged init container, as configs/kustomize/tpu-v7 does), or set "
            f"transfer_path=program (TPU_OFFLOAD_TRANSFER_PATH: preallocated slabs, a few buffers whatever the "
            f"tier), or lower num_cpu_chunks (TPU_OFFLOAD_NUM_CPU_CHUNKS) / cpu_bytes to at most {fit} chunks.")
