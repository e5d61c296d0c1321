"""One of two JAX processes for test_tpu_multihost.py (not a test module).

Joins a 2-process JAX job on loopback with 4 CPU devices of its own (an
8-device mesh sharding KV heads over both), then runs the scenarios given as
JSON (argv[3]) in order, each registering a real ``OffloadWorker``, and
prints one JSON line per scenario. Per-process differences (free host memory,
free HBM, slab size, settings) are injected through the worker's own
overrides, as a host would measure them.
"""

from __future__ import annotations

import json
import os
import sys
import time

pid, port, scenarios = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)

from types import SimpleNamespace  # noqa: E402

from jax._src.distributed import global_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from tpu_offload.connector.metadata import LoadOp, OffloadMetadata, OffloadReport, StoreOp  # noqa: E402
from tpu_offload.connector.metrics import ConnectorMetrics  # noqa: E402
from tpu_offload.connector.settings import Settings  # noqa: E402
from tpu_offload.connector.worker import OffloadWorker  # noqa: E402
from tpu_offload.core.config import OffloadConfig  # noqa: E402

NB, BS, HEADS, DIM, LAYERS = 16, 4, 8, 16, 2
compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: compiles.append(str(kw.get("fun_name", "?")))
    if event == "/jax/core/compile/backend_compile_duration" else None)


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def mine(spec: dict) -> dict:
    """This process's entry of a per-process dict ({"0": ..., "1": ...})."""
    return dict(spec.get(str(pid), {}))


def make_runner(seed: int = 0):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    sh = NamedSharding(mesh, P(None, None, "model", None))
    shape = (NB, BS, HEADS, DIM)
    data = [np.random.default_rng(seed + layer).standard_normal(shape).astype(np.float32) for layer in range(LAYERS)]
    caches = [jax.make_array_from_callback(shape, sh, lambda idx, d=d: d[idx]) for d in data]
    return SimpleNamespace(kv_caches=caches, mesh=mesh, get_kv_cache_layout=lambda: "NHD"), data


def make_worker(sc: dict) -> OffloadWorker:
    cfg = OffloadConfig(**{"num_cpu_chunks": 8, "staging_blocks": 4, "blocks_per_chunk": 1, "host_memory_margin": 0,
                           "multihost_timeout_s": 60.0, **sc.get("config", {}), **mine(sc.get("config_by", {}))})
    settings = Settings(config=cfg, block_size=BS, blocks_per_chunk=1, num_slots=cfg.num_cpu_chunks, chunk_bytes=0,
                        staging_blocks=cfg.staging_blocks)
    return OffloadWorker(settings, ConnectorMetrics(CollectorRegistry()), **mine(sc.get("worker_by", {})))


def register(sc: dict) -> dict:
    runner, _ = make_runner()
    worker = make_worker(sc)
    t0 = time.monotonic()
    try:
        worker.register_runner(runner)
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - t0}
    eng = worker.engine
    out = {"ok": True, "path": eng.path, "rows_per_slab": eng.rows_per_slab, "slab_rows": list(eng.programs.slab_rows),
           "slab_shapes": [list(s.shape) for per in (eng.slabs or ()) for s in per]}
    worker.shutdown()
    return out


def drain(worker) -> tuple[OffloadReport, set]:
    deadline = time.monotonic() + 60
    report, recving = None, set()
    while report is None and time.monotonic() < deadline:
        _, r = worker.get_finished()
        recving |= r or set()
        report = worker.take_report()
        if report is None:
            time.sleep(0.01)
    return report, recving


def roundtrip(sc: dict) -> dict:
    """Store 3 chunks, load them into other blocks (bit-exact on every local shard), then lose one chunk on
    one process and load again: both launch the same lists and compile nothing while serving."""
    runner, data = make_runner(seed=7)
    worker = make_worker(sc)
    worker.register_runner(runner)
    launched, load = [], worker.engine.load

    def recording_load(caches, chunks, **kw):
        launched.append([c.slot for c in chunks])
        return load(caches, chunks, **kw)

    worker.engine.load = recording_load
    programs, get = [], worker.engine.programs._get  # every program launch, by name, in order

    def recording_get(key, build, *args):
        fn = get(key, build, *args)
        return lambda *a, **k: (programs.append(str(key[0])), fn(*a, **k))[1]

    worker.engine.programs._get = recording_get
    mark = len(compiles)
    src, dst, slots = [3, 5, 7], [10, 11, 12], [0, 1, 2]
    worker.wait_for_save(OffloadMetadata(stores=[StoreOp(op_id=1, req_id="a", slots=slots, blocks=src)]))
    stored, _ = drain(worker)
    worker.start_load_kv(OffloadMetadata(loads=[LoadOp(op_id=2, req_id="b", slots=slots, blocks=dst,
                                                       async_load=True, last=True)]))
    loaded, recving = drain(worker)

    def exact(pairs):
        return all(np.array_equal(np.asarray(s.data)[d], data[layer][s.index][sb])
                   for layer, c in enumerate(runner.kv_caches) for s in c.addressable_shards for sb, d in pairs)

    ok = exact(zip(src, dst))
    lost = sc["lose"]
    if pid == lost["on"]:  # this host lost the chunk's bytes (a failed store, a checksum mismatch)
        worker.engine.valid[lost["slot"]] = False
        if worker.engine.path == "device_put":
            worker.engine.host[lost["slot"]] = None
    worker.start_load_kv(OffloadMetadata(loads=[LoadOp(op_id=3, req_id="c", slots=slots, blocks=[13, 14, 15],
                                                       async_load=False, last=True)]))
    again, _ = drain(worker)
    keep = [(s, d) for s, d, slot in zip(src, [13, 14, 15], slots) if not (pid == lost["on"] and slot == lost["slot"])]
    out = {"ok": ok, "ok_after_loss": exact(keep), "path": worker.engine.path, "launched": launched, "programs": programs,
           "compiles_while_serving": compiles[mark:], "finished_recving": sorted(recving),
           "stores": [list(x) for x in stored.stores], "loads": [list(x) for x in loaded.loads],
           "loads_after_loss": [list(x) for x in again.loads],
           "load_errors": sorted(worker.get_block_ids_with_load_errors())}
    worker.shutdown()
    return out


def snapshot(sc: dict) -> dict:
    """Only process 0 finds a slab snapshot that fits: both must start cold, launching nothing extra."""
    from tpu_offload.jax_backend import snapshot as snap
    from tpu_offload.jax_backend.engine import TransferEngine
    from tpu_offload.jax_backend.layout import KVLayout

    runner, _ = make_runner()
    engine = TransferEngine(KVLayout.from_caches(runner.kv_caches, runner.mesh), num_slots=8, blocks_per_chunk=1,
                            staging_blocks=4)
    host_dir = os.path.join(sc["dir"], "host")
    if pid == 0:
        os.makedirs(host_dir, exist_ok=True)
        meta = {"format": snap.FORMAT, "version": snap.VERSION, "fingerprint_digest": "fp", "process_count": 2,
                "num_slots": 8, "rows_per_slab": engine.rows_per_slab, "slabs": snap._shapes(engine),
                "valid": [], "checksums": []}
        with open(os.path.join(host_dir, snap._meta_name(0)), "w") as f:
            json.dump(meta, f)
    fits = snap._read_meta(engine, host_dir, "fp") is not None
    programs, get = [], engine.programs._get

    def recording_get(key, build, *args):
        fn = get(key, build, *args)
        return lambda *a, **k: (programs.append(str(key[0])), fn(*a, **k))[1]

    engine.programs._get = recording_get
    restored = snap.restore_slabs(engine, host_dir, "fp", timeout_s=30)
    return {"fits": fits, "restored": restored, "programs": programs,
            "slabs_alive": all(not a.is_deleted() for per in engine.slabs for a in per)}


def snapshot_save(sc: dict) -> dict:
    """Both hosts save a slab snapshot; then host 1 fails writing its part of a second one. Every host must
    end the failed save with the same error (no host left waiting on one that raised), and the first
    snapshot stays in place: no partial one is renamed over it."""
    from tpu_offload.jax_backend import snapshot as snap
    from tpu_offload.jax_backend.engine import TransferEngine
    from tpu_offload.jax_backend.layout import KVLayout

    runner, _ = make_runner()
    engine = TransferEngine(KVLayout.from_caches(runner.kv_caches, runner.mesh), num_slots=8, blocks_per_chunk=1,
                            staging_blocks=4)
    host_dir = os.path.join(sc["dir"], "host")
    first = snap.save_slabs(engine, host_dir, "first", "fp", timeout_s=30)
    deadline = time.monotonic() + 30
    while not os.path.isdir(host_dir) and time.monotonic() < deadline:  # process 0 renames it into place
        time.sleep(0.05)
    saved = sorted(os.listdir(host_dir))
    if pid == 1:  # its meta file cannot be written, after orbax wrote every host's shards (a full disk)
        def full(*args):
            raise OSError(28, "No space left on device")
        snap._write_meta = full
    t0 = time.monotonic()
    try:
        snap.save_slabs(engine, host_dir, "second", "fp", timeout_s=30)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    left = sorted(n for n in os.listdir(sc["dir"]) if n != "host")
    with open(os.path.join(host_dir, "meta-p0.json")) as f:
        kept = json.load(f)["snapshot_id"]
    return {"first": first, "saved": saved, "error": error, "seconds": time.monotonic() - t0, "kept": kept,
            "left_behind": left}


def dp_roundtrip(sc: dict) -> dict:
    """DP attention over the two hosts (rank r = process r's 4 devices): each host stages and stores its own
    rank's chunks into its own partition of the slots, held in its own host memory; a chunk loads into the
    other rank's blocks across the hosts (the load's ring), bit-exact, with nothing compiled while serving."""
    from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
    from tpu_offload.jax_backend.layout import KVLayout

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("attn_dp", "model"))
    sh = NamedSharding(mesh, P("attn_dp", None, "model", None))
    shape = (NB, BS, HEADS, DIM)
    data = [np.random.default_rng(11 + layer).standard_normal(shape).astype(np.float32) for layer in range(LAYERS)]
    caches = [jax.make_array_from_callback(shape, sh, lambda idx, d=d: d[idx]) for d in data]
    eng = TransferEngine(KVLayout.from_caches(caches, mesh), num_slots=4, blocks_per_chunk=1, staging_blocks=4,
                         kernel=sc.get("kernel"))
    eng.precompile()
    mark = len(compiles)
    # rank 0 (blocks 0-7) stores into its slots 0-1, rank 1 (blocks 8-15) into its slots 2-3
    eng.store(caches, [StoreChunk(0, [1]), StoreChunk(1, [2]), StoreChunk(2, [9])]).block_until_ready()
    eng.complete_store([0, 1, 2], True)
    moved = {12: 1, 3: 9, 5: 2}  # rank 0's chunk into rank 1, rank 1's into rank 0, one at home
    caches, done = eng.load(caches, [LoadChunk(0, [12]), LoadChunk(2, [3]), LoadChunk(1, [5])])
    done.block_until_ready()
    exact = all(np.array_equal(np.asarray(s.data)[d - s.index[0].indices(NB)[0]], data[layer][(src, *s.index[1:])])
                for layer, c in enumerate(caches) for s in c.addressable_shards for d, src in moved.items()
                if s.index[0].indices(NB)[0] <= d < s.index[0].indices(NB)[1])
    slab = eng.slabs[0][0]
    return {"ok": exact, "kernel": eng.programs.kernel, "compiles_while_serving": compiles[mark:],
            "slab_rows_here": sorted({tuple(s.index[0].indices(slab.shape[0])[:2]) for s in slab.addressable_shards}),
            "slab_shape": list(slab.shape)}


def reshard_control() -> dict:
    """What the engine avoids: jax.device_put of a non-fully-addressable array to pinned_host compiles a program."""
    runner, _ = make_runner()
    x = runner.kv_caches[0]
    mark = len(compiles)
    y = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    y.block_until_ready()
    return {"compiles": compiles[mark:], "fully_addressable": x.is_fully_addressable}


def main():
    for sc in scenarios:
        if sc["kind"] == "stall" and pid == sc["on"]:
            reply({"stalled": True})
            time.sleep(sc["seconds"])  # never registers: its peer must give up with an error, not hang
            os._exit(0)
        fn = {"register": register, "stall": register, "roundtrip": roundtrip, "snapshot": snapshot,
              "dp": dp_roundtrip, "snapshot_save": snapshot_save}.get(sc["kind"])
        reply({"scenario": sc.get("name", sc["kind"]), "pid": pid,
               **(fn(sc) if fn else reshard_control())})
    if not any(sc["kind"] == "stall" for sc in scenarios):  # a stalled peer never comes to the barrier
        global_state.client.wait_at_barrier("multihost_child_done", 60_000)  # exit together: none left waiting
    os._exit(0)


if __name__ == "__main__":
    main()
