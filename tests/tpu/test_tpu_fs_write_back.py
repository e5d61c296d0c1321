"""``fs_write_mode: write_back`` on the TPU connector: within ``fs_write_back_lag_s``, on eviction, at shutdown.

As on vLLM (``gpu_offload/torch_backend/fs_link.py``): a stored chunk stays
only in host RAM until its lag has passed (a background thread writes it, so
an idle engine, which calls the connector no more, still publishes it), the
host tier evicts it, or the worker shuts down. A chunk the lag wrote is not
written again on eviction; every file holds its slot's bytes.
"""

import functools
import time

import numpy as np
import pytest

from tpu_standin import chunk_files, prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture
def make(fs_harness):
    return functools.partial(fs_harness, staging_blocks=16, blocks_per_chunk=1, fs_write_mode="write_back")


def wait_files(root, n, timeout=20.0):
    deadline = time.monotonic() + timeout
    while len(chunk_files(root)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(chunk_files(root))


def slot_bytes(h, slot) -> bytes:
    return b"".join(np.ascontiguousarray(v).tobytes() for v in h.wrk.engine.row_views(slot))


def file_bytes(h, key) -> bytes | None:
    buf = np.empty(h.wrk.fs._nbytes, dtype=np.uint8)
    return buf.tobytes() if h.wrk.fs.tier.read_into(key, buf) else None


def test_an_idle_engine_publishes_its_chunks_within_the_lag(make, tmp_path):
    h = make(fs_write_back_lag_s=0.3)
    t0 = time.monotonic()
    h.add(prompt(6 * BS, 1), max_tokens=1)
    h.run()  # idle from here: no more steps, no more connector calls
    assert wait_files(tmp_path / "kv", 6) == 6
    assert time.monotonic() - t0 < 15
    assert h.wrk.fs.lag_writes == 6 and h.wrk.fs.dirty_chunks == 0
    for key in h.tokens:  # each file holds its chunk's host bytes
        slot = h.sch.manager.slot_of(key)
        assert file_bytes(h, key) == slot_bytes(h, slot)
    # Evicting them later does not write them again.
    assert h.wrk.fs.tier.flush(timeout=30)  # a file is visible before its write is counted
    writes = h.wrk.fs.tier.counters()["writes_ok"]
    assert writes == 6
    h2 = h  # the same engine: a 32-slot tier, 40 new chunks evict the first 6
    h2.add(prompt(40 * BS, 2), max_tokens=1)
    h2.run()
    assert h.wrk.totals.get("fs_dropped_writes", 0) == 0
    assert wait_files(tmp_path / "kv", 46) == 46
    assert h.wrk.fs.tier.flush(timeout=30)
    assert h.wrk.fs.tier.counters()["writes_ok"] == writes + 40  # the first 6 were not rewritten


def test_nothing_is_written_before_the_lag_and_everything_at_shutdown(make, tmp_path):
    h = make(fs_write_back_lag_s=3600)
    h.add(prompt(5 * BS, 3), max_tokens=1)
    h.run()
    time.sleep(0.5)
    assert chunk_files(tmp_path / "kv") == [] and h.wrk.fs.dirty_chunks == 5
    expect = {key: slot_bytes(h, h.sch.manager.slot_of(key)) for key in h.tokens}
    fs = h.wrk.fs
    h.conn_w.shutdown()  # the engine stops: dirty chunks are written, then the tier closes
    assert fs.shutdown_writes == 5 and fs.dirty_chunks == 0
    assert len(chunk_files(tmp_path / "kv")) == 5
    reader = make(fs_write_back_lag_s=3600)  # another engine on the directory reads them back
    for key, data in expect.items():
        assert file_bytes(reader, key) == data


def test_lag_zero_writes_at_once_and_a_reset_drops_dirty_chunks(make, tmp_path):
    h = make(fs_write_back_lag_s=3600)
    h.add(prompt(3 * BS, 4), max_tokens=1)
    h.run()
    assert h.wrk.fs.dirty_chunks == 3
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.add(prompt(2 * BS, 5), max_tokens=1)  # the worker follows the reset with this step's metadata
    h.run()
    assert h.wrk.fs.dirty_chunks == 2  # the old weights' 3 never reach a file
    h.conn_w.shutdown()
    assert len(chunk_files(h.sch.fs.ns_dir)) == 2
    z = make(fs_write_back_lag_s=0)
    z.add(prompt(4 * BS, 6), max_tokens=1)
    z.run()
    assert wait_files(z.sch.fs.ns_dir, 4, timeout=10) == 4 and z.wrk.fs.lag_writes == 4


def test_an_idle_engine_publishes_more_chunks_than_copy_buffers(make, tmp_path):
    h = make(fs_write_back_lag_s=0.2, fs_threads=1, fs_queue_depth=2)  # 2 copy buffers
    assert len(h.wrk.fs._bufs) == 2
    files = h.wrk.fs.tier.files
    real = files.write
    files.write = lambda *a, **kw: (time.sleep(0.05), real(*a, **kw))[1]
    h.add(prompt(8 * BS, 7), max_tokens=1)
    h.run()  # idle from here: the write-back thread alone copies the rest out as buffers free up
    assert wait_files(tmp_path / "kv", 8) == 8
    assert h.wrk.fs.pending_writes() == 0 and h.wrk.fs.dropped_writes == 0
    for key in h.tokens:
        assert file_bytes(h, key) == slot_bytes(h, h.sch.manager.slot_of(key))
