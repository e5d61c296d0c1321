"""File tier throughput vs raw sequential file I/O on the same disk, same run.

For each chunk size and I/O thread count, FileTier writes a fixed number of
bytes from a page-aligned host slab (one file per chunk, header + checksum,
temp + rename), then reads them back into another slab (header + checksum
verified). The baseline is dd-like: one thread, one file, plain ``os.write``
/ ``os.readv`` of the same rows. Reported per cell:

* write (page cache): bytes / time until every write is done;
* write (durable): the same plus ``syncfs`` of the filesystem;
* read (cold): after ``echo 3 > /proc/sys/vm/drop_caches`` (when allowed);
* read (warm): the same files again, from the page cache.

With ``--auth-threads N`` (default 8; 0 skips), the tier also runs at N
threads with a secret (HMAC-SHA256 over header and payload, rows
``tier_mac``), with ``fs_mac: gmac`` (rows ``tier_gmac``) and with
``fs_encrypt`` (AES-256-GCM, rows ``tier_aes_gcm``),
next to the plain tier at the same thread count: what authenticating and
encrypting chunks cost.

Ratios are tier / raw for the same chunk size. Output: a table on stdout,
``benchmarks/results/fs_io.json`` and ``benchmarks/results/fs_io.png``.
Run: ``python benchmarks/bench_fs.py [--total-mib 256] [--dir PATH]``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tpu_offload.core.fs import FileTier  # noqa: E402
from tpu_offload.core.fs import layout as fslayout  # noqa: E402
from tpu_offload.core.fs.fileio import aligned_empty, read_all, write_all  # noqa: E402
from tpu_offload.core.keys import LayoutFingerprint, make_chunk_key  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_cell(d: str, src: np.ndarray, dst: np.ndarray, can_drop: bool) -> dict:
    """dd-like: one thread, one file, one os.write / os.readv per row."""
    path = os.path.join(d, "raw.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        for row in src:
            mv = memoryview(row)
            while mv:
                mv = mv[os.write(fd, mv):]
    finally:
        os.close(fd)
    t1 = time.perf_counter()
    syncfs(d)
    t2 = time.perf_counter()
    out = {"write_cached": src.nbytes / (t1 - t0), "write_durable": src.nbytes / (t2 - t0)}
    for phase in ("read_cold", "read_warm"):
        if phase == "read_cold" and can_drop:
            drop_caches()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            for row in dst:
                mv = memoryview(row)
                while mv:
                    n = os.readv(fd, [mv])
                    assert n > 0, "raw file shorter than written"
                    mv = mv[n:]
        finally:
            os.close(fd)
        out[phase] = dst.nbytes / (time.perf_counter() - t0)
    assert np.array_equal(src, dst)
    os.unlink(path)
    return out


def bench_keys(n: int, cell: int) -> list[bytes]:
    """Hash-like keys. The fan-out prefix depends only on ``i``, so every cell
    of one chunk size reuses the same leaf directories (the steady state of a
    long-lived cache), while the rest of the key is new per cell."""
    out = []
    for i in range(n):
        prefix = hashlib.blake2b(i.to_bytes(8, "big"), digest_size=2).digest()
        rest = hashlib.blake2b(f"{cell}/{i}".encode(), digest_size=30).digest()
        out.append(make_chunk_key(prefix + rest))
    return out


def fingerprint(chunk: int) -> LayoutFingerprint:
    return LayoutFingerprint("bench", "uint8", 16, 1, 1, 1, chunk)


def make_fanout(d: str, chunk: int, n: int) -> None:
    ns = os.path.join(d, fingerprint(chunk).namespace())
    for k in bench_keys(n, 0):
        fslayout.make_dirs(fslayout.chunk_dir(ns, fslayout.key_hex(k)))


def unlink_all(paths: list[str]) -> None:
    for p in paths:
        fslayout.unlink_quiet(p)


SECRET = b"bench-secret-0123456789abcdef0123"


def tier_cell(d: str, src: np.ndarray, dst: np.ndarray, threads: int, cell: int, can_drop: bool,
              o_direct: bool = False, auth: str = "plain") -> dict:
    """``auth``: "plain" (no secret), "mac" (a secret: HMAC-SHA256), "gmac" or "aes_gcm" (fs_encrypt)."""
    n, chunk = src.shape
    tier = FileTier(d, fingerprint(chunk), chunk, capacity_bytes=None, threads=threads, queue_depth=n,
                    o_direct=o_direct, secret=None if auth == "plain" else SECRET, encrypt=auth == "aes_gcm",
                    mac="gmac" if auth == "gmac" else "hmac-sha256")
    keys = bench_keys(n, cell)
    try:
        t0 = time.perf_counter()
        tickets = [tier.submit_write(k, row) for k, row in zip(keys, src)]
        assert all(t is not None for t in tickets), "bench queue must hold every chunk"
        assert tier.flush() and all(t.succeeded() for t in tickets)
        t1 = time.perf_counter()
        syncfs(d)
        t2 = time.perf_counter()
        out = {"write_cached": src.nbytes / (t1 - t0), "write_durable": src.nbytes / (t2 - t0)}
        for phase in ("read_cold", "read_warm"):
            if phase == "read_cold" and can_drop:
                drop_caches()
            dst[:] = 0
            left = [n]
            ok = [0]
            done = threading.Event()
            lock = threading.Lock()

            def on_done(hit: bool) -> None:
                with lock:
                    ok[0] += hit
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            t0 = time.perf_counter()
            for k, row in zip(keys, dst):
                assert tier.submit_read(k, row, on_done)
            assert done.wait(600)
            out[phase] = dst.nbytes / (time.perf_counter() - t0)
            assert ok[0] == n and np.array_equal(src, dst)
        out["o_direct_used"] = tier.files.direct
    finally:
        tier.close()
        unlink_all([tier.path_of(k) for k in keys])
    return out


def files_cell(d: str, src: np.ndarray, dst: np.ndarray, threads: int, cell: int, can_drop: bool) -> dict:
    """The tier's file pattern with bare syscalls: no header, no checksum, no
    bookkeeping (create O_EXCL temp, pwrite, close, rename; open, pread, close).
    tier / this = what the tier itself costs on top of one-file-per-chunk."""
    n, chunk = src.shape
    ns = os.path.join(d, fingerprint(chunk).namespace())
    paths = [fslayout.chunk_path(ns, fslayout.key_hex(k)) for k in bench_keys(n, cell)]

    def put(i: int) -> None:
        tmp = paths[i] + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            write_all(fd, [memoryview(src[i])])
        finally:
            os.close(fd)
        os.rename(tmp, paths[i])

    def get(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            assert read_all(fd, [memoryview(dst[i])]) == chunk
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(put, range(n)))
        t1 = time.perf_counter()
        syncfs(d)
        t2 = time.perf_counter()
        out = {"write_cached": src.nbytes / (t1 - t0), "write_durable": src.nbytes / (t2 - t0)}
        for phase in ("read_cold", "read_warm"):
            if phase == "read_cold" and can_drop:
                drop_caches()
            t0 = time.perf_counter()
            list(ex.map(get, range(n)))
            out[phase] = dst.nbytes / (time.perf_counter() - t0)
    assert np.array_equal(src, dst)
    unlink_all(paths)
    return out


def create_cost_us(d: str, n: int = 256) -> float:
    """Metadata floor of this filesystem: create + close + unlink of one empty file."""
    sub = os.path.join(d, "create-probe")
    os.makedirs(sub, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        os.close(os.open(os.path.join(sub, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
    dt = time.perf_counter() - t0
    shutil.rmtree(sub)
    return dt / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(REPO, ".cache", "bench_fs"),
                    help="directory on the disk under test (not tmpfs)")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per cell")
    ap.add_argument("--chunks-kib", default="256,1024,4096,16384,65536")
    ap.add_argument("--threads", default="1,2,4,8,16,32")
    ap.add_argument("--o-direct-threads", type=int, default=8,
                    help="also run O_DIRECT at this thread count (0: skip)")
    ap.add_argument("--auth-threads", type=int, default=8,
                    help="also run the tier with a MAC and with AES-GCM at this thread count (0: skip)")
    ap.add_argument("--files-threads", default="1,8",
                    help="thread counts for the bare one-file-per-chunk baseline")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the best is kept (shared machine)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "fs_io.json"))
    args = ap.parse_args()
    chunks = [int(c) * 1024 for c in args.chunks_kib.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    files_threads = [int(t) for t in args.files_threads.split(",") if t.strip()]
    total = args.total_mib * MIB
    os.makedirs(args.dir, exist_ok=True)
    fstype = _fstype(args.dir)
    can_drop = drop_caches()
    create_us = create_cost_us(args.dir)
    print(f"dir {args.dir} ({fstype}); {args.total_mib} MiB per cell, best of {args.repeat}; page cache drop: "
          f"{'yes' if can_drop else 'NO (cold reads may be warm)'}; {os.cpu_count()} CPUs; "
          f"creating one empty file costs {create_us:.0f} us here")
    rng = np.random.default_rng(0)
    src_flat = aligned_empty(total)
    src_flat[:] = rng.integers(0, 256, total, dtype=np.uint8)
    dst_flat = aligned_empty(total)
    results = []
    metrics = ("write_cached", "write_durable", "read_cold", "read_warm")
    t_start = time.time()
    cell = [0]

    def best(fn, *a, **kw) -> dict:
        runs = []
        for _ in range(args.repeat):
            cell[0] += 1
            runs.append(fn(*a, cell[0], can_drop, **kw) if fn is not raw_cell else fn(*a, can_drop))
        out = {m: max(r[m] for r in runs) for m in metrics}
        out.update({k: v for k, v in runs[-1].items() if k not in metrics})
        return out

    for chunk in chunks:
        n = total // chunk
        src = src_flat[: n * chunk].reshape(n, chunk)
        dst = dst_flat[: n * chunk].reshape(n, chunk)
        make_fanout(args.dir, chunk, n)
        raw = best(raw_cell, args.dir, src, dst)
        results.append({"kind": "raw", "chunk_bytes": chunk, "threads": 1, **raw})
        files = {}
        for t in files_threads:
            files[t] = best(files_cell, args.dir, src, dst, t)
            row = {"kind": "files", "chunk_bytes": chunk, "threads": t, **files[t]}
            row.update({f"{m}_ratio": row[m] / raw[m] for m in metrics})
            results.append(row)
            _print_row(row, raw)
        runs = [(t, False) for t in threads]
        if args.o_direct_threads:
            runs.append((args.o_direct_threads, True))
        plain = {}
        for t, direct in runs:
            r = best(tier_cell, args.dir, src, dst, t, o_direct=direct)
            row = {"kind": "tier_o_direct" if direct else "tier", "chunk_bytes": chunk, "threads": t, **r}
            row.update({f"{m}_ratio": r[m] / raw[m] for m in metrics})
            if t in files and not direct:
                row.update({f"{m}_vs_files": r[m] / files[t][m] for m in metrics})
            if not direct:
                plain[t] = r
            results.append(row)
            _print_row(row, raw)
        if args.auth_threads:
            t = args.auth_threads
            if t not in plain:
                plain[t] = best(tier_cell, args.dir, src, dst, t)
                row = {"kind": "tier", "chunk_bytes": chunk, "threads": t, **plain[t]}
                row.update({f"{m}_ratio": plain[t][m] / raw[m] for m in metrics})
                results.append(row)
                _print_row(row, raw)
            for auth in ("mac", "gmac", "aes_gcm"):
                r = best(tier_cell, args.dir, src, dst, t, auth=auth)
                row = {"kind": f"tier_{auth}", "chunk_bytes": chunk, "threads": t, **r}
                row.update({f"{m}_ratio": r[m] / raw[m] for m in metrics})
                row.update({f"{m}_vs_plain": r[m] / plain[t][m] for m in metrics})
                results.append(row)
                _print_row(row, raw)
    elapsed = time.time() - t_start
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    shown_dir = os.path.relpath(args.dir, REPO) if args.dir.startswith(REPO + os.sep) else args.dir
    meta = {"dir": shown_dir, "fstype": fstype, "total_bytes_per_cell": total, "page_cache_dropped": can_drop,
            "repeat_best_of": args.repeat, "create_empty_file_us": round(create_us, 1),
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "elapsed_s": round(elapsed, 1), "units": "bytes/second"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    _summary(results, metrics)
    print(f"\nwrote {args.out} in {elapsed:.0f}s")
    _plot(results, args.out.replace(".json", ".png"), metrics)
    return 0


def _fstype(path: str) -> str:
    best, fs = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, t = line.split()[:3]
            if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                best, fs = mnt, t
    return fs


_HEADER_DONE = [False]


def _print_row(row: dict, raw: dict) -> None:
    if not _HEADER_DONE[0]:
        _HEADER_DONE[0] = True
        print(f"{'kind':<14}{'chunk':>8}{'thr':>4} | {'wr cache':>14} | {'wr durable':>14} | "
              f"{'rd cold':>14} | {'rd warm':>14}   (GB/s tier/raw = ratio)")
    cells = []
    for m in ("write_cached", "write_durable", "read_cold", "read_warm"):
        cells.append(f"{row[m] / 1e9:5.2f}/{raw[m] / 1e9:5.2f}={row[m] / raw[m]:4.2f}")
    print(f"{row['kind']:<14}{_size(row['chunk_bytes']):>8}{row['threads']:>4} | " + " | ".join(cells), flush=True)


def _size(n: int) -> str:
    return f"{n // MIB}M" if n >= MIB else f"{n // 1024}K"


def _summary(results: list[dict], metrics) -> None:
    tier = [r for r in results if r["kind"] == "tier"]
    print("\nbest tier/raw ratio per chunk size (over thread counts):")
    for chunk in sorted({r["chunk_bytes"] for r in tier}):
        rows = [r for r in tier if r["chunk_bytes"] == chunk]
        parts = []
        for m in metrics:
            best = max(rows, key=lambda r: r[f"{m}_ratio"])
            parts.append(f"{m} {best[f'{m}_ratio']:.2f}@{best['threads']}t")
        print(f"  {_size(chunk):>5}: " + ", ".join(parts))
    auth = [r for r in results if "write_cached_vs_plain" in r]
    if auth:
        print("authenticated / plain tier at the same thread count (what the MAC and AES-GCM cost):")
        for r in auth:
            print(f"  {r['kind']:<13} {_size(r['chunk_bytes']):>5} {r['threads']:>2}t: "
                  + ", ".join(f"{m} {r[f'{m}_vs_plain']:.2f}" for m in metrics))
    vs = [r for r in tier if "write_cached_vs_files" in r]
    if vs:
        print("tier / bare one-file-per-chunk syscalls at the same thread count (the tier's own cost):")
        for r in vs:
            print(f"  {_size(r['chunk_bytes']):>5} {r['threads']:>2}t: "
                  + ", ".join(f"{m} {r[f'{m}_vs_files']:.2f}" for m in metrics))


def _plot(results: list[dict], path: str, metrics) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey=True)
    axes = axes.ravel()
    tier = [r for r in results if r["kind"] == "tier"]
    files = [r for r in results if r["kind"] == "files"]
    for ax, m in zip(axes, metrics):
        for n, chunk in enumerate(sorted({r["chunk_bytes"] for r in tier})):
            color = f"C{n}"
            rows = sorted((r for r in tier if r["chunk_bytes"] == chunk), key=lambda r: r["threads"])
            ax.plot([r["threads"] for r in rows], [r[f"{m}_ratio"] for r in rows], marker="o", color=color,
                    label=f"tier {_size(chunk)}")
            fr = [r for r in files if r["chunk_bytes"] == chunk]
            ax.scatter([r["threads"] for r in fr], [r[f"{m}_ratio"] for r in fr], marker="x", color=color, s=60)
        ax.axhline(0.8, color="red", linestyle="--", linewidth=1, label="target 0.8")
        ax.axhline(1.0, color="gray", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_title(m.replace("_", " "))
        ax.set_xlabel("I/O threads")
    for ax in axes[::2]:
        ax.set_ylabel("throughput / raw sequential")
    axes[1].legend(fontsize=8, title="x: bare file-per-chunk", title_fontsize=8)
    fig.suptitle("FileTier throughput relative to raw sequential file I/O")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
