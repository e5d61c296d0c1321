"""The self-check in CI: the shipped config, Qwen3-32B on TPU7x (compile-only), CPU round trip.

The conftest resolved vLLM's platform (``prepare_vllm``), which a TPU host
does by itself; the self-check's ``main()`` is then what the CLI runs. Host
memory figures are injected: the CI box is not a TPU7x host with ~900 GB.
"""

import json
import os

import pytest

from tpu_offload import selfcheck
from tpu_offload.connector import aot
from tpu_offload.jax_backend import memory, roundtrip

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SHIPPED = os.path.join(ROOT, "configs", "tpu-inference", "offload.json")
GIB = 1 << 30
TPU7X_HOST = memory.HostMemory(mem_total=944 * GIB, mem_available=900 * GIB)  # a tpu7x-8 VM, engine not started
ARGS = ["--model", "Qwen3-32B", "--tp", "8", "--num-blocks", "20000", "--topology", "TPU7x:2x2x1"]


def run(tmp_path, *extra, config=SHIPPED, host=TPU7X_HOST, name="r.json"):
    out = tmp_path / name
    rc = selfcheck.main(["--config", config, *ARGS, "--out", str(out), *extra], host=host)
    return rc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The TPU7x host with vm.max_map_count raised as configs/kustomize/tpu-v7's init container does."""
    d = tmp_path_factory.mktemp("selfcheck")
    (d / "max_map_count").write_text("33554432\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "MAP_COUNT_FILE", str(d / "max_map_count"))
        return run(d)


def test_shipped_config_passes(shipped, capsys):
    rc, rep = shipped
    assert rc == 0 and rep["verdict"] == "PASS" and rep["reasons"] == [], rep["reasons"]
    c = rep["checks"]
    assert {k: v["status"] for k, v in c.items()} == dict(config="pass", dependencies="pass", devices="pass",
                                                          host="pass", compile="pass", roundtrip="pass")
    assert "pinned_host" in next(iter(c["devices"]["memory_kinds"].values()))
    dep = rep["deployment"]  # 720 GiB of 32 MiB blocks (64 layers x 128 tokens x 8 heads x 128 x K,V x bf16)
    assert dep["block_bytes"] == 32 << 20 and dep["num_slots"] == 720 * 32 and dep["tier_bytes"] == 720 * GIB
    assert c["host"]["budget"] >= 720 * GIB and c["host"]["cgroup_limit"] is None
    comp = c["compile"]
    assert comp["target"] == "TPU7x:2x2x1" and comp["budget_failures"] == []
    # the path TPU runs: the direct kernel (auto), its kernels compiled with no scratch, the slabs in place;
    # the staging path's programs (its fallback, and HBM copies) with the DMA gather/scatter beside it
    assert comp["path"] == "direct" and comp["kernel"] == "dma" and rep["deployment"]["path"] == "direct"
    direct = comp["direct"]["programs"]
    assert {"direct_store_0_512", "direct_load_0_512", "direct_alloc_slabs"} <= set(direct)
    assert all(f["hbm_scratch"] == 0 for n, f in direct.items() if "alloc" not in n)
    assert direct["direct_store_0_512"]["host_alias"] == direct["direct_store_0_512"]["host_argument"] == 512 * (4 << 20)  # per device
    assert {"gather", "scatter", "store", "load"} <= set(comp["programs"])
    assert 0 <= comp["scratch_bytes"] < 64 << 20 and comp["staging_device_bytes"] == 1000 * (4 << 20)
    assert comp["in_flight_device_bytes"] == 0
    # bytes per pass: 1 block (4 MiB per device) to a full staging pass (1,000 blocks), and the link time
    passes = {x["blocks"]: x for x in comp["passes"]}
    assert set(passes) == {1, 16, 64, 1000} and passes[16]["moved"] == 16 * (4 << 20)
    for x in passes.values():
        assert x["programs"]["gather"]["hbm_accessed"] == 2 * x["moved"]
        assert x["link"]["devices_per_chip"] == 2 and x["link"]["chips"] == 4
    assert passes[1000]["link"]["contiguous_ms"] > passes[16]["link"]["contiguous_ms"] * 60
    rt = c["roundtrip"]
    assert rt["mismatches"] == [] and rt["platform"] == "cpu" and rt["bytes"] == 16 * rt["layers"] * (512 << 10)
    for k in ("store_gbps", "load_gbps", "raw_d2h_gbps", "raw_h2d_gbps", "store_vs_raw", "load_vs_raw"):
        assert rt[k] > 0, k


def test_default_map_count_fails_the_device_put_path(tmp_path, monkeypatch):
    """The opt-in device_put path allocates a host buffer per chunk and device: 23,040 x 8 at the default
    limit fails (the default program path needs a few buffers whatever the tier)."""
    (tmp_path / "max_map_count").write_text("65530\n")
    monkeypatch.setattr(memory, "MAP_COUNT_FILE", str(tmp_path / "max_map_count"))
    cfg = json.loads(open(SHIPPED).read())
    cfg["kv_connector_extra_config"]["transfer_path"] = "device_put"
    (tmp_path / "dp.json").write_text(json.dumps(cfg))
    rc, rep = run(tmp_path, "--skip", "compile,roundtrip", config=str(tmp_path / "dp.json"))
    assert rc == 1 and rep["checks"]["host"]["status"] == "fail"
    (reason,) = rep["reasons"]
    assert "23040 chunks x 8 local devices x 1 groups = 184320 buffers" in reason and "vm.max_map_count" in reason


def test_slow_round_trip_fails_on_an_accelerator():
    """Below half a raw device_put's GB/s on a TPU the round trip FAILs (not a warning); CPU figures
    say nothing about a TPU's host link and never fail."""
    r = {"store_vs_raw": 0.3, "load_vs_raw": 0.9}
    assert selfcheck.too_slow(r, accel=True) == ("our store/load reach only store_vs_raw 0.3x the GB/s of a raw "
                                                 "jax.device_put of the same bytes (threshold 0.5x)")
    assert selfcheck.too_slow(r, accel=False) is None
    assert selfcheck.too_slow({"store_vs_raw": 0.5, "load_vs_raw": 1.2}, accel=True) is None


def test_tier_that_does_not_fit_fails_with_the_numbers(tmp_path, capsys):
    """A 512 GiB cgroup on that VM: the cgroup binds, not MemAvailable."""
    host = memory.HostMemory(mem_total=944 * GIB, mem_available=900 * GIB, cgroup="/pod",
                             cgroup_limit=512 * GIB, cgroup_usage=12 * GIB)
    rc, rep = run(tmp_path, "--skip", "compile,roundtrip", host=host)
    assert rc == 1 and rep["verdict"] == "FAIL"
    (reason,) = rep["reasons"]
    assert reason.startswith("host: the host tier needs 720.00 GiB") and "cgroup /pod: limit 512.00 GiB" in reason
    assert "Lower num_cpu_chunks" in reason and rep["checks"]["host"]["budget"] < 500 * GIB
    out = capsys.readouterr().out
    assert out.startswith("tpu_offload selfcheck: FAIL\n") and "\n  FAIL host: the host tier needs 720.00 GiB" in out


def test_memory_kind_the_devices_lack_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "device_memory_kinds", lambda d: frozenset({"device", "unpinned_host"}))
    rc, rep = run(tmp_path, "--skip", "compile")
    assert rc == 1 and rep["checks"]["devices"]["status"] == "fail"
    assert rep["checks"]["roundtrip"]["status"] == "skipped"
    assert any("host_memory_kind='pinned_host' is not offered" in r and "'unpinned_host'" in r for r in rep["reasons"])


@pytest.mark.parametrize("config, message", [
    ('{"kv_connector": "TPUOffloadConnector", "kv_connector_extra_config": {"cpu_bytes": "lots"}}',
     "key 'cpu_bytes': value 'lots' is not allowed"),
    ('{"kv_connector": "OffloadingConnector"}', "do not load this connector"),
    ("/nonexistent/offload.json", "cannot be read"),
    ('{"kv_connector": ', "not valid JSON"),
])
def test_bad_input_is_one_clear_error(tmp_path, capsys, config, message):
    rc, rep = run(tmp_path, config=config)
    assert rc == 2 and rep is None
    assert message in capsys.readouterr().err


def test_bytes_that_come_back_wrong_fail(tmp_path, monkeypatch):
    """Every chunk loaded from its neighbour's slot: the bit-for-bit comparison sees it."""
    real = roundtrip.LoadChunk
    monkeypatch.setattr(roundtrip, "LoadChunk", lambda slot, blocks: real((slot + 1) % 16, blocks))
    rc, rep = run(tmp_path, "--skip", "compile,host")
    assert rc == 1 and rep["checks"]["roundtrip"]["mismatches"] == [0, 1]
    assert rep["reasons"] == ["roundtrip: bytes loaded back differ from those stored in layers [0, 1]"]


def test_compile_only_env_matches_aot():
    assert selfcheck.COMPILE_ONLY_ENV == aot.COMPILE_ONLY_ENV
    assert set(selfcheck.MODEL_NAMES) == set(aot.MODELS)


def test_offline_sizes_the_deployment_as_the_live_check_does(shipped, tmp_path):
    """What --offline computes without tpu-inference is what the live check reads off its caches."""
    _, live = shipped
    rc, off = run(tmp_path, "--offline", name="off.json")
    assert rc == 0 and off["offline"] == "--offline"
    dep, s = live["deployment"], off["deployment"]
    for k in ("block_bytes", "blocks_per_chunk", "num_slots", "staging_blocks", "tier_bytes", "path"):
        assert s[k] == dep[k], k
    assert s["kv_head_replicas"] == dep["kv_head_replicas"]
    assert s["staging_device_bytes"] == live["checks"]["compile"]["staging_device_bytes"]


def test_topology_that_cannot_compile_here_exits_3(tmp_path, monkeypatch, capsys):
    """tpu-inference that will not import (here: vLLM's platform unresolved) cannot run the live checks:
    3, not 2 (the input is fine), pointing at --offline."""
    def refuse():
        raise selfcheck.CannotRun("tpu-inference cannot be imported here (RuntimeError: no platform)")

    monkeypatch.setattr(selfcheck, "import_tpu_inference", refuse)
    rc, rep = run(tmp_path)
    assert rc == 3 and rep is None
    assert capsys.readouterr().err.startswith("tpu_offload selfcheck: cannot run here: tpu-inference cannot")
