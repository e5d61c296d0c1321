"""Two JAX processes on loopback, each holding half of the KV heads.

The scheduler (this process) must not treat a chunk as loadable until both
worker processes have stored their shards of it, and must keep a loaded
chunk pinned until both have finished reading it (tpu-inference#3152).
"""

import dataclasses
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from tpu_offload.connector.metadata import LoadOp, OffloadReport
from tpu_offload.connector.metrics import ConnectorMetrics
from tpu_offload.connector.scheduler import OffloadScheduler
from tpu_offload.connector.settings import Settings
from tpu_offload.core.config import OffloadConfig
from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.manager import Lookup

pytestmark = pytest.mark.jax

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BS, TIMEOUT = 4, 240


class Child:
    def __init__(self, pid, port, path="auto"):
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("XLA_FLAGS", None)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "mp_child.py"), str(pid), str(port), path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def recv(self, timeout=TIMEOUT):
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker process {self.proc.pid} sent nothing for {timeout}s") from None
        if msg is None:
            self.proc.wait(timeout=30)
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise AssertionError(f"worker process exited with {self.proc.returncode}:\n{tail}")
        return msg

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_request(req_id, n_blocks, computed=0, first=1):
    hashes = [bytes([i + first]) * 32 for i in range(n_blocks)]
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=n_blocks * BS,
                           num_prompt_tokens=n_blocks * BS, num_computed_tokens=computed,
                           all_token_ids=list(range(n_blocks * BS)), lora_request=None)


def step_output(req_id, n_tokens):
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req_id)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={req_id: n_tokens})


class TwoHostPlacementGroup:
    """What Ray hands tpu-inference's executor for 2 hosts x 4 chips (only ``bundle_specs`` is read)."""

    bundle_specs = [{"TPU": 4.0, "node:10.0.0.1": 0.001}, {"TPU": 4.0}]


def aggregator_for(tiny_model_dir, world_size):
    """vLLM's real aggregator, built the way EngineCore builds it from our scheduler-side connector."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpu_offload.connector import TPUOffloadConnector
    from tpu_standin import make_vllm_config

    vc = make_vllm_config(tiny_model_dir, block_size=BS, num_blocks=16, extra={"num_cpu_chunks": 8})
    vc.parallel_config.distributed_executor_backend = "ray"
    vc.parallel_config.placement_group = TwoHostPlacementGroup()
    conn = TPUOffloadConnector(vc, KVConnectorRole.SCHEDULER)
    assert conn.get_finished_count() == 2  # one JAX process per host, not one per chip
    return KVOutputAggregator.from_connector(conn, world_size)


def wire(op) -> dict:
    """An order as the children read it (JSON lines): bytes fields as hex."""
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in dataclasses.asdict(op).items()}


def runner_output(reply):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    out.kv_connector_output = KVConnectorOutput(finished_sending=set(reply["finished_sending"]) or None,
                                                finished_recving=set(reply["finished_recving"]) or None)
    return out


@pytest.mark.parametrize("path", ["program", "device_put"])
def test_chunk_loadable_only_after_every_process_reported(tiny_model_dir, path):
    cfg = OffloadConfig(num_cpu_chunks=8, staging_blocks=4, blocks_per_chunk=1)
    sched = OffloadScheduler(Settings(config=cfg, block_size=BS, blocks_per_chunk=1, num_slots=8, chunk_bytes=0,
                                      staging_blocks=4), ConnectorMetrics(CollectorRegistry()))
    sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([3, 5, 7],))
    port = free_port()
    children = [Child(0, port, path), Child(1, port, path)]
    try:
        hello = [c.recv() for c in children]
        for h in hello:  # each process holds 4 of the 8 head shards, one head each
            assert h["path"] == path
            assert h["process_count"] == 2 and h["local_shards"] == 4 and h["global_devices"] == 8
            assert h["local_block_elems"] == [BS * 1 * 16]  # block_size x its one head x head_dim

        a = fake_request("a", 3)
        sched.update_state_after_alloc(a, None, 0)
        meta = sched.build_connector_meta(step_output("a", 3 * BS))
        assert len(meta.stores) == 1 and len(meta.stores[0].slots) == 3
        cmd = {"op": "store", "stores": [wire(op) for op in meta.stores]}
        for c in children:
            c.send(cmd)
        reports = [OffloadReport.coerce(c.recv()["report"]) for c in children]
        keys = [make_chunk_key(h) for h in a.block_hashes]

        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports[0]))
        assert [sched.manager.lookup(k) for k in keys] == [Lookup.PENDING] * 3  # one process is not enough
        b = fake_request("b", 3)
        assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports[1]))
        assert [sched.manager.lookup(k) for k in keys] == [Lookup.HIT] * 3
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BS - 1, True)

        # Load into new blocks on both processes; pins stay until both report.
        sched.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([10, 11, 12],)), 3 * BS - 1)
        assert sched.manager.stats().pinned_chunks == 3
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                          scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
        cmd = {"op": "load", "loads": [wire(op) for op in meta.loads],
               "expect": [[3, 10], [5, 11], [7, 12]]}
        for c in children:
            c.send(cmd)
        replies = [c.recv() for c in children]
        assert all(r["ok"] for r in replies), "a process's shards were not restored bit-exactly"
        assert {r["pid"] for r in replies} == {0, 1}
        # vLLM's aggregator: TP 8 over 2 processes is world_size 8 but 2 reports. The async load of
        # "b" must finish (else the request waits forever and its pinned chunks leak).
        assert all(r["finished_recving"] == ["b"] for r in replies)
        outputs = [runner_output(r) for r in replies]
        agg = aggregator_for(tiny_model_dir, world_size=8)
        assert agg.aggregate(outputs).kv_connector_output.finished_recving == {"b"}
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=OffloadReport.coerce(replies[0]["report"])))
        assert sched.manager.stats().pinned_chunks == 3
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=OffloadReport.coerce(replies[1]["report"])))
        assert sched.manager.stats().pinned_chunks == 0
        # One host lost a chunk's bytes: both hosts still launch the load with the same chunk list
        # (a host that skipped it alone would launch a different program than its peer and, with
        # collectives, stall it); only that host reports the chunk, so its blocks are recomputed.
        slots = meta.loads[0].slots
        op = LoadOp(op_id=99, req_id="c", slots=slots, blocks=[13, 14, 15], async_load=False, last=True)
        cmd = {"op": "load", "loads": [wire(op)], "invalidate": slots[1], "invalidate_on": [1],
               "expect": [[3, 13], [7, 15]]}
        for c in children:
            c.send(cmd)
        replies = sorted((c.recv() for c in children), key=lambda r: r["pid"])
        assert replies[0]["launched"] == replies[1]["launched"] == slots
        assert all(r["ok"] for r in replies)
        failed = [{(op, pidx): list(bad) for op, pidx, bad in OffloadReport.coerce(r["report"]).loads} for r in replies]
        assert failed[0] == {(99, 0): []} and failed[1] == {(99, 1): [slots[1]]}, failed
        # One host's device-to-host transfer fails: both launched the same store, only that host reports
        # its slots failed, and the scheduler drops the chunks for every host (the union of the reports).
        d = fake_request("d", 2, first=50)
        sched.update_state_after_alloc(d, None, 0)
        meta = sched.build_connector_meta(step_output("d", 2 * BS))
        assert len(meta.stores) == 1 and len(meta.stores[0].slots) == 2
        cmd = {"op": "store", "stores": [wire(op) for op in meta.stores], "fail_store_on": [1]}
        for c in children:
            c.send(cmd)
        replies = sorted((c.recv() for c in children), key=lambda r: r["pid"])
        stores = [OffloadReport.coerce(r["report"]).stores for r in replies]
        assert stores[0] == [(meta.stores[0].op_id, 0, [])], stores
        assert stores[1] == [(meta.stores[0].op_id, 1, meta.stores[0].slots)], stores
        for r in replies:
            sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=OffloadReport.coerce(r["report"])))
        assert [sched.manager.lookup(make_chunk_key(h)) for h in d.block_hashes] == [Lookup.MISS] * 2
        assert sched.get_num_new_matched_tokens(fake_request("e", 2, first=50), 0) == (0, False)
        for c in children:
            c.send({"op": "exit"})
    finally:
        for c in children:
            c.kill()
