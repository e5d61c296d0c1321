"""Our file tier beside vLLM's own ``fs`` tier, both as secondary tiers of vLLM's ``TieringOffloadingSpec``.

Each tier runs alone under the same spec (vLLM 0.32's CPU primary tier,
one block per chunk) and the same jobs, driven through vLLM's
scheduler-side ``TieringOffloadingManager`` (``gpu_offload.testing.tiering``
plays the worker: vLLM's own GPU<->primary copies need CUDA). Ours runs
with a secret, as shipped (every file signed, names keyed), and 4 I/O
threads (8 is the default; on 2 cores fewer threads write small chunks
faster); vLLM's with 4 read + 4 write threads. Both use O_DIRECT where vLLM's probe
says the directory takes it (``o_direct`` in the JSON).

* throughput: one engine stores N chunks (cascade primary -> tier, until
  every store job finished); a second engine with an empty primary tier
  loads them all (lookup, promotion, until every chunk is a HIT): MB/s of
  KV, median of ``--repeats``, at 2 MiB and 64 KiB chunks;
* budget: a working set of W chunks, a byte budget of 0.5 x W (ours:
  ``fs_capacity_bytes``; vLLM's tier has none): a second engine's hit rate,
  and the bytes left on disk against that budget;
* second engine: the share of the first engine's chunks a second engine
  (own primary tier, same directory) loads with the right bytes;
* attacks, each on a fresh directory, as another tenant who can write it:
  a forged file (well-formed for that tier, attacker's KV) and a junk file
  (random bytes of the right size) at a chunk's name, then a second engine
  loads the chunk: ``served`` means it got the attacker's bytes; a full
  disk (each tier alone on an 8 MiB tmpfs, asked to store 12 MiB; ours with
  a 4 MiB budget): bytes left free; a chmod 0777 of the tier's directory
  before a restart: the mode after it.

Output: a table on stdout and ``benchmarks/results/vllm_tiers.json``.
Run: ``python benchmarks/bench_vllm_tiers.py [--dir PATH] [--repeats 3]`` (as root for the tmpfs).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table, write_json  # noqa: E402

from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct  # noqa: E402

from gpu_offload.testing.tiering import Engine, new_keys, tiering_spec  # noqa: E402
from tpu_offload.core.fs.auth import make_secret_file  # noqa: E402
from tpu_offload.core.fs.format import HEADER_SIZE  # noqa: E402

MIB = 1 << 20
TIERS = ("ours", "vllm_fs")


class Bench:
    def __init__(self, base: str):
        self.base = base
        self.secret = os.path.join(base, "secret")
        make_secret_file(self.secret)
        self.o_direct = probe_o_direct(base)
        self._n = 0

    def fresh(self, under: str | None = None) -> str:
        self._n += 1
        d = os.path.join(under or self.base, f"d{self._n}")
        os.makedirs(d)
        return d

    def entry(self, which: str, root: str, **kw) -> dict:
        if which == "ours":
            return {"type": "SharedFileTier", "module_path": "gpu_offload.vllm.secondary_tier",
                    "shared_storage_path": os.path.join(root, "kv"), "fs_secret_file": kw.pop("secret", self.secret),
                    "fs_threads": 4, "fs_o_direct": self.o_direct and kw.pop("o_direct", True), **kw}
        kw.pop("o_direct", None)  # vLLM's tier probes for itself
        return {"type": "fs", "root_dir": os.path.join(root, "kv"), "n_read_threads": 4, "n_write_threads": 4, **kw}


def engine(entry: dict, chunk: int, n: int) -> Engine:
    return Engine(tiering_spec([entry], bytes_per_block=chunk, cpu_bytes=(n + 8) * chunk))


def payloads(n: int, chunk: int) -> list[np.ndarray]:
    return [np.random.randint(0, 256, chunk, dtype=np.uint8) for _ in range(n)]


def path_of(e: Engine, key: bytes) -> str:
    tier = e.secondary[0]
    return tier.tier.path_of(key) if hasattr(tier, "tier") else tier.file_mapper.get_file_name(key)


def disk_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def hits(got: dict, keys, data) -> int:
    return sum(1 for k, v in zip(keys, data) if got[k] is not None and bool((got[k] == v).all()))


# ---- scenarios ------------------------------------------------------------
def throughput(b: Bench, which: str, chunk: int, n: int, repeats: int) -> dict:
    st, ld, ok = [], [], []
    for _ in range(repeats):
        root = b.fresh()
        keys, data = new_keys(n), payloads(n, chunk)
        a = engine(b.entry(which, root), chunk, n)
        t0 = time.perf_counter()
        a.store(keys, data)
        st.append(time.perf_counter() - t0)
        r = engine(b.entry(which, root), chunk, n)
        t0 = time.perf_counter()
        got = r.load(keys)
        ld.append(time.perf_counter() - t0)
        ok.append(hits(got, keys, data) / n)
        a.close()
        r.close()
        shutil.rmtree(root)
    mb = n * chunk / 1e6
    return {"tier": which, "chunk_kib": chunk >> 10, "chunks": n, "store_MBps": mb / statistics.median(st),
            "load_MBps": mb / statistics.median(ld), "second_engine_hit": min(ok)}


def budget(b: Bench, which: str, chunk: int, n: int) -> dict:
    root = b.fresh()
    cap = n // 2 * (HEADER_SIZE + chunk)
    extra = {"fs_capacity_bytes": cap} if which == "ours" else {}
    keys, data = new_keys(n), payloads(n, chunk)
    a = engine(b.entry(which, root, **extra), chunk, n)
    for i in range(0, n, 8):  # requests of 8 chunks
        a.store(keys[i:i + 8], data[i:i + 8])
    if which == "ours":
        a.secondary[0].tier.flush()
    r = engine(b.entry(which, root, **extra), chunk, n)
    h = hits(r.load(keys), keys, data)
    used = disk_bytes(os.path.join(root, "kv"))
    a.close()
    r.close()
    shutil.rmtree(root)
    return {"tier": which, "working_set_chunks": n, "budget_bytes": cap, "hit_rate": h / n,
            "disk_bytes": used, "disk_over_budget": used / cap}


def forged_and_junk(b: Bench, which: str, chunk: int) -> dict:
    root = b.fresh()
    keys, data = new_keys(2), payloads(2, chunk)
    a = engine(b.entry(which, root), chunk, 2)
    a.store(keys, data)
    evil = payloads(2, chunk)
    if which == "ours":  # the strongest forger without the secret: a well-formed file signed with its own key
        other = os.path.join(root, "other-secret")
        make_secret_file(other)
        f = engine(b.entry(which, b.fresh(root), secret=other), chunk, 1)
        f.store(keys[:1], evil[:1])
        forged = open(path_of(f, keys[0]), "rb").read()
        f.close()
        file_bytes = HEADER_SIZE + chunk
    else:  # vLLM's files are the raw rows
        forged = evil[0].tobytes()
        file_bytes = chunk
    with open(path_of(a, keys[0]), "wb") as fh:
        fh.write(forged)
    junk = os.urandom(file_bytes)
    with open(path_of(a, keys[1]), "wb") as fh:
        fh.write(junk)
    r = engine(b.entry(which, root), chunk, 2)
    got = r.load(keys)
    a.close()
    r.close()
    shutil.rmtree(root)

    def verdict(v, bad: np.ndarray, good: np.ndarray) -> str:
        if v is None:
            return "miss"
        if (v == bad).all():
            return "SERVED"
        return "right bytes" if (v == good).all() else "SERVED (wrong bytes)"

    junk_row = np.frombuffer(junk[-chunk:], dtype=np.uint8) if which == "ours" else np.frombuffer(junk, np.uint8)
    return {"forged_file": verdict(got[keys[0]], evil[0], data[0]),
            "junk_file": verdict(got[keys[1]], junk_row, data[1])}


def full_disk(b: Bench, which: str, chunk: int, n: int) -> dict:
    mnt = b.fresh()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return {"full_disk": f"skipped: cannot mount a tmpfs ({getattr(e, 'stderr', b'') or e})"}
    try:
        extra = {"fs_capacity_bytes": 4 * MIB} if which == "ours" else {}
        keys, data = new_keys(n), payloads(n, chunk)
        a = engine(b.entry(which, mnt, o_direct=False, **extra), chunk, n)
        for i in range(0, n, 8):
            a.store(keys[i:i + 8], data[i:i + 8])
        if which == "ours":
            a.secondary[0].tier.flush()
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        r = engine(b.entry(which, mnt, o_direct=False, **extra), chunk, n)
        h = hits(r.load(keys), keys, data)
        a.close()
        r.close()
        return {"full_disk": f"{free / MIB:.1f} MiB of 8 free, {h}/{n} chunks load", "disk_free_bytes": free,
                "full_disk_hits": h}
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def chmod_dir(b: Bench, which: str, chunk: int) -> dict:
    root = b.fresh()
    keys, data = new_keys(2), payloads(2, chunk)
    a = engine(b.entry(which, root), chunk, 2)
    a.store(keys, data)
    a.close()
    # Another tenant opens the tier's directories to everyone; the next engine starts on them.
    tier_dir = os.path.dirname(os.path.dirname(os.path.dirname(path_of(a, keys[0]))))
    for d, dirs, _ in os.walk(os.path.join(root, "kv")):
        os.chmod(d, 0o777)
    r = engine(b.entry(which, root), chunk, 2)
    h = hits(r.load(keys), keys, data)
    top = tier_dir if which == "vllm_fs" else r.secondary[0].tier.ns_dir
    mode = os.stat(top).st_mode & 0o777
    r.close()
    shutil.rmtree(root)
    return {"chmod_0777": f"dir {mode:o} after restart, {h}/2 load", "dir_mode_after": f"{mode:o}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the tiers write (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.ERROR)  # the attacks make both tiers log (vLLM's at ERROR); the table says what happened
    base = tempfile.mkdtemp(prefix="bench_vllm_tiers-", dir=args.dir)
    b = Bench(base)
    t_all = time.perf_counter()
    try:
        tput = [throughput(b, w, chunk, n, args.repeats) for chunk, n in ((2 * MIB, 24), (64 << 10, 256))
                for w in TIERS]
        bud = [budget(b, w, 64 << 10, 64) for w in TIERS]
        attacks = []
        for w in TIERS:
            row = {"tier": w, **forged_and_junk(b, w, 64 << 10)}
            row.update(full_disk(b, w, 256 << 10, 48))
            row.update(chmod_dir(b, w, 64 << 10))
            attacks.append(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(tput, title="store/load through TieringOffloadingSpec (second engine loads)")
    print_table(bud, title="byte budget at 0.5x the working set (vLLM's fs tier has none)")
    print_table(attacks, ["tier", "forged_file", "junk_file", "full_disk", "chmod_0777"],
                title="a tenant who can write the directory")
    path = write_json("vllm_tiers", {
        "settings": {"ours": "secret (HMAC-SHA256), fs_threads 4", "vllm_fs": "n_read_threads 4, n_write_threads 4",
                     "o_direct": b.o_direct, "repeats": args.repeats},
        "throughput": tput, "budget": bud, "attacks": attacks,
        "seconds": round(time.perf_counter() - t_all, 1),
    })
    print(f"wrote {path} in {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
