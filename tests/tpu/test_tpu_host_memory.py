"""The host tier must leave host memory to the engine, and must live in a memory
kind every local device offers: refused at registration, with the figures.

Host memory is the least of ``MemAvailable`` and the cgroup's free memory
(v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
``memory.usage_in_bytes``, file cache left out), less ``host_memory_margin``.
Before, only ``MemAvailable`` counted and nothing was kept: a 781 GiB tier
passed on a ~900 GB VM.
"""

from __future__ import annotations

import pytest

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.jax_backend import memory
from tpu_offload.jax_backend.memory import HostMemory

GIB = 1 << 30
MARGIN = OffloadConfig().host_memory_margin  # the shipped default
VM_900GB = HostMemory(mem_total=838 * GIB, mem_available=800 * GIB)  # ~900 GB VM, engine not started yet


def write_tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_781_gib_tier_no_longer_passes_on_a_900_gb_vm():
    with pytest.raises(ConfigError) as e:
        memory.check_host_fits(781 * GIB, 781, host=VM_900GB, margin=MARGIN)  # 5% of 838 GiB
    msg = str(e.value)
    assert "758.10 GiB may be used" in msg and "host_memory_margin=0.05 keeps 41.90 GiB" in msg
    assert "MemAvailable 800.00 GiB of 838.00 GiB" in msg and "at most 758" in msg
    memory.check_host_fits(758 * GIB, 758, host=VM_900GB, margin=MARGIN)


def test_the_tpu_v7_overlay_fits_its_pod():
    """configs/kustomize/tpu-v7: a 784 GiB pod limit for the 720 GiB tier; upstream's 25000 chunks do not fit."""
    pod = HostMemory(mem_total=894 * GIB, mem_available=850 * GIB, cgroup="/kubepods/pod", cgroup_limit=784 * GIB,
                     cgroup_usage=20 * GIB)  # the engine's own, file cache (the weights read) left out
    memory.check_host_fits(720 * GIB, 23040, host=pod, margin=MARGIN)
    with pytest.raises(ConfigError, match=r"needs 781.25 GiB .* only 724.80 GiB may be used"):
        memory.check_host_fits(25000 * 32 << 20, 25000, host=pod, margin=MARGIN)


@pytest.mark.parametrize("margin,budget", [(0.1, 716.2), (0.25, 590.5), (0.0, 800.0), (64 * GIB, 736.0)])
def test_margin_as_fraction_or_bytes(margin, budget):
    assert memory.host_tier_budget(VM_900GB, margin) / GIB == pytest.approx(budget)


def test_cgroup_v2_limit_binds_before_memavailable(tmp_path):
    """A pod limit two levels up binds; the container's own is 'max'; file cache is reclaimable."""
    write_tree(tmp_path, {
        "self": "0::/kubepods/pod1/ctr\n",
        "meminfo": "MemTotal:       878706688 kB\nMemAvailable:   838860800 kB\n",
        "cg/kubepods/memory.max": "max\n", "cg/kubepods/memory.current": "900\n",
        "cg/kubepods/pod1/memory.max": f"{100 * GIB}\n", "cg/kubepods/pod1/memory.current": f"{60 * GIB}\n",
        "cg/kubepods/pod1/memory.stat": f"anon 1\ninactive_file {6 * GIB}\nactive_file {4 * GIB}\nshmem 9\n",
        "cg/kubepods/pod1/ctr/memory.max": "max\n", "cg/kubepods/pod1/ctr/memory.current": f"{59 * GIB}\n",
    })
    host = memory.read_host_memory(str(tmp_path / "meminfo"), str(tmp_path / "cg"), str(tmp_path / "self"))
    assert (host.cgroup, host.cgroup_limit, host.cgroup_usage) == ("/kubepods/pod1", 100 * GIB, 50 * GIB)
    assert host.available == 50 * GIB and host.total == 100 * GIB and host.mem_available == 800 * GIB
    with pytest.raises(ConfigError, match=r"cgroup /kubepods/pod1: limit 100.00 GiB, 50.00 GiB in use"):
        memory.check_host_fits(48 * GIB, 48, host=host, margin=MARGIN)  # fits MemAvailable, not the pod
    memory.check_host_fits(45 * GIB, 45, host=host, margin=MARGIN)  # 50 - 5% of 100


def test_cgroup_v1_memory_controller(tmp_path):
    write_tree(tmp_path, {
        "self": "4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n",
        "cg/memory/memory.limit_in_bytes": "9223372036854771712\n", "cg/memory/memory.usage_in_bytes": "1\n",
        "cg/memory/docker/abc/memory.limit_in_bytes": f"{32 * GIB}\n",
        "cg/memory/docker/abc/memory.usage_in_bytes": f"{8 * GIB}\n",
        "cg/memory/docker/abc/memory.stat": f"inactive_file 7\ntotal_inactive_file {GIB}\ntotal_active_file {GIB}\n",
    })
    assert memory.read_cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "self")) == ("/docker/abc", 32 * GIB, 6 * GIB)


def test_container_view_and_no_limit(tmp_path):
    """A host path not under the mount (no cgroup namespace): the mount root is the container's own.
    No limit anywhere (v2 'max', v1 2**63): MemAvailable alone, as before."""
    write_tree(tmp_path, {"self": "0::/system.slice/x.scope\n", "cg/memory.max": f"{4 * GIB}\n",
                          "cg/memory.current": f"{GIB}\n"})
    assert memory.read_cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "self")) == ("/", 4 * GIB, GIB)
    write_tree(tmp_path, {"cg/memory.max": "max\n"})
    assert memory.read_cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "self")) is None
    assert memory.read_cgroup_memory(str(tmp_path / "none"), str(tmp_path / "missing")) is None


@pytest.mark.parametrize("value,want", [
    ("0.2", 0.2), ("15%", 0.15), (0.05, 0.05), ("0", 0.0), (0, 0.0), ("16GiB", 16 * GIB), (GIB, GIB),
    ("1073741824", GIB),
])
def test_margin_config_values(value, want):
    got = OffloadConfig.from_sources({"host_memory_margin": value}, env={}).host_memory_margin
    assert got == want and type(got) is type(want)  # float: a fraction; int: bytes
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_HOST_MEMORY_MARGIN": str(value)}).host_memory_margin == want


@pytest.mark.parametrize("value", ["-0.1", "150%", "100%", 1.5, "lots", True, "nan", [1]])
def test_bad_margin_named(value):
    with pytest.raises(ConfigError, match=r"key 'host_memory_margin': value .* is not allowed; allowed: a fraction of "
                                          r"host memory below 1 \(e.g. 0.1 or '10%'\), a size such as '16GiB', or 0"):
        OffloadConfig.from_sources({"host_memory_margin": value}, env={})
    with pytest.raises(ConfigError, match=r"TPU_OFFLOAD_HOST_MEMORY_MARGIN: value .* is not allowed"):
        OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_HOST_MEMORY_MARGIN": str(value)})


class OnlyUnpinned:
    """A device whose host memory is unpinned only (as some PJRT backends offer)."""

    device_kind = "TPU v0"
    id = 3

    def addressable_memories(self):
        import types

        return [types.SimpleNamespace(kind=k) for k in ("device", "unpinned_host")]

    def __repr__(self):
        return "TpuDevice(id=3)"


def test_every_device_must_offer_the_host_memory_kind():
    import jax

    devices = jax.local_devices()[:4]
    memory.check_memory_kind("pinned_host", devices)  # JAX CPU offers both host kinds
    memory.check_memory_kind("unpinned_host", devices + [OnlyUnpinned()])
    with pytest.raises(ConfigError) as e:
        memory.check_memory_kind("pinned_host", devices + [OnlyUnpinned()])
    assert str(e.value) == (
        "host_memory_kind='pinned_host' is not offered by 1 of 5 local devices (e.g. TpuDevice(id=3), TPU v0, "
        "offers device, unpinned_host). Allowed: a host memory kind every local device offers: 'unpinned_host' "
        "(set kv_connector_extra_config key 'host_memory_kind', or TPU_OFFLOAD_USE_UNPINNED_HOST=1 for "
        "unpinned_host).")


def test_registration_runs_both_checks(harnesses, monkeypatch):
    """The worker refuses at registration: a host that leaves too little, a device without the kind."""
    extra = {"cpu_bytes": "64MiB", "staging_blocks": 8}
    monkeypatch.setattr(memory, "read_host_memory", lambda: HostMemory(mem_total=8 * GIB, mem_available=GIB // 8))
    with pytest.raises(ConfigError, match=r"host tier needs 64.0 MiB .* only 0.0 MiB may be used"):
        harnesses(extra)  # 128 MiB available, 819 MiB margin
    harnesses({**extra, "host_memory_margin": 0})  # the margin is the config's
    monkeypatch.undo()
    monkeypatch.setattr(memory, "device_memory_kinds", lambda d: frozenset({"device", "unpinned_host"}))
    with pytest.raises(ConfigError, match=r"host_memory_kind='pinned_host' is not offered by 8 of 8 local devices"):
        harnesses(extra)
    harnesses({**extra, "host_memory_kind": "unpinned_host"})
