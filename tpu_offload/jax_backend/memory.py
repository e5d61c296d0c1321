"""Checks that the staging buffer fits in HBM and the host tier in RAM.

Each check is a function of its own, for the worker at registration and for
a self-check run before the engine. Host RAM is the least of ``MemAvailable``
and the cgroup's free memory, less a margin (``host_memory_margin``); the
host tier's memory kind must be one every local device offers.

tpu-inference deducts staging HBM before it sizes the KV cache only for its
own connector's module path (``TPUWorker.determine_available_memory``), so
an out-of-tree connector must check once the cache exists, and the operator
must leave room with a lower ``--gpu-memory-utilization``. The check counts
the compiled transfer programs' scratch (from XLA's memory analysis), not
just the staging buffer: failing at registration with the exact shortfall
beats an out-of-memory error mid-serving.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax

from tpu_offload.core.config import ConfigError

GIB = 1 << 30


def size_str(n: float, digits: int = 2) -> str:
    """Bytes for a message: GiB, or MiB below one GiB (a small tier must not read as "0.00 GiB")."""
    return f"{n / GIB:.{digits}f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.{digits - 1}f} MiB"
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


# ---- host memory -------------------------------------------------------------
# Below this a cgroup v1 limit means "none" (v1 reports 2**63 rounded down to a page).
_V1_UNLIMITED = 1 << 60


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Host memory this process may still take, from each source that limits it.

    ``MemAvailable`` is the whole machine's; in a container the cgroup limit
    binds first. The cgroup's usage counts file cache (e.g. the weights just
    read), which the kernel reclaims before the limit kills anything, so its
    file pages (``active_file`` + ``inactive_file``) are not counted as used,
    as ``MemAvailable`` does for the machine. tmpfs and shared memory still count."""

    mem_total: int | None = None  # /proc/meminfo MemTotal
    mem_available: int | None = None  # /proc/meminfo MemAvailable
    cgroup: str | None = None  # the cgroup (or ancestor) whose limit leaves the least
    cgroup_limit: int | None = None  # its memory.max (v2) / memory.limit_in_bytes (v1)
    cgroup_usage: int | None = None  # its memory.current / memory.usage_in_bytes less file cache

    @property
    def cgroup_free(self) -> int | None:
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage)

    @property
    def available(self) -> int | None:
        """The least any source leaves free; None when no source is known."""
        known = [b for b in (self.mem_available, self.cgroup_free) if b is not None]
        return min(known) if known else None

    @property
    def total(self) -> int | None:
        """The memory this process can ever have: the machine's, or its cgroup limit if smaller."""
        known = [b for b in (self.mem_total, self.cgroup_limit) if b is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = []
        if self.mem_available is not None:
            parts.append(f"MemAvailable {size_str(self.mem_available)}"
                         + (f" of {size_str(self.mem_total)}" if self.mem_total is not None else ""))
        if self.cgroup_limit is not None:
            parts.append(f"cgroup {self.cgroup}: limit {size_str(self.cgroup_limit)}, "
                         f"{size_str(self.cgroup_usage or 0)} in use")
        return "; ".join(parts) or "no host memory figures"


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes; empty where there is none."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str, keys: tuple[str, ...]) -> int:
    """The sum of ``keys`` in a ``memory.stat`` file."""
    total = 0
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name in keys and value.strip().isdigit():
            total += int(value)
    return total


def read_cgroup_memory(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
                       ) -> tuple[str, int, int] | None:
    """(cgroup, limit, usage) of this process's memory cgroup or the ancestor
    whose limit leaves the least free; None when no level has a limit.

    ``root``: where the cgroup filesystems are mounted; ``self_cgroup``: this
    process's membership file (both injectable for tests). cgroup v1's
    memory controller, where mounted, takes precedence (hybrid hosts); else v2.
    A path that is not under ``root`` (a container without its own cgroup
    namespace) falls back to the root of the mount, the container's own."""
    membership = (_read(self_cgroup) or "").splitlines()
    v1 = next((line.split(":", 2)[2] for line in membership
               if line.count(":") >= 2 and "memory" in line.split(":", 2)[1].split(",")), None)
    if v1 is not None and os.path.isdir(os.path.join(root, "memory")):
        base, rel = os.path.join(root, "memory"), v1
        limit_f, usage_f, cache = "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file",
                                                                                   "total_inactive_file")
    else:
        rel = next((line[3:] for line in membership if line.startswith("0::")), None)
        if rel is None:
            return None
        base, limit_f, usage_f, cache = root, "memory.max", "memory.current", ("active_file", "inactive_file")
    here = os.path.normpath(os.path.join(base, rel.strip().lstrip("/")))
    if not here.startswith(os.path.normpath(base)) or not os.path.isdir(here):
        here = os.path.normpath(base)
    best = None
    while True:
        limit, usage = _read(os.path.join(here, limit_f)), _read(os.path.join(here, usage_f))
        if limit and limit.isdigit() and usage and usage.isdigit() and int(limit) < _V1_UNLIMITED:
            used = max(0, int(usage) - _stat(os.path.join(here, "memory.stat"), cache))
            name = "/" + os.path.relpath(here, base).replace(os.sep, "/").removeprefix(".")
            if best is None or int(limit) - used < best[1] - best[2]:
                best = (name.rstrip("/") or "/", int(limit), used)
        if os.path.normpath(here) == os.path.normpath(base):
            return best
        here = os.path.dirname(here)


def read_host_memory(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                     self_cgroup: str = "/proc/self/cgroup") -> HostMemory:
    info = read_meminfo(meminfo)
    cg = read_cgroup_memory(cgroup_root, self_cgroup)
    return HostMemory(mem_total=info.get("MemTotal"), mem_available=info.get("MemAvailable"),
                      **(dict(zip(("cgroup", "cgroup_limit", "cgroup_usage"), cg)) if cg else {}))


def available_host_bytes() -> int | None:
    return read_host_memory().available


def host_margin_bytes(margin: int | float, total: int) -> int:
    """``host_memory_margin`` in bytes: an int is bytes, a float a fraction of ``total``."""
    return int(margin) if isinstance(margin, int) else int(margin * total)


def host_tier_budget(host: HostMemory, margin: int | float) -> int | None:
    """Bytes a host tier may take: what is available less the margin; None when unknown."""
    free = host.available
    if free is None:
        return None
    return max(0, free - host_margin_bytes(margin, host.total if host.total is not None else free))


def check_host_fits(tier_bytes: int, num_slots: int, available: int | None = None, *,
                    margin: int | float = 0.05, host: HostMemory | None = None) -> None:
    """Raise ConfigError if this process's share of the host tier exceeds what the
    host leaves it: the least of ``MemAvailable`` and the cgroup's free memory,
    less ``margin`` (``host_memory_margin``) kept for the engine and the rest of
    the host. ``available`` overrides the measured figure; ``host`` every one."""
    host = host if host is not None else read_host_memory()
    if available is not None:
        host = dataclasses.replace(host, mem_available=available, cgroup_limit=None, cgroup_usage=None)
    budget = host_tier_budget(host, margin)
    if budget is None or tier_bytes <= budget:
        return
    free = host.available
    keep = free - budget
    per_slot = max(1, tier_bytes // max(1, num_slots))
    raise ConfigError(
        f"the host tier needs {size_str(tier_bytes)} of host memory in this process, but only "
        f"{size_str(budget)} may be used (missing {size_str(tier_bytes - budget)}): {size_str(free)} "
        f"is available ({host.describe()}) and host_memory_margin={margin!r} keeps {size_str(keep)} of it for "
        f"the engine and the rest of the host. Lower num_cpu_chunks (TPU_OFFLOAD_NUM_CPU_CHUNKS) from {num_slots} "
        f"to at most {budget // per_slot}, or cpu_bytes accordingly, or lower host_memory_margin "
        f"(TPU_OFFLOAD_HOST_MEMORY_MARGIN)."
    )


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
    text = _read(path)
    return int(text) if text and text.isdigit() else None


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
