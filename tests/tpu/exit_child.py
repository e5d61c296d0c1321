"""A worker process that exits with file writes in flight and never shuts its connector down.

For test_tpu_exit_flush.py (not a test module). tpu-inference never shuts a
worker down (a multi-host replica's Ray workers just exit), so this process
stores 8 chunks through a real ``OffloadWorker`` with a slow file tier, prints
what the files must hold, and returns from ``main`` with writes still queued.

argv: ROOT MODE SNAPSHOT_DIR ("-": none)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

root, mode, snap = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
for _k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
    del os.environ[_k]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from tpu_offload.connector.metadata import OffloadMetadata, StoreOp  # noqa: E402
from tpu_offload.connector.metrics import ConnectorMetrics  # noqa: E402
from tpu_offload.connector.settings import Settings  # noqa: E402
from tpu_offload.connector.worker import OffloadWorker  # noqa: E402
from tpu_offload.core.config import OffloadConfig  # noqa: E402
from tpu_offload.core.keys import LayoutFingerprint, make_chunk_key  # noqa: E402

NB, BS, HEADS, DIM, LAYERS, N = 16, 4, 8, 16, 2, 8
FP = LayoutFingerprint("exit-child", "float32", BS, 1, LAYERS, HEADS // 2, DIM)


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "model"))
    sh = NamedSharding(mesh, P(None, None, "model", None))
    shape = (NB, BS, HEADS, DIM)
    caches = [jax.device_put(np.random.default_rng(layer).standard_normal(shape).astype(np.float32), sh)
              for layer in range(LAYERS)]
    runner = SimpleNamespace(kv_caches=caches, mesh=mesh, get_kv_cache_layout=lambda: "NHD")
    cfg = OffloadConfig(num_cpu_chunks=N, staging_blocks=N, blocks_per_chunk=1, shared_storage_path=root, fs_allow_unauthenticated=True,
                        fs_write_mode=mode, fs_write_back_lag_s=3600, fs_threads=1, fs_queue_depth=2,
                        snapshot_path=None if snap == "-" else snap)
    settings = Settings(config=cfg, block_size=BS, blocks_per_chunk=1, num_slots=N, chunk_bytes=0, staging_blocks=N)
    worker = OffloadWorker(settings, ConnectorMetrics(CollectorRegistry()), fs_fingerprint=FP)
    worker.register_runner(runner)
    files = worker.fs.tier.files
    real = files.write

    def slow_write(*a, **kw):
        time.sleep(0.3)
        return real(*a, **kw)

    files.write = slow_write
    keys = [make_chunk_key(bytes([i + 1]) * 32) for i in range(N)]
    op = StoreOp(op_id=1, req_id="r", slots=list(range(N)), blocks=list(range(N)), keys=[bytes(k) for k in keys])
    worker.wait_for_save(OffloadMetadata(stores=[op], snapshot_id="exit-child"))
    deadline = time.monotonic() + 60
    while worker.pending() and time.monotonic() < deadline:
        worker.get_finished()
        time.sleep(0.01)
    assert not worker.pending(), "stores did not complete"
    expect = {bytes(k).hex(): hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes()
                                                      for v in worker.engine.row_views(s))).hexdigest()
              for s, k in enumerate(keys)}
    print(json.dumps({"pending": worker.fs.pending_writes(), "dirty": worker.fs.dirty_chunks,
                      "nbytes": worker.fs._nbytes, "expect": expect}), flush=True)
    # Return without worker.shutdown(), as a tpu-inference worker process ends.


if __name__ == "__main__":
    main()
