"""Engine-thread latency of the file tier while it rescans a large directory.

A tier's periodic rescan re-reads the whole namespace (other instances'
files). The engine thread calls ``touch`` and ``read_into`` meanwhile; they
must never wait for the rescan. This builds ``--files`` chunk files (sparse,
so the disk fills with inodes, not bytes), opens a tier on them, then runs
``--rescans`` rescans on a background thread while the main thread, paced
like an engine step (``--gap-ms``), times ``touch`` of indexed keys and
``read_into`` of a few real chunks. The same is timed with no rescan running
(idle). Percentiles are in milliseconds.

Old code can be measured with the same script: ``--tree DIR`` imports
``tpu_offload`` from DIR (e.g. ``git archive <commit> tpu_offload | tar -x -C
DIR``) and ``--label`` names the run. Runs are merged into
``benchmarks/results/fs_rescan.json`` by label.

Run: ``python benchmarks/bench_fs_rescan.py [--files 150000] [--dir /var/tmp]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from _common import RESULTS, print_table, write_json  # noqa: E402

CHUNK = 64 << 10
HEADER = 4096


def _percentiles(lat: list[float]) -> dict:
    if not lat:
        return {"n": 0}
    a = np.asarray(lat) * 1e3
    return {"n": len(a), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "p99.9_ms": float(np.percentile(a, 99.9)), "max_ms": float(a.max()),
            "over_10ms": int((a > 10).sum()), "waited_over_1ms_s": float(a[a > 1].sum() / 1e3)}


def _make_files(ns_dir: str, keys: list[bytes], size: int) -> float:
    """Sparse files of the tier's size at the keys' paths; returns seconds taken."""
    t0 = time.perf_counter()
    made = set()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for k in keys:
        h = k.hex()
        d = os.path.join(ns_dir, h[0:2], h[2:4])
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        fd = os.open(os.path.join(d, h), flags, 0o640)
        os.ftruncate(fd, size)
        os.close(fd)
    return time.perf_counter() - t0


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def run(args) -> dict:
    sys.path.insert(0, os.path.abspath(args.tree))
    from prometheus_client import CollectorRegistry

    import tpu_offload
    from tpu_offload.core.fs import FileTier, FsMetrics
    from tpu_offload.core.keys import LayoutFingerprint, make_chunk_key

    src = os.path.dirname(os.path.abspath(tpu_offload.__file__))
    fp = LayoutFingerprint(model="bench/rescan", dtype="bfloat16", block_size=16, blocks_per_chunk=4,
                           num_layers=2, kv_heads_per_rank=2, head_dim=64)
    root = tempfile.mkdtemp(prefix="bench-fs-rescan-", dir=args.dir)
    try:
        keys = [make_chunk_key(i.to_bytes(8, "big") * 4, 0) for i in range(args.files)]
        make_s = _make_files(os.path.join(root, fp.namespace()), keys, HEADER + CHUNK)
        t0 = time.perf_counter()
        tier = FileTier(root, fp, CHUNK, capacity_bytes=None, threads=2, rescan_interval_s=1e9,
                        touch_interval_s=1e9, fs_metrics=FsMetrics(CollectorRegistry()))
        first_scan_s = time.perf_counter() - t0
        assert len(tier.keys_lru_order()) == args.files, "the tier did not index every file"
        real = [make_chunk_key(b"real" + i.to_bytes(28, "big"), 0) for i in range(16)]
        buf = np.empty(CHUNK, np.uint8)
        for i, k in enumerate(real):
            buf[:] = i
            assert tier.submit_write(k, buf).wait(30)
        out = np.empty(CHUNK, np.uint8)
        rng = np.random.default_rng(0)
        gap = args.gap_ms / 1e3

        def engine_ops(stop: threading.Event | None, seconds: float) -> tuple[list, list]:
            touch, read = [], []
            end = time.perf_counter() + seconds
            while (stop is None and time.perf_counter() < end) or (stop is not None and not stop.is_set()):
                touch.append(_timed(tier.touch, keys[int(rng.integers(len(keys)))]))
                t = time.perf_counter()
                ok = tier.read_into(real[int(rng.integers(len(real)))], out)
                read.append(time.perf_counter() - t)
                assert ok, "a real chunk must read back"
                time.sleep(gap)
            return touch, read

        idle_touch, idle_read = engine_ops(None, args.idle_s)
        scans: list[float] = []
        stop = threading.Event()

        def rescans() -> None:
            try:
                for _ in range(args.rescans):
                    scans.append(_timed(tier.rescan))
            finally:
                stop.set()

        th = threading.Thread(target=rescans)
        th.start()
        busy_touch, busy_read = engine_ops(stop, 0)
        th.join()
        assert len(tier.keys_lru_order()) == args.files + len(real)
        tier.close()
        return {
            "label": args.label, "tree": src, "files": args.files, "make_files_s": round(make_s, 2),
            "first_scan_s": round(first_scan_s, 2), "rescan_s": [round(s, 2) for s in scans],
            "gap_ms": args.gap_ms,
            "idle": {"touch": _percentiles(idle_touch), "read_into": _percentiles(idle_read)},
            "during_rescan": {"touch": _percentiles(busy_touch), "read_into": _percentiles(busy_read)},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=150_000)
    ap.add_argument("--rescans", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=1.0, help="engine-thread pause between operations")
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    ap.add_argument("--tree", default=REPO, help="import tpu_offload from this source tree")
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    res = run(args)
    path = RESULTS / "fs_rescan.json"
    runs = {}
    if path.exists():
        try:
            runs = json.loads(path.read_text()).get("runs", {})
        except ValueError:
            runs = {}
    runs[args.label] = res
    rows = []
    for label, r in runs.items():
        for phase in ("idle", "during_rescan"):
            for op in ("touch", "read_into"):
                p = r[phase][op]
                rows.append({"run": label, "files": r["files"], "phase": phase, "op": op, "n": p["n"],
                             "p50 ms": p.get("p50_ms", 0.0), "p99 ms": p.get("p99_ms", 0.0),
                             "p99.9 ms": p.get("p99.9_ms", 0.0), "max ms": p.get("max_ms", 0.0),
                             ">10ms": p.get("over_10ms", 0), "stalled s": p.get("waited_over_1ms_s", 0.0),
                             "rescan s": max(r["rescan_s"]) if phase == "during_rescan" else ""})
    print_table(rows, title="file tier: engine-thread latency while a rescan runs")
    write_json("fs_rescan", {"runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
