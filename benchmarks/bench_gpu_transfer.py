"""Transfer-engine bandwidth vs one contiguous pinned memcpy of the same bytes.

    python benchmarks/bench_gpu_transfer.py                 # CUDA if present, else CPU
    python benchmarks/bench_gpu_transfer.py --device cuda   # CUDA only (skips without it)
    python benchmarks/bench_gpu_transfer.py --device cpu    # CPU tensors, labelled cpu

For each page size (bytes of one engine block in one layer) the engine moves
the same total bytes: ``layers`` KV tensors, scattered engine blocks, host
slots as the LRU hands them out (consecutive; ``--scatter-slots`` for
random). ``--gather index fused`` runs each staged gather on the same tensors
against the same baseline ("fused": one kernel launch per piece for all
tensors, ``fused_gather``; the row says "index" where it fell back). Store = device -> host slots, load = host slots -> device, timed from
submit to ``wait()``; "both" submits a store and a load of other blocks at
once (each lane has its own streams). The baseline is one ``copy_`` of the
same number of bytes between a contiguous device buffer and a pinned host
buffer, and for "both" one D2H and one H2D on two streams at once (on CPU:
``np.copyto`` between two host buffers). Every load is checked bit-exact.
"both enqueue ms": host time to submit the store and the load (the Python
side of a "both" transfer; the device work runs behind it).

On CUDA the host slab is pinned with ``cudaHostRegister`` and transfers run
on the engine's own streams ("staged": device gather into a slot-shaped
staging buffer, then one DMA per run of consecutive slots). Results go to
``results/gpu_transfer_<device>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import print_table, pyplot, save_figure, write_json  # noqa: E402
from gpu_offload.torch_backend.engine import HostTransferEngine  # noqa: E402

KIB = 1 << 10
ERRORS: list[str] = []  # gathers that failed (their rows hold NaN); the run exits non-zero


def gpu_spec(blocks: np.ndarray):
    return types.SimpleNamespace(block_ids=blocks.astype(np.int32), group_sizes=[len(blocks)], block_indices=[0])


def host_spec(slots: np.ndarray):
    return types.SimpleNamespace(block_ids=slots.astype(np.int32))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (which must finish its own work), after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def memcpy_baseline(nbytes: int, device: torch.device, reps: int) -> tuple[float, float, float]:
    """(device->host, host->device, both at once on two streams) seconds for contiguous copies of ``nbytes``."""
    if device.type == "cuda":
        dev = torch.full((nbytes,), 1, dtype=torch.int8, device=device)
        dev2 = torch.full((nbytes,), 3, dtype=torch.int8, device=device)
        host = torch.full((nbytes,), 2, dtype=torch.int8, pin_memory=True)
        host2 = torch.full((nbytes,), 4, dtype=torch.int8, pin_memory=True)
        d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, reps)
        h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, reps)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both():
            with torch.cuda.stream(s1):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(s2):
                dev2.copy_(host2, non_blocking=True)

        return d2h, h2d, timed(both, device, reps)
    a, b = np.full(nbytes, 1, np.int8), np.full(nbytes, 2, np.int8)  # CPU: a plain memcpy
    c, d = a.copy(), b.copy()
    d2h, h2d = timed(lambda: np.copyto(b, a), device, reps), timed(lambda: np.copyto(a, b), device, reps)
    return d2h, h2d, timed(lambda: (np.copyto(b, a), np.copyto(c, d)), device, reps)


def bench_gather(gather: str, tensors, page: int, n: int, args, device: torch.device, rng) -> dict:
    """Store, load and both at once through one engine with ``gather`` ("index" or "fused")."""
    layers, k = args.layers, args.blocks_per_chunk
    num_blocks = 3 * n
    n_chunks = n // k
    engine = HostTransferEngine(tensors, [page] * layers, [tuple(range(layers))], 2 * n_chunks, k,
                                staging_blocks=args.staging_blocks, strategy=args.strategy, gather=gather)
    used = engine.gather_used
    perm = rng.permutation(num_blocks)
    blocks, dst, more = perm[:n], perm[n:2 * n], perm[2 * n:]  # stored from `blocks`, loaded into disjoint `dst`
    order = rng.permutation(2 * n_chunks) if args.scatter_slots else np.arange(2 * n_chunks)
    slots, other = order[:n_chunks], order[n_chunks:]  # `other`: the slots the "both" store writes
    job = iter(range(1 << 30))
    enqueue: list[float] = []

    def store():
        j = next(job)
        engine.submit_store(j, gpu_spec(blocks), host_spec(slots))
        engine.wait({j})
        assert all(r.nbytes for r in engine.get_finished()), "store failed"

    def load():
        j = next(job)
        engine.submit_load(j, host_spec(slots), gpu_spec(dst))
        engine.wait({j})
        engine.get_finished()
        assert not engine.take_load_error_blocks(), "load error"

    def both():
        js, jl = next(job), next(job)
        t0 = time.perf_counter()
        engine.submit_store(js, gpu_spec(more), host_spec(other))
        engine.submit_load(jl, host_spec(slots), gpu_spec(dst))
        enqueue.append(time.perf_counter() - t0)
        engine.wait({js, jl})
        engine.get_finished()
        assert not engine.take_load_error_blocks(), "load error"

    for t in tensors:  # each gather loads into `dst` afresh: clear it so the check below proves this run
        t[torch.as_tensor(dst, device=device)] = 0
    for _ in range(4):  # grows every index-upload buffer of both lanes (fused plans are larger) before timing
        store()
        load()
    t_store = timed(store, device, args.reps)
    t_load = timed(load, device, args.reps)
    t_both = timed(both, device, args.reps)
    for t in tensors[:2]:  # bit-exact: the loaded blocks equal the stored ones
        assert torch.equal(t[torch.as_tensor(dst, device=device)], t[torch.as_tensor(blocks, device=device)])
    engine.shutdown()
    return {"gather": used, "store s": t_store, "load s": t_load, "both s": t_both,
            "both enqueue ms": 1e3 * statistics.median(enqueue[1:] or enqueue)}


def bench_page(page: int, args, device: torch.device, rng) -> list[dict]:
    """One row per gather, all against the same memcpy baseline."""
    layers, k = args.layers, args.blocks_per_chunk
    n = max(k, args.total_mib * 2**20 // (layers * page) // k * k)  # blocks per transfer, whole chunks
    tensors = [torch.randint(-128, 128, (3 * n, page), dtype=torch.int8, device=device) for _ in range(layers)]
    nbytes = n * layers * page
    d2h, h2d, two = memcpy_baseline(nbytes, device, args.reps)
    gb = nbytes / 1e9
    rows = []
    seed = int(rng.integers(1 << 31))  # every gather moves the same blocks to the same slots
    nan = float("nan")
    for gather in args.gather:
        try:
            r = bench_gather(gather, tensors, page, n, args, device, np.random.default_rng(seed))
        except Exception as e:  # one gather failing (e.g. its kernel) must not cost the others' rows
            print(f"!! {gather} gather at {page // KIB} KiB pages failed: {e!r}")
            ERRORS.append(f"{gather} at {page // KIB} KiB: {e!r}")
            r = {"gather": f"{gather} FAILED", "store s": nan, "load s": nan, "both s": nan, "both enqueue ms": nan}
        rows.append({
            "device": device.type,
            "page KiB": page // KIB,
            "gather": r["gather"],
            "blocks": n,
            "MiB": nbytes / 2**20,
            "store GB/s": gb / r["store s"],
            "load GB/s": gb / r["load s"],
            "memcpy D2H GB/s": gb / d2h,
            "memcpy H2D GB/s": gb / h2d,
            "both GB/s": 2 * gb / r["both s"],
            "memcpy both GB/s": 2 * gb / two,
            "store % memcpy": 100 * d2h / r["store s"],
            "load % memcpy": 100 * h2d / r["load s"],
            "both % memcpy": 100 * two / r["both s"],
            "both enqueue ms": r["both enqueue ms"],
        })
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--page-kib", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    ap.add_argument("--out", default=None, help="result name (default gpu_transfer_<device>)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--total-mib", type=int, default=0, help="bytes per transfer (default 512 cuda, 32 cpu)")
    ap.add_argument("--staging-blocks", type=int, default=128)
    ap.add_argument("--strategy", default="auto", choices=["auto", "direct", "staged"])
    ap.add_argument("--scatter-slots", action="store_true")
    ap.add_argument("--gather", nargs="+", default=["index"], choices=["index", "fused"],
                    help="staged gathers to compare, each on the same tensors and memcpy baseline")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: skipping the CUDA transfer benchmark "
              "(run with --device cpu to exercise the same code on CPU tensors).")
        return 0
    if args.device == "auto" and not torch.cuda.is_available():
        print("CUDA is not available: running on CPU tensors (labelled cpu); these are not GPU numbers.")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    args.total_mib = args.total_mib or (512 if device.type == "cuda" else 32)
    rng = np.random.default_rng(0)
    rows = [r for p in args.page_kib for r in bench_page(p * KIB, args, device, rng)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, title=f"transfer engine vs contiguous memcpy ({name}, {args.layers} layers, "
                            f"{args.blocks_per_chunk} blocks/chunk, median of {args.reps})")
    out = args.out or f"gpu_transfer_{device.type}"
    path = write_json(out, {"device_name": name, "torch": torch.__version__, "args": vars(args), "rows": rows,
                            "errors": ERRORS})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for gather in dict.fromkeys(r["gather"] for r in rows):
            mine = [r for r in rows if r["gather"] == gather]
            x = [r["page KiB"] for r in mine]
            for key, style in [("store GB/s", "o-"), ("load GB/s", "s-"), ("both GB/s", "^-")]:
                ax.plot(x, [r[key] for r in mine], style, label=f"{key} ({gather})")
        base = list({r["page KiB"]: r for r in rows}.values())
        for key, style in [("memcpy D2H GB/s", "o--"), ("memcpy H2D GB/s", "s--"), ("memcpy both GB/s", "^--")]:
            ax.plot([r["page KiB"] for r in base], [r[key] for r in base], style, label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"host tier transfers ({name})")
        ax.legend(fontsize=8)
        save_figure(fig, out)
    print(f"wrote {path}")
    return 1 if ERRORS else 0


if __name__ == "__main__":
    raise SystemExit(main())
