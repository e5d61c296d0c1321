"""TEST-ONLY hooks into live transfer engines. Not for production use.

End-to-end tests run a real vLLM engine whose worker lives deep inside the
engine core; these helpers reach it without production code knowing:

* ``live_workers()`` / ``live_managers()`` / ``the_worker()`` /
  ``the_manager()``: our workers and scheduler-side managers alive in this
  process (through ``HostOffloadSpec.live_parts``; not shut down).
* ``corrupt_slot(worker, slot)``: overwrite a host slot's bytes while it
  stays marked valid, to prove restored KV is what the model reads.
* ``fail_next_loads(worker, n)``: the next ``n`` load jobs raise inside the
  transfer, to exercise the load-error -> recompute path.
* ``fail_next_stores(worker, n)``: the next ``n`` store jobs raise, leaving
  their slots invalid, so a later hit on them must be recomputed.
* ``offloading_config(...)``: vLLM's ``OffloadingConfig`` without an engine.

They only work when the worker shares the test's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniprocess executor).
"""

from __future__ import annotations

import numpy as np


def _live(kind: str) -> list:
    from gpu_offload.vllm.manager import HostTierManager
    from gpu_offload.vllm.spec import HostOffloadSpec
    from gpu_offload.vllm.worker import HostOffloadWorker

    cls = HostOffloadWorker if kind == "worker" else HostTierManager
    return [p for p in list(HostOffloadSpec.live_parts) if isinstance(p, cls) and not p.closed]


def live_workers() -> list:
    """Our vLLM workers alive in this process (created by a spec, not shut down)."""
    return _live("worker")


def live_managers() -> list:
    """Our scheduler-side managers alive in this process."""
    return _live("manager")


def the_manager():
    """The single live scheduler-side manager; raises if there is not exactly one."""
    managers = live_managers()
    if len(managers) != 1:
        raise RuntimeError(f"expected one live host-tier manager, found {len(managers)}")
    return managers[0]


def the_worker():
    """The single live engine; raises if there is not exactly one."""
    workers = live_workers()
    if len(workers) != 1:
        raise RuntimeError(f"expected one live host-tier worker, found {len(workers)}")
    return workers[0]


def valid_slots(worker) -> np.ndarray:
    return np.flatnonzero(worker.pool.valid)


def corrupt_slot(worker, slot: int, mode: str = "zeros", seed: int = 0) -> None:
    """Overwrite ``slot``; its valid flag is left as it was.

    ``zeros`` keeps the KV finite (so the model still runs, just on the wrong
    context); ``random`` writes random bytes (may decode to NaN/Inf floats).
    """
    row = worker.pool.row(int(slot))
    if mode == "zeros":
        row[:] = 0
    elif mode == "random":
        row[:] = np.random.default_rng(seed).integers(0, 256, size=row.shape, dtype=np.uint8)
    else:
        raise ValueError(f"mode must be 'zeros' or 'random', got {mode!r}")


def fail_next_loads(worker, n: int = 1) -> None:
    worker._forced_load_failures += int(n)


def fail_next_stores(worker, n: int = 1) -> None:
    worker._forced_store_failures += int(n)


def offloading_config(extra: dict, *, blocks_per_chunk=1, world_size=1, rank=0, bytes_per_block=262144):
    """vLLM's ``OffloadingConfig`` as the connector builds it, without an engine
    (2 layers, 128-token blocks; ``bytes_per_block`` is one worker's KV per block)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=128, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "HostOffloadSpec", "spec_module_path": "gpu_offload.spec", **extra},
        engine_id="test",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
