"""One of two JAX processes for test_multiprocess.py (not a test module).

Joins a 2-process JAX job on loopback with 4 CPU devices of its own; the
8-device mesh shards KV heads over both, so each process holds half. Runs a
real ``OffloadWorker`` and answers JSON commands on stdin with its reports.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

pid, port = int(sys.argv[1]), sys.argv[2]
path = sys.argv[3] if len(sys.argv) > 3 else "auto"  # transfer_path
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)

from types import SimpleNamespace  # noqa: E402

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from tpu_offload.connector.metadata import LoadOp, OffloadMetadata, StoreOp  # noqa: E402
from tpu_offload.connector.metrics import ConnectorMetrics  # noqa: E402
from tpu_offload.connector.settings import Settings  # noqa: E402
from tpu_offload.connector.worker import OffloadWorker  # noqa: E402
from tpu_offload.core.config import OffloadConfig  # noqa: E402

NB, BS, HEADS, DIM, LAYERS = 16, 4, 8, 16, 2


class Failed:
    """A store's "done" as a failed device-to-host transfer reports itself: ready, raising when waited on."""

    def is_ready(self):
        return True

    def block_until_ready(self):
        raise RuntimeError("injected: device-to-host transfer failed")


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    # Auto axes, as tpu-inference builds its mesh (jax.make_mesh would give Explicit ones).
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    sh = NamedSharding(mesh, P(None, None, "model", None))
    shape = (NB, BS, HEADS, DIM)
    data = [np.random.default_rng(layer).standard_normal(shape).astype(np.float32) for layer in range(LAYERS)]
    caches = [jax.make_array_from_callback(shape, sh, lambda idx, d=d: d[idx]) for d in data]
    runner = SimpleNamespace(kv_caches=caches, mesh=mesh, get_kv_cache_layout=lambda: "NHD")
    cfg = OffloadConfig(num_cpu_chunks=8, staging_blocks=4, blocks_per_chunk=1, transfer_path=path)
    settings = Settings(config=cfg, block_size=BS, blocks_per_chunk=1, num_slots=8, chunk_bytes=0, staging_blocks=4)
    worker = OffloadWorker(settings, ConnectorMetrics(CollectorRegistry()))
    worker.register_runner(runner)
    if worker.engine.slabs is not None:  # program path: (rows, bpc, layers, *piece)
        slab = worker.engine.slabs[0][0]
        sh, pieces = slab.sharding, {tuple(s.data.shape[3:]) for s in slab.addressable_shards}
    else:  # device_put path: one host array per chunk, (bpc, layers, *piece)
        aval = worker.engine.programs.host_chunk_avals()[0]
        sh, pieces = aval.sharding, {tuple(aval.sharding.shard_shape(aval.shape)[2:])}
    reply({"ready": True, "process_count": jax.process_count(), "path": worker.engine.path,
           "local_shards": len(sh.addressable_devices), "global_devices": len(sh.device_set),
           "local_block_elems": sorted(math.prod(p) for p in pieces)})
    launched = []  # slots of every load this process launched (hosts must launch the same lists)
    load = worker.engine.load

    def recording_load(caches, chunks, **kw):
        launched.append([c.slot for c in chunks])
        return load(caches, chunks, **kw)

    worker.engine.load = recording_load
    store = worker.engine.store

    def failing_store(caches, chunks):  # launches what its peers launch; its transfer then fails
        store(caches, chunks)
        return Failed()

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("invalidate") and jax.process_index() in cmd["invalidate_on"]:
            worker.engine.valid[cmd["invalidate"]] = False  # this host lost those bytes
            if worker.engine.path == "device_put":
                worker.engine.host[cmd["invalidate"]] = None
        worker.engine.store = failing_store if jax.process_index() in cmd.get("fail_store_on", ()) else store
        unhex = lambda op: {**op, **({"salt": bytes.fromhex(op["salt"])} if "salt" in op else {})}  # noqa: E731
        meta = OffloadMetadata(loads=[LoadOp(**unhex(x)) for x in cmd.get("loads", [])],
                               stores=[StoreOp(**unhex(x)) for x in cmd.get("stores", [])])
        if cmd["op"] == "store":
            worker.wait_for_save(meta)
        elif cmd["op"] == "load":
            worker.start_load_kv(meta)
        else:
            break
        deadline = time.monotonic() + 60
        report = None
        sending, recving = set(), set()
        while report is None and time.monotonic() < deadline:
            s, r = worker.get_finished()
            sending |= s or set()
            recving |= r or set()
            report = worker.take_report()
            if report is None:
                time.sleep(0.01)
        ok = None
        if cmd["op"] == "load":  # every local shard of every destination block == its source block
            ok = all(
                np.array_equal(np.asarray(s.data)[dst], data[layer][s.index][src])
                for layer, c in enumerate(runner.kv_caches) for s in c.addressable_shards
                for src, dst in cmd["expect"]
            )
        reply({"report": report.to_dict() if report else None, "ok": ok, "pid": jax.process_index(),
               "launched": launched[-1] if launched else None,
               "finished_sending": sorted(sending), "finished_recving": sorted(recving)})
    worker.shutdown()


if __name__ == "__main__":
    main()
