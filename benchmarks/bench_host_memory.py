"""Which host memory the copy engines move fastest: one way, and both ways at once.

    python benchmarks/bench_host_memory.py [--mib 512]   # needs CUDA

The host tier is a numpy slab registered with ``cudaHostRegister``; torch's
own pinned memory comes from ``cudaHostAlloc``. Each kind moves the same bytes
to and from one device buffer: D2H, H2D, and D2H + H2D on two streams at once.
Kinds: torch ``pin_memory``; numpy, registered; an anonymous mmap advised to
use transparent huge pages (``MADV_HUGEPAGE``), registered. Writes
``results/host_memory_cuda.json``.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import print_table, write_json  # noqa: E402
from gpu_offload.torch_backend import cuda_lane  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def host_buffers(kind: str, nbytes: int):
    """Two host int8 tensors of ``nbytes`` (one per direction) and what keeps them alive."""
    if kind == "torch pin_memory":
        return [torch.empty(nbytes, dtype=torch.int8, pin_memory=True) for _ in range(2)], []
    keep, out = [], []
    for _ in range(2):
        if kind == "numpy, registered":
            arr = np.empty(nbytes, dtype=np.int8)
        else:  # mmap + MADV_HUGEPAGE, registered
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            arr = np.frombuffer(m, dtype=np.int8)
            keep.append(m)
        arr[::4096] = 0  # fault the pages in before registering
        t = torch.from_numpy(arr)
        ptrs, _ = cuda_lane.register_host_rows(t.view(1, -1))
        if not ptrs:
            raise RuntimeError(f"{kind}: cudaHostRegister failed")
        keep.append((arr, ptrs))
        out.append(t)
    return out, keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available: skipping the host memory benchmark.")
        return 0
    nbytes = args.mib << 20
    dev = [torch.ones(nbytes, dtype=torch.int8, device="cuda") for _ in range(2)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for kind in ("torch pin_memory", "numpy, registered", "mmap + MADV_HUGEPAGE, registered"):
        (h1, h2), keep = host_buffers(kind, nbytes)

        def both():
            with torch.cuda.stream(s1):
                h1.copy_(dev[0], non_blocking=True)
            with torch.cuda.stream(s2):
                dev[1].copy_(h2, non_blocking=True)

        d2h = timed(lambda: h1.copy_(dev[0], non_blocking=True), args.reps)
        h2d = timed(lambda: dev[1].copy_(h2, non_blocking=True), args.reps)
        two = timed(both, args.reps)
        gb = nbytes / 1e9
        rows.append({"host memory": kind, "D2H GB/s": gb / d2h, "H2D GB/s": gb / h2d, "both GB/s": 2 * gb / two})
        for _, ptrs in (k for k in keep if isinstance(k, tuple)):
            cuda_lane.unregister_host(ptrs)
        del h1, h2, keep
    name = torch.cuda.get_device_name()
    print_table(rows, title=f"host memory kinds ({name}, {args.mib} MiB, median of {args.reps})")
    print(f"wrote {write_json('host_memory_cuda', {'device_name': name, 'torch': torch.__version__, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
