"""Helpers shared by the file-tier tests (plain module: imported by name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_offload.vllm import selection
from gpu_offload.testing import offloading_config  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("engine_run.py")

ENGINE_TIMEOUT_S = 300


def secret_file(path) -> str:
    """A secret file next to the shared directory ``path`` (a shared tier starts only with one)."""
    from tpu_offload.core.fs.auth import make_secret_file

    f = Path(str(path) + "-secret")
    if not f.exists():
        f.parent.mkdir(parents=True, exist_ok=True)
        make_secret_file(str(f))
    return str(f)


def kv_transfer_config(path, **extra) -> dict:
    extra.setdefault("fs_secret_file", secret_file(path))
    return selection.kv_transfer_config(64 << 20, shared_storage_path=str(path), **extra)


def shipped_kv_transfer_config(path, **extra) -> dict:
    """``configs/vllm/offload-host-fs.json`` as shipped, but on ``path`` with a host
    budget this machine has (the shipped 64 GiB is for real hosts)."""
    ktc = json.loads((REPO / "configs/vllm/offload-host-fs.json").read_text())
    extra.setdefault("fs_secret_file", secret_file(path))  # in place of the pod's mounted Secret
    ktc["kv_connector_extra_config"].update(cpu_bytes_to_use=64 << 20, shared_storage_path=str(path), **extra)
    return ktc


class EngineRun:
    """One engine process running a plan; ``result()`` waits and parses its JSON."""

    def __init__(self, workdir: Path, name: str, model: str, ktc: dict | None, steps: list[dict], **plan_extra):
        self.name = name
        self.log = workdir / f"{name}.log"
        plan = workdir / f"{name}.plan.json"
        plan.write_text(json.dumps({"model": model, "kv_transfer_config": ktc, "steps": steps, **plan_extra}))
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        env = {k: v for k, v in env.items() if not k.startswith("TPU_OFFLOAD_")}
        self._out = open(workdir / f"{name}.out", "w+")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(["nice", sys.executable, str(RUNNER), str(plan)], env=env,
                                         stdout=self._out, stderr=err, cwd=workdir)
        self._result = None

    def result(self) -> dict:
        if self._result is None:
            try:
                rc = self.proc.wait(ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise
            self._out.seek(0)
            lines = self._out.read().strip().splitlines()
            self._out.close()
            if rc != 0 or not lines:
                raise RuntimeError(f"engine {self.name} exited {rc}:\n{self.log.read_text()[-4000:]}")
            self._result = json.loads(lines[-1])
        return self._result
