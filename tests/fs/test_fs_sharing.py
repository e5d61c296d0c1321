"""Several processes on one directory: sharing, no corruption, bounded size."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

from fs_helpers import FILE, layout, shared_writer
from tpu_offload.core.fs import admin
from tpu_offload.core.fs import layout as fslayout


def _ns_bytes(ns_dir):
    s = fslayout.scan_namespace(ns_dir)
    return sum(f.size for f in s.chunks)


def test_four_processes_share_one_directory(root):
    capacity = 24 * FILE
    ns_dir = os.path.join(root, layout().namespace())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=shared_writer, args=(root, seed, capacity, 400, 60, q)) for seed in range(4)]
    peak = [0]
    stop = threading.Event()

    def monitor():
        while not stop.wait(0.01):
            peak[0] = max(peak[0], _ns_bytes(ns_dir))

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    for p in procs:
        p.start()
    results = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    stop.set()
    mon.join()
    assert sum(r["wrong"] for r in results) == 0, results
    # Every process hit chunks, including ones the others wrote.
    assert all(r["hits"] > 0 for r in results), results
    shared = sum(r["counters"].get("writes_exist", 0) for r in results)
    rep = admin.verify(root)
    assert rep.bad == [], rep.bad
    assert fslayout.scan_namespace(ns_dir).temps == []
    final = _ns_bytes(ns_dir)
    assert final <= capacity, (final, capacity)
    # Between rescans (50 ms) each instance only knows its own new files, so the
    # directory can overshoot briefly; it must stay within a small multiple.
    assert peak[0] <= 2 * capacity, (peak[0], capacity)
    print(f"\nfinal {final / FILE:.0f} files, peak {peak[0] / FILE:.0f} files (cap 24); "
          f"hits {[r['hits'] for r in results]}, writes {[r['writes'] for r in results]}, "
          f"already-published skips {shared}, evictions {[r['counters'].get('evicted', 0) for r in results]}")


_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[2])
from prometheus_client import CollectorRegistry
from fs_helpers import aligned, key, layout, payload
from tpu_offload.core.fs import FileTier, FsMetrics
t = FileTier(sys.argv[1], layout(), 64 << 10, capacity_bytes=None, fs_metrics=FsMetrics(CollectorRegistry()))
for i in range(1000, 1005):
    b = aligned(); b[:] = payload(i)
    assert t.submit_write(key(i), b).wait(30)
t.close()
"""


def test_what_one_process_writes_another_hits(root, make_tier):
    import numpy as np

    from fs_helpers import REPO, aligned, key, payload, run_child

    reader = make_tier(root)  # started first: its index cannot know the files
    r = run_child(_WRITER, root, os.path.join(REPO, "tests", "fs"))
    assert r.returncode == 0, r.stderr
    out = aligned()
    for i in range(1000, 1005):
        assert reader.contains(key(i))
        assert reader.read_into(key(i), out) and np.array_equal(out, payload(i))
