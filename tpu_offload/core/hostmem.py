"""Host memory a tier may take, from ``/proc/meminfo`` and the cgroup: one check for both engines.

A host tier is allocated once and touched at start (prefaulted or pinned).
Past what the host, or the container's cgroup, leaves, that is a kernel OOM
kill (exit 137) with no message; so each engine checks first, with these
figures, and refuses with them: the TPU connector at registration
(``jax_backend.memory``), the vLLM spec before its workers allocate
(``gpu_offload.vllm.spec``). Backend-neutral: reads files, imports neither
jax nor torch.

Available is the least of ``MemAvailable`` and the cgroup's free memory,
less ``host_memory_margin`` kept for the engine and the rest of the host.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from tpu_offload.core.config import ConfigError

GIB = 1 << 30


def size_str(n: float, digits: int = 2) -> str:
    """Bytes for a message: GiB, or MiB below one GiB (a small tier must not read as "0.00 GiB")."""
    return f"{n / GIB:.{digits}f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.{digits - 1}f} MiB"


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
                    margin: int | float = 0.05, host: HostMemory | None = None, where: str = "in this process",
                    fix: Callable[[int], str] | None = None) -> None:
    """Raise ConfigError if ``tier_bytes`` (``num_slots`` slots) exceed what the host leaves a tier: the
    least of ``MemAvailable`` and the cgroup's free memory, less ``margin`` (``host_memory_margin``) kept
    for the engine and the rest of the host. ``available`` overrides the measured figure; ``host`` every
    one. ``where`` says whose tier it is; ``fix(slots that fit)`` the engine's own advice."""
    host = host if host is not None else read_host_memory()
    if available is not None:
        host = dataclasses.replace(host, mem_available=available, cgroup_limit=None, cgroup_usage=None)
    budget = host_tier_budget(host, margin)
    if budget is None or tier_bytes <= budget:
        return
    free = host.available
    keep = free - budget
    per_slot = max(1, tier_bytes // max(1, num_slots))
    fit = budget // per_slot
    advice = fix(fit) if fix is not None else (
        f"Lower num_cpu_chunks (TPU_OFFLOAD_NUM_CPU_CHUNKS) from {num_slots} to at most {fit}, or cpu_bytes "
        "accordingly, or lower host_memory_margin (TPU_OFFLOAD_HOST_MEMORY_MARGIN).")
    raise ConfigError(
        f"the host tier needs {size_str(tier_bytes)} of host memory {where}, but only "
        f"{size_str(budget)} may be used (missing {size_str(tier_bytes - budget)}): {size_str(free)} "
        f"is available ({host.describe()}) and host_memory_margin={margin!r} keeps {size_str(keep)} of it for "
        f"the engine and the rest of the host. {advice}"
    )
