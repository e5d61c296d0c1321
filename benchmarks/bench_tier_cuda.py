"""The whole GPU tiering path on one machine: device pages -> host slab -> signed chunk files -> back.

    python benchmarks/bench_tier_cuda.py [--device cuda|cpu] [--dir PATH] [--total-mib 512]

What a vLLM engine with our file tier does, minus vLLM (this runs where
torch and CUDA are, with no engine): engine A's ``HostTransferEngine``
gathers KV pages from device tensors into its pinned host slab (our CUDA
copies on their own streams) and writes each stored chunk through to a
``FileTier`` (signed and keyed with a secret, as shipped; the tier's default
threads); engine B, a second process's view (its own device tensors, an
empty slab, the same directory), loads the same chunks: files -> its slab
(verified reads on the tier's I/O threads) -> its device pages. Every loaded
block is checked bit-exact against A's.

Timed, each a median of ``--reps`` on fresh keys:

* store: submit -> A's device pages in its slab (``wait``), then -> every
  file published (``flush``): the two legs and the total;
* load: submit -> every block on B's device (promotion + host->device copy);
* baselines on the same bytes: one pinned memcpy each way (CUDA), and the
  same number of chunk-sized files written (``write`` + rename) and read
  back (``readinto``) by plain Python on the same directory: the disk and
  page cache's own figure for this file size, with no MAC, no header.

The page cache is not dropped (no privilege is assumed): reads of files
written moments before may come from memory on both sides alike.
Output: a table and ``results/tier_<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from _common import print_table, write_json  # noqa: E402
from gpu_offload.torch_backend.engine import HostTransferEngine  # noqa: E402
from tpu_offload.core.fs import FileTier, FsMetrics  # noqa: E402
from tpu_offload.core.keys import LayoutFingerprint  # noqa: E402

MIB = 1 << 20


def gpu_spec(blocks) -> types.SimpleNamespace:
    return types.SimpleNamespace(block_ids=np.asarray(blocks, np.int32), group_sizes=[len(blocks)], block_indices=[0])


def store_spec(slots, keys) -> types.SimpleNamespace:
    """What ``gpu_offload.vllm.fs_specs.HostStoreSpec`` carries (duck-typed: no vLLM here)."""
    return types.SimpleNamespace(block_ids=np.asarray(slots, np.int32), keys=list(keys), evicted=[], salt=b"",
                                 epoch="")


def load_spec(slots, keys) -> types.SimpleNamespace:
    """``HostLoadSpec`` with every chunk promoted from its file first."""
    n = len(slots)
    return types.SimpleNamespace(block_ids=np.asarray(slots, np.int32), keys=list(keys),
                                 promote=np.ones(n, dtype=bool), evicted=[], salt=b"", epoch="",
                                 device_blocks=None, budget_s=0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Side:
    """One engine: device tensors, a transfer engine over them and a file tier on the shared directory."""

    def __init__(self, args, device, root: str, secret: bytes, seed: int, num_blocks: int, num_slots: int):
        g = torch.Generator(device="cpu").manual_seed(seed)
        page = args.page_kib * 1024
        self.tensors = [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=g).to(device)
                        for _ in range(args.layers)]
        self.engine = HostTransferEngine(self.tensors, [page] * args.layers, [tuple(range(args.layers))],
                                         num_slots, args.blocks_per_chunk)
        fp = LayoutFingerprint("bench", "int8", 16, args.blocks_per_chunk, args.layers, 1, page)
        self.tier = FileTier(root, fp, self.engine.pool.chunk_bytes, capacity_bytes=None, secret=secret,
                             fs_metrics=FsMetrics(CollectorRegistry()), threads=args.threads)
        self.engine.attach_files(self.tier)

    def close(self) -> None:
        self.engine.shutdown()
        self.tier.close(timeout=30)


def raw_files(root: str, chunk_bytes: int, n: int, reps: int) -> tuple[float, float]:
    """(write s, read s) of n chunk-sized files by plain Python (write + rename; readinto), median of reps."""
    buf = np.random.default_rng(1).integers(0, 255, chunk_bytes, dtype=np.uint8)
    out = np.empty(chunk_bytes, np.uint8)
    d = os.path.join(root, "raw")
    w, r = [], []
    for rep in range(reps):
        os.makedirs(d, exist_ok=True)
        t0 = time.perf_counter()
        for i in range(n):
            p = os.path.join(d, f"{rep}-{i}")
            with open(p + ".tmp", "wb") as f:
                f.write(memoryview(buf))
            os.replace(p + ".tmp", p)
        w.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            with open(os.path.join(d, f"{rep}-{i}"), "rb", buffering=0) as f:
                f.readinto(memoryview(out))
        r.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    return statistics.median(w), statistics.median(r)


def memcpy(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """(D2H s, H2D s) of one contiguous pinned copy of nbytes; NaN off CUDA."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    dev = torch.ones(nbytes, dtype=torch.int8, device=device)
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    out = []
    for fn in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, non_blocking=True)):
        ts = []
        for _ in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts[1:]))
    return out[0], out[1]


def run(args, device: torch.device, root: str) -> dict:
    k = args.blocks_per_chunk
    chunk_bytes = k * args.layers * args.page_kib * 1024
    n_chunks = max(1, args.total_mib * MIB // chunk_bytes)
    n_blocks = n_chunks * k
    secret = os.urandom(32)
    a = Side(args, device, root, secret, 0, n_blocks, n_chunks)
    b = Side(args, device, root, secret, 1, n_blocks, n_chunks)
    slots = list(range(n_chunks))
    blocks = list(range(n_blocks))
    stores, to_host, to_files, loads = [], [], [], []
    job = 0
    try:
        for rep in range(args.reps + 1):  # the first round warms every lane and buffer
            keys = [rep.to_bytes(4, "big") + i.to_bytes(28, "big") + b"\0" * 4 for i in range(n_chunks)]
            job += 1
            sync(device)
            t0 = time.perf_counter()
            a.engine.submit_store(job, gpu_spec(blocks), store_spec(slots, keys))
            a.engine.wait({job})
            assert all(r.nbytes for r in a.engine.get_finished()), "store failed"
            t1 = time.perf_counter()
            assert a.engine.fs.flush(120), "file writes did not finish"
            t2 = time.perf_counter()
            assert a.engine.fs.stats.writes_dropped == 0, "the tier dropped writes"
            for t in b.tensors:
                t.zero_()
            b.engine.pool.valid[:] = False  # an empty slab: every chunk comes from its file
            job += 1
            sync(device)
            t3 = time.perf_counter()
            b.engine.submit_load(job, load_spec(slots, keys), gpu_spec(blocks))
            b.engine.wait({job})
            b.engine.get_finished()
            sync(device)
            t4 = time.perf_counter()
            assert not b.engine.take_load_error_blocks(), "load errors"
            for ta, tb in zip(a.tensors, b.tensors):
                assert torch.equal(ta, tb), "loaded KV differs from the stored KV"
            if rep:
                stores.append(t2 - t0)
                to_host.append(t1 - t0)
                to_files.append(t2 - t1)
                loads.append(t4 - t3)
        gather = a.engine.gather_used
    finally:
        a.close()
        b.close()
    nbytes = n_chunks * chunk_bytes
    raw_w, raw_r = raw_files(root, chunk_bytes, n_chunks, args.reps)
    d2h, h2d = memcpy(nbytes, device, args.reps)
    gb = nbytes / 1e9
    med = statistics.median
    return {
        "device": device.type, "layers": args.layers, "page KiB": args.page_kib, "chunk MiB": chunk_bytes / MIB,
        "chunks": n_chunks, "MiB": nbytes / MIB,
        "store GB/s": gb / med(stores), "  device->slab GB/s": gb / med(to_host),
        "  slab->files GB/s": gb / med(to_files), "load GB/s": gb / med(loads),
        "raw write GB/s": gb / raw_w, "raw read GB/s": gb / raw_r,
        "memcpy D2H GB/s": gb / d2h, "memcpy H2D GB/s": gb / h2d,
        "store % raw": 100 * raw_w / med(stores), "load % raw": 100 * raw_r / med(loads),
        "gather": gather,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--dir", default=None, help="directory for the files (default: a temp dir under /var/tmp)")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--blocks-per-chunk", type=int, default=16)
    ap.add_argument("--total-mib", type=int, default=0, help="bytes per round (default 512 cuda, 64 cpu)")
    ap.add_argument("--threads", type=int, default=8, help="the tier's I/O threads (fs_threads; 8 is the default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: skipping (run with --device cpu for the same path on CPU tensors).")
        return 0
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    args.total_mib = args.total_mib or (512 if device.type == "cuda" else 64)
    base = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    rows = []
    for layers in args.layers:
        root = tempfile.mkdtemp(prefix="bench-tier-", dir=base)
        try:
            rows.append(run(argparse.Namespace(**{**vars(args), "layers": layers}), device, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, title=f"GPU tiering path: device -> slab -> signed files -> slab -> device ({name}, "
                            f"median of {args.reps})")
    path = write_json(args.out or f"tier_{device.type}", {"device_name": name, "torch": torch.__version__,
                                                          "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
