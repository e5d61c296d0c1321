"""A worker process that exits without a connector shutdown still lands its file writes and snapshot.

tpu-inference's ``TPUWorker`` has no ``shutdown``, and a multi-host replica's
Ray workers are never told to stop (only the EngineCore process, which holds
the scheduler half, shuts its connector down). The worker registers an
exit hook instead: at process exit, queued and in-flight file writes land
and write-back chunks are written. (The warm-restart slabs are not: Python
3.12 starts no thread at exit and orbax's writers are threads.)
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tpu_offload.core.fs import FileTier
from tpu_offload.core.keys import LayoutFingerprint

HERE = Path(__file__).parent
FP = LayoutFingerprint("exit-child", "float32", 4, 1, 2, 4, 16)  # as exit_child.py


def run_child(root, mode, snap="-"):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_OFFLOAD_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(HERE / "exit_child.py"), str(root), mode, str(snap)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_files(root, out):
    with FileTier(str(root), FP, out["nbytes"], capacity_bytes=None, threads=1) as tier:
        for khex, digest in out["expect"].items():
            buf = np.empty(out["nbytes"], dtype=np.uint8)
            assert tier.read_into(bytes.fromhex(khex), buf), f"chunk {khex[:8]} never reached its file"
            assert hashlib.sha256(buf.tobytes()).hexdigest() == digest


def test_write_through_writes_queued_at_exit_land(tmp_path):
    out = run_child(tmp_path / "kv", "write_through")
    assert out["pending"] > 0  # 8 writes, 2 copy buffers, 0.3 s each: most still queued at exit
    check_files(tmp_path / "kv", out)


def test_write_back_chunks_are_written_at_exit(tmp_path):
    out = run_child(tmp_path / "kv", "write_back")
    assert out["dirty"] == 8 and out["pending"] == 0  # only in host RAM when the process ends
    check_files(tmp_path / "kv", out)
