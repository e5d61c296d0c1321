"""A multi-host replica's Ray workers are killed, never shut down: the executor's shutdown flushes them first.

tpu-inference's ``RayDistributedExecutorV2.shutdown`` ``ray.kill``s the worker
actors (no exit hook runs in a killed process) and vLLM's
``RayDistributedExecutor`` leaves them to die with the job; the EngineCore
shuts the executor down before its scheduler, so the scheduler half's
shutdown comes too late. The scheduler half (in the EngineCore, where the
executor already exists) wraps the Ray executors' ``shutdown`` to first run
``compat.shut_down_worker_connector`` on every worker through
``collective_rpc``. Ray is not installed here: a stand-in executor class with
the same surface is wrapped, and its ``collective_rpc`` ships the function as
Ray does (cloudpickle) to this process's worker half.
"""

import sys
import types

import cloudpickle
import pytest

from tpu_offload.connector import compat
from tpu_standin import chunk_files, fs_secret_file, prompt

pytestmark = pytest.mark.engine

BS = 16


def fake_executor_module(monkeypatch):
    mod = types.ModuleType("fake_ray_executor")

    class FakeRayExecutor:
        def __init__(self):
            self.rpcs, self.killed = [], 0

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            method = cloudpickle.loads(cloudpickle.dumps(method))  # as it reaches each Ray worker
            self.rpcs.append(timeout)
            return [method(None, *args, **(kwargs or {}))]

        def shutdown(self):
            self.killed += 1  # ray.kill: the worker processes die, no exit hook runs

    FakeRayExecutor.__module__ = mod.__name__
    mod.FakeRayExecutor = FakeRayExecutor
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_executor_shutdown_shuts_the_workers_connectors_down_first(harnesses, tmp_path, monkeypatch):
    mod = fake_executor_module(monkeypatch)
    kv = tmp_path / "kv"
    h = harnesses({"num_cpu_chunks": 32, "staging_blocks": 16, "blocks_per_chunk": 1, "shared_storage_path": str(kv),
                   "fs_secret_file": fs_secret_file(tmp_path),
                   "fs_write_mode": "write_back", "fs_write_back_lag_s": 3600,
                   "snapshot_path": str(tmp_path / "snap")})
    h.add(prompt(5 * BS, 1), max_tokens=1)
    h.run()
    assert h.wrk.fs.dirty_chunks == 5 and chunk_files(kv) == []  # only in this worker's host RAM
    assert compat.install_executor_flush((mod.__name__,)) == 1
    assert compat.install_executor_flush((mod.__name__,)) == 0  # idempotent
    exe = mod.FakeRayExecutor()
    exe.shutdown()
    assert exe.killed == 1 and exe.rpcs == [compat.FLUSH_TIMEOUT_S]
    assert len(chunk_files(kv)) == 5  # written before the workers were killed
    assert any((tmp_path / "snap" / "host").iterdir())  # and the warm-restart slabs saved
    assert h.wrk.engine is None
    exe.shutdown()  # the executor's own guard makes a second shutdown a no-op; ours runs once too
    assert exe.rpcs == [compat.FLUSH_TIMEOUT_S]


def test_the_connector_installs_the_flush_where_workers_could_lose_files(harnesses, tmp_path, monkeypatch):
    mod = fake_executor_module(monkeypatch)
    harnesses({"num_cpu_chunks": 8, "staging_blocks": 8, "shared_storage_path": str(tmp_path / "kv"),
               "fs_secret_file": fs_secret_file(tmp_path)})
    monkeypatch.setattr(compat, "RAY_EXECUTOR_MODULES", (mod.__name__,))
    assert not getattr(mod.FakeRayExecutor.shutdown, "__wrapped__", None)
    harnesses({"num_cpu_chunks": 8, "staging_blocks": 8, "shared_storage_path": str(tmp_path / "kv"),
               "fs_secret_file": fs_secret_file(tmp_path)})
    assert getattr(mod.FakeRayExecutor.shutdown, "__wrapped__", None) is not None
