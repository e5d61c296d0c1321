"""The self-check where people first run it: a laptop or CI, without a TPU (``selfcheck --offline``).

It must validate the config, size the deployment and find the packages the
config needs without importing tpu-inference (whose import polls the GCE
metadata server for ~20 s off a TPU host) or JAX, and exit 0 pass, 1 fail,
2 bad input, 3 cannot run here. The live checks are in tests/tpu_compiler.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tpu_offload import preflight, selfcheck

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = str(ROOT / "configs" / "tpu-inference" / "offload.json")
GIB, MIB = 1 << 30, 1 << 20
TPU7X = ["--model", "Qwen3-32B", "--tp", "8", "--topology", "TPU7x:2x2x1"]


def ktc(**extra) -> str:
    return json.dumps({"kv_connector": "TPUOffloadConnector", "kv_connector_module_path": "tpu_offload.connector",
                       "kv_connector_extra_config": {"cpu_bytes": "720GiB", "staging_blocks": 1000, **extra}})


@pytest.fixture(autouse=True)
def _no_offload_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
        monkeypatch.delenv(k)


def offline(tmp_path, *argv):
    out = tmp_path / "r.json"
    rc = selfcheck.main(["--offline", "--out", str(out), *argv])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_cli_offline_passes_fast_without_tpu_inference_or_jax(tmp_path):
    """The shipped config, as a user runs it: exit 0 in well under the ~20 s tpu-inference's import polls
    the metadata server for, one line per check, and neither tpu-inference nor JAX imported."""
    probe = ("import sys, runpy; sys.argv = ['selfcheck'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('tpu_offload.selfcheck', run_name='__main__')\n"
             "finally:\n    print('imported:', sorted(m for m in ('jax', 'tpu_inference', 'vllm', 'torch') "
             "if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_OFFLOAD_")}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", probe, "--config", SHIPPED, *TPU7X, "--offline"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 10, took
    assert "imported: []" in r.stdout and "Metadata" not in r.stdout + r.stderr and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].startswith("tpu_offload selfcheck: PASS (offline: --offline")
    checks = [ln.split()[0] for ln in lines[1:-1]]
    assert checks == ["config", "dependencies", "sizing", "budgets", "hbm", "host"], lines
    assert not list(tmp_path.iterdir())  # offline writes no report unless --out asks


def test_no_tpu_and_no_topology_goes_offline_by_itself(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "_has_tpu", lambda: False)
    rc = selfcheck.main(["--config", SHIPPED, "--model", "Qwen3-32B", "--tp", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "(offline: " in out.splitlines()[0] and "sizing       pass" in out


def test_tpu_inference_missing_goes_offline_and_topology_then_cannot_run(tmp_path, monkeypatch, capsys):
    """Without tpu-inference: offline by itself; but --topology asks for a compile, which cannot run (3)."""
    real = selfcheck.importlib.util.find_spec
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tpu_inference" else real(name, *a))
    monkeypatch.setattr(selfcheck, "_has_tpu", lambda: True)
    assert selfcheck.main(["--config", SHIPPED, "--model", "Qwen3-32B", "--tp", "8"]) == 0
    assert "(offline: tpu-inference is not installed here" in capsys.readouterr().out
    assert selfcheck.main(["--config", SHIPPED, *TPU7X]) == 3
    err = capsys.readouterr().err
    assert err.startswith("tpu_offload selfcheck: cannot run here: --topology TPU7x:2x2x1 compiles with "
                          "tpu-inference") and "--offline" in err


def test_sizing_figures_for_tp(tmp_path, capsys):
    """Qwen3-32B: 32 MiB per block (64 layers x 128 tokens x 8 heads x 128 x K,V x bf16), a 1/TP piece per
    device; the per-step budget 38 GB/s x 20 ms per TPU7x chip shared by its two devices, for loads and
    stores alike."""
    rc, rep = offline(tmp_path, "--config", SHIPPED, *TPU7X)
    assert rc == 0 and rep["verdict"] == "PASS", rep["reasons"]
    s = rep["deployment"]
    assert s["block_bytes"] == 32 * MIB and s["device_block_bytes"] == 4 * MIB and s["num_slots"] == 23040
    assert s["tier_bytes"] == 720 * GIB and s["staging_device_bytes"] == 1000 * 4 * MIB
    assert s["step_budget_bytes"] == 380_000_000 and s["step_blocks"] == 90 and s["chip_devices_per_chip"] == 2
    out = capsys.readouterr().out
    assert ("sizing       pass: Qwen3-32B at TP 8: 32.0 MiB per block (4.00 MiB per device); host tier 720.00 GiB "
            "= 23040 chunks of 1 block(s)") in out
    assert "budgets      pass: per step and direction 380 MB per device = 90 blocks (4.00 MiB each)" in out
    rc, rep = offline(tmp_path, "--config", SHIPPED, "--model", "Qwen3-32B", "--tp", "2")
    assert rc == 0 and rep["deployment"]["device_block_bytes"] == 16 * MIB
    assert rep["checks"]["hbm"]["status"] == "skipped"  # no chip given


def test_replicated_heads_and_mla_are_sized_as_the_cache_holds_them(tmp_path):
    """Qwen2.5-7B's 4 KV heads repeated to TP 8 store each head once; DeepSeek-V3's latent cache is held
    whole by every device and stored once (the figures tests/tpu_compiler/test_shapes.py checks against
    tpu-inference's own cache)."""
    rc, rep = offline(tmp_path, "--config", SHIPPED, "--model", "Qwen2.5-7B", "--tp", "8")
    s = rep["deployment"]
    assert rc == 0 and s["kv_head_replicas"] == 2 and s["block_bytes"] == 7 * MIB
    assert s["device_block_bytes"] == 7 * MIB // 8
    rc, rep = offline(tmp_path, "--config", SHIPPED, "--model", "DeepSeek-V3", "--tp", "8")
    s = rep["deployment"]
    assert rc == 0 and s["block_bytes"] == 4 * 32 * 640 * 2 * 61 and s["device_block_bytes"] == s["block_bytes"] // 8


def test_staging_that_does_not_fit_in_hbm_fails_with_the_utilization_that_would(tmp_path, capsys):
    rc, rep = offline(tmp_path, "--config", ktc(staging_blocks=4000), *TPU7X, "--gpu-memory-utilization", "0.9")
    assert rc == 1 and rep["checks"]["hbm"]["status"] == "fail"
    (reason,) = rep["reasons"]
    assert reason.startswith("hbm: staging 15.62 GiB + in flight 0.00 GiB per device, 9.60 GiB left free of "
                             "TPU7x's 96 GiB per device at --gpu-memory-utilization 0.9")
    assert "use --gpu-memory-utilization 0.837 or lower" in reason
    assert "\n  FAIL hbm: staging 15.62 GiB" in capsys.readouterr().out


def test_host_memory_checks_the_tier_against_the_serving_host(tmp_path):
    rc, rep = offline(tmp_path, "--config", SHIPPED, *TPU7X, "--host-memory", "944GiB")
    assert rc == 0 and rep["checks"]["host"]["status"] == "pass"
    rc, rep = offline(tmp_path, "--config", SHIPPED, *TPU7X, "--host-memory", "512GiB")
    assert rc == 1 and rep["checks"]["host"]["status"] == "fail"
    (reason,) = rep["reasons"]
    assert reason.startswith("host: the host tier needs 720.00 GiB") and "Lower num_cpu_chunks" in reason


def test_snapshot_path_without_orbax_fails_naming_the_package(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("orbax") else real(name, *a))
    rc, rep = offline(tmp_path, "--config", ktc(snapshot_path=str(tmp_path / "snap")), *TPU7X)
    assert rc == 1 and rep["checks"]["dependencies"]["missing"] == ["orbax-checkpoint"]
    assert rep["reasons"] == ["dependencies: snapshot_path needs orbax-checkpoint (pip install "
                              "'tpu-offload[tpu]'), which is not installed here"]
    assert rep["checks"]["sizing"]["status"] == "pass"  # every other check still runs
    assert "\n  FAIL dependencies: snapshot_path needs orbax-checkpoint" in capsys.readouterr().out


def test_snapshot_path_with_orbax_installed_passes(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    rc, rep = offline(tmp_path, "--config", ktc(snapshot_path=str(tmp_path / "snap")), *TPU7X)
    assert rc == 0 and rep["checks"]["dependencies"]["line"] == "installed: orbax-checkpoint (snapshot_path)"


def test_orbax_shadowed_on_the_path_fails_from_the_command_line(tmp_path):
    """The same, as a user without orbax sees it: a shadow ``orbax`` package without ``checkpoint``."""
    (tmp_path / "shadow" / "orbax").mkdir(parents=True)
    (tmp_path / "shadow" / "orbax" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_OFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])
    r = subprocess.run([sys.executable, "-m", "tpu_offload.selfcheck", "--offline", "--config",
                        ktc(snapshot_path=str(tmp_path / "snap"))], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "\n  FAIL dependencies: snapshot_path needs orbax-checkpoint" in r.stdout


def test_fs_encrypt_without_cryptography_is_a_dependency_failure_not_bad_input(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_bytes(base64.b64encode(os.urandom(32)))
    secret.chmod(0o600)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import cryptography -> ImportError
    cfg = ktc(shared_storage_path=str(tmp_path / "fs"), fs_secret_file=str(secret), fs_encrypt=True)
    rc, rep = offline(tmp_path, "--config", cfg)
    assert rc == 1 and rep["checks"]["dependencies"]["status"] == "fail"
    (reason,) = rep["reasons"]
    # Named by the config's own refusal or, where an earlier import left cryptography's submodules cached
    # (a longer pytest process), by the self-check's package check: either way the setting and the package.
    assert "fs_encrypt" in reason and "cryptography" in reason


def test_secret_file_of_the_serving_host_is_stood_in_for(tmp_path):
    """A config that names the pod's mounted secret still lints on a laptop, and says so."""
    cfg = ktc(shared_storage_path="/mnt/kv", fs_secret_file="/etc/tpu-offload/fs-secret/secret")
    rc, rep = offline(tmp_path, "--config", cfg)
    assert rc == 0, rep["reasons"]
    assert any("fs_secret_file '/etc/tpu-offload/fs-secret/secret' is not on this machine" in w
               for w in rep["warnings"])


@pytest.mark.parametrize("argv, message", [
    (["--config", ktc(cpu_bytes="lots")], "key 'cpu_bytes': value 'lots' is not allowed"),
    (["--config", ktc(staging_blokcs=1)], "key 'staging_blokcs'"),
    (["--config", SHIPPED, "--model", "Qwen3-33B"], "--model: value 'Qwen3-33B' is not allowed"),
    (["--config", SHIPPED, "--model", "Qwen3-32B", "--tp", "3"], "--tp: value 3 is not allowed"),
    (["--config", SHIPPED, "--model", "Qwen3-32B", "--topology", "TPU9:2x2"], "--topology: value 'TPU9:2x2'"),
    (["--config", SHIPPED, "--host-memory", "lots"], "--host-memory: value 'lots'"),
    (["--config", SHIPPED, "--skip", "sizing,nope"], "--skip: value 'sizing,nope' is not allowed"),
    (["--config", ktc(staging_blocks=1, blocks_per_chunk=2), "--model", "Qwen3-32B"], "staging_blocks=1 cannot"),
])
def test_bad_input_exits_2_naming_the_key(tmp_path, capsys, argv, message):
    rc, rep = offline(tmp_path, *argv)
    assert rc == 2 and rep is None
    err = capsys.readouterr().err
    assert err.startswith("tpu_offload selfcheck: bad input: ") and message in err, err


def test_quiet_by_default_verbose_with_v(tmp_path, capsys):
    assert selfcheck.main(["--offline", "--config", SHIPPED, *TPU7X]) == 0
    quiet = capsys.readouterr().out
    assert len(quiet.splitlines()) == 7 and "cache_block_shape" not in quiet
    assert selfcheck.main(["--offline", "-v", "--config", SHIPPED, *TPU7X]) == 0
    assert "      cache_block_shape: [128, 8, 2, 128]" in capsys.readouterr().out


def test_without_a_model_only_the_config_is_checked(tmp_path):
    rc, rep = offline(tmp_path, "--config", SHIPPED)
    assert rc == 0 and {k: v["status"] for k, v in rep["checks"].items()} == dict(
        config="pass", dependencies="pass", sizing="skipped", budgets="skipped", hbm="skipped", host="skipped")


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["tpu-offload-selfcheck"].partition(":")
    assert (module, func) == ("tpu_offload.selfcheck", "main")


def test_skip_leaves_the_rest(tmp_path, monkeypatch):
    """--skip dependencies: lint a snapshot config on a machine that is not the serving image."""
    monkeypatch.setattr(preflight, "installed", lambda module: False)
    rc, rep = offline(tmp_path, "--config", ktc(snapshot_path=str(tmp_path / "snap")), *TPU7X,
                      "--skip", "dependencies,host")
    assert rc == 0, rep["reasons"]
    c = {k: v["status"] for k, v in rep["checks"].items()}
    assert c == dict(config="pass", sizing="pass", budgets="pass", hbm="pass", dependencies="skipped",
                     host="skipped")
