"""File writes of the TPU host tier never vanish silently.

More chunks are stored in one step than there are copy buffers, and the I/O
thread is slowed so the buffers stay busy: every chunk must still reach its
file with the slot's bytes. A queued write whose slot is overwritten first is
dropped and counted, never written with the new bytes.
"""

import functools
import os
import threading
import time

import numpy as np
import pytest

from tpu_standin import chunk_files, prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture
def make(fs_harness):
    return functools.partial(fs_harness, staging_blocks=16, blocks_per_chunk=1, fs_write_mode="write_through",
                             fs_threads=1, fs_queue_depth=4)  # 2 copy buffers


def slow_writes(fs, gate: threading.Event | None = None, delay: float = 0.02):
    files = fs.tier.files
    real = files.write

    def write(*a, **kw):
        if gate is not None:
            gate.wait(30)
        time.sleep(delay)
        return real(*a, **kw)

    files.write = write


def slot_bytes(h, slot) -> bytes:
    return b"".join(np.ascontiguousarray(v).tobytes() for v in h.wrk.engine.row_views(slot))


def read_back(h, key) -> bytes | None:
    fs = h.wrk.fs
    buf = np.empty(fs._nbytes, dtype=np.uint8)
    got = []
    ev = threading.Event()
    assert fs.tier.submit_read(key, buf, lambda ok: (got.append(ok), ev.set()))
    assert ev.wait(30)
    return buf.tobytes() if got[0] else None


def dropped_metric(h, reason=None) -> float:
    total = 0.0
    for fam in h.wrk.fs.tier.fs_metrics.registry.collect():
        for s in fam.samples:
            if s.name == "tpu_offload_fs_dropped_writes_total" and reason in (None, s.labels.get("reason")):
                total += s.value
    return total


def drain(h):
    while h.wrk.fs.pending_writes():
        h.wrk.get_finished()  # each engine step polls the worker, which copies queued writes out
        time.sleep(0.005)
    assert h.wrk.fs.tier.flush(timeout=30)


def test_more_chunks_in_one_step_than_buffers_all_reach_their_files(make, tmp_path):
    h = make()
    before = dropped_metric(h)  # the registry is process-wide
    assert len(h.wrk.fs._bufs) == 2  # sized from fs_threads / fs_queue_depth, not hard-coded
    slow_writes(h.wrk.fs)
    h.add(prompt(12 * BS, 1), max_tokens=1)  # 12 chunks stored in one prefill step
    h.run()
    drain(h)
    assert h.wrk.totals["stored_chunks"] == 12
    assert h.wrk.fs.dropped_writes == 0 and "fs_dropped_writes" not in h.wrk.totals
    assert dropped_metric(h) == before
    assert len(chunk_files(tmp_path / "kv")) == 12
    slots = {slot_bytes(h, s) for s in range(h.wrk.engine.num_slots) if h.wrk.engine.valid[s]}
    assert len(slots) == 12
    for key in h.tokens:  # every stored chunk's file holds that chunk's host bytes
        data = read_back(h, key)
        assert data is not None and data in slots
        slots.discard(data)
    assert not slots


def test_queued_write_of_an_overwritten_slot_is_dropped_and_counted(make, tmp_path):
    h = make()
    before = dropped_metric(h, "slot_reused")  # the registry is process-wide
    gate = threading.Event()
    slow_writes(h.wrk.fs, gate, delay=0)
    fs = h.wrk.fs
    h.add(prompt(4 * BS, 2), max_tokens=1)
    h.run()
    assert fs.pending_writes() == 2  # two copied into the (blocked) buffers, two wait for one
    slot, (key, _salt) = next(iter(fs._pending.items()))
    old = slot_bytes(h, slot)
    fs.overwrite([slot])  # what the worker does before dispatching a store or promotion into it
    for v in h.wrk.engine.row_views(slot):
        v[...] = 7  # the slot's next bytes
    gate.set()
    drain(h)
    assert fs.drops == {"slot_reused": 1}
    assert dropped_metric(h, "slot_reused") == before + 1
    h.wrk.get_finished()
    assert h.wrk.totals["fs_dropped_writes"] == 1
    assert not os.path.exists(fs.tier.path_of(key))  # neither the new bytes nor anything else
    assert len(chunk_files(tmp_path / "kv")) == 3
    assert old != slot_bytes(h, slot)


def test_worker_invalidates_queued_writes_before_storing_into_their_slots(make):
    h = make(num_cpu_chunks=4)
    before = dropped_metric(h, "slot_reused")  # the registry is process-wide
    gate = threading.Event()
    slow_writes(h.wrk.fs, gate, delay=0)
    fs = h.wrk.fs
    seen = []
    orig_overwrite, orig_store = fs.overwrite, h.wrk.engine.store
    fs.overwrite = lambda slots: (seen.append(("overwrite", sorted(int(s) for s in slots))), orig_overwrite(slots))
    h.wrk.engine.store = lambda caches, chunks, **kw: (seen.append(("store", sorted(c.slot for c in chunks))),
                                                      orig_store(caches, chunks, **kw))[1]
    h.add(prompt(4 * BS, 3), max_tokens=1)
    h.run()
    h.add(prompt(4 * BS, 4), max_tokens=1)  # the host tier (4 slots) evicts the first prompt's chunks
    h.run()
    gate.set()
    drain(h)
    stores = [i for i, (kind, _) in enumerate(seen) if kind == "store"]
    assert len(stores) == 2
    second = seen[stores[1]][1]
    assert ("overwrite", second) == seen[stores[1] - 1]  # right before the dispatch, the same slots
    assert fs.drops.get("slot_reused", 0) == 2  # two first-prompt writes still waited for a buffer
    assert dropped_metric(h, "slot_reused") == before + 2
    assert h.wrk.totals["fs_dropped_writes"] == 2


def test_shipped_file_config_writes_through():
    """write_back would leave other replicas without a chunk until this host tier evicts it."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parents[2] / "configs" / "tpu-inference" / "offload-fs.json").read_text())
    assert cfg["kv_connector_extra_config"]["fs_write_mode"] == "write_through"
