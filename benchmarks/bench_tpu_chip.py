"""What a first TPU chip must confirm about the direct host kernel (jax_backend/direct_dma.py).

The TPU compiler (tests/tpu_compiler) shows the kernel compiles, takes no HBM scratch and moves each byte
once; only a chip shows that its bytes come back right and how fast they move. On every local TPU device at
once (a Qwen3-32B-like cache at TP = the device count: one 4 MiB piece per device and block, 64 layers):

1. bit-exact round trips through the kernel's u8 view: n scattered blocks stored into shuffled slots, loaded
   into other blocks of a zeroed cache, compared on the device (n = 1, 16, 1,000), and the engine's own
   start-up round trip (``check_direct``);
2. GB/s per call, store and load, at 16 MiB, 64 MiB and one step budget per device (the link per chip x the
   accepted stall, shared by its devices: connector/budget.py), blocks adjacent (one DMA per layer) and
   scattered (one per block and layer);
3. the wall time of allocating a large host tier in the kernel's u8 slabs (``--tier-gib``, default 720 or
   what the host can spare).

Exits 3 with "needs a TPU" anywhere else. Prints a table, writes results/tpu_chip.json.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

NEEDS_TPU = 3


def _no_tpu(why: str) -> None:
    print(f"bench_tpu_chip: needs a TPU ({why}); run it on a TPU VM with jax[tpu]", file=sys.stderr)
    sys.exit(NEEDS_TPU)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1100, help="cache blocks per layer (4 MiB per device each)")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tier-gib", type=float, default=720.0, help="host tier to allocate (capped by free RAM)")
    ap.add_argument("--stall-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth-gbps", type=float, default=38.0)
    args = ap.parse_args(argv)

    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) and os.environ.get("JAX_PLATFORMS") != "tpu":
        _no_tpu("no /dev/accel* or /dev/vfio device on this host")
    import jax

    try:
        devices = jax.devices("tpu")
    except RuntimeError as e:
        _no_tpu(f"JAX finds no TPU backend: {str(e).splitlines()[0]}")

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine, print_table, write_json
    from tpu_offload.connector.budget import step_bytes
    from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine, direct_dma
    from tpu_offload.jax_backend.memory import read_host_memory

    n_dev = len(devices)
    mesh = Mesh(np.array(devices), ("model",))
    sh = NamedSharding(mesh, P(None, None, "model"))
    shape = (args.blocks, 128, n_dev, 2, 128)  # per device and layer: (128, 1, 2, 128) bf16, 64 KiB

    def random_caches(seed):
        keys = jax.random.split(jax.random.key(seed), args.layers)
        make = jax.jit(lambda k: jax.random.bits(k, shape, jnp.uint16).view(jnp.bfloat16),
                       out_shardings=sh)
        return [make(k) for k in keys]

    def zeros():
        return [jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=sh)() for _ in range(args.layers)]

    caches = random_caches(0)
    layout = KVLayout.from_caches(caches, mesh)
    reason = direct_dma.supported(layout)
    if reason is not None:
        print(f"bench_tpu_chip: the direct path cannot serve this cache: {reason}", file=sys.stderr)
        return 1
    piece = layout.device_block_bytes()  # 4 MiB per device and block
    slots = args.blocks
    eng = TransferEngine(layout, num_slots=slots, blocks_per_chunk=1, staging_blocks=1000, path="direct")
    t0 = time.perf_counter()
    eng.precompile()
    compile_s = time.perf_counter() - t0
    rows, failed = [], False

    # 1. bit-exact round trips
    caches, why = eng.check_direct(caches)
    rows.append({"check": "start-up round trip (check_direct)", "blocks": 3, "result": "bit-exact" if why is None else why})
    failed |= why is not None
    same = jax.jit(lambda a, b, i, j: jnp.all(a[i].view(jnp.uint16) == b[j].view(jnp.uint16)))
    rng = np.random.default_rng(1)
    for n in (1, 16, 1000):
        n = min(n, args.blocks - 1)
        src = np.sort(rng.choice(np.arange(1, args.blocks), n, replace=False))
        dst = rng.permutation(np.arange(1, args.blocks))[:n]
        order = rng.permutation(slots)[:n]
        eng.store(caches, [StoreChunk(int(s), [int(b)]) for s, b in zip(order, src)]).block_until_ready()
        eng.complete_store(order, True)
        out, done = eng.load(zeros(), [LoadChunk(int(s), [int(b)]) for s, b in zip(order, dst)])
        done.block_until_ready()
        ok = all(bool(same(c, o, jnp.asarray(src), jnp.asarray(dst))) for c, o in zip(caches, out))
        rows.append({"check": "store, load elsewhere, compare", "blocks": n, "result": "bit-exact" if ok else "DIFFERS"})
        failed |= not ok
        del out

    # 2. GB/s per call
    kind = getattr(devices[0], "device_kind", "")
    budget = step_bytes(args.bandwidth_gbps, args.stall_ms, kind)
    sizes = {"16 MiB": 16 << 20, "64 MiB": 64 << 20, f"step budget ({budget / 2**20:.0f} MiB)": budget}
    timing = []
    for label, per_device in sizes.items():
        n = max(1, min(args.blocks - 1, per_device // piece))
        for pattern in ("adjacent", "scattered"):
            blocks = (np.arange(1, 1 + n) if pattern == "adjacent"
                      else np.sort(rng.choice(np.arange(1, args.blocks), n, replace=False)))
            rows_ = np.arange(n) if pattern == "adjacent" else rng.permutation(slots)[:n]
            stores = [StoreChunk(int(s), [int(b)]) for s, b in zip(rows_, blocks)]
            loads = [LoadChunk(int(s), [int(b)]) for s, b in zip(rows_, blocks)]
            st, ld = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                eng.store(caches, stores).block_until_ready()
                st.append(time.perf_counter() - t)
                t = time.perf_counter()
                caches, done = eng.load(caches, loads)
                done.block_until_ready()
                ld.append(time.perf_counter() - t)
            dmas = {"store": eng.last_dmas["store"], "load": eng.last_dmas["load"]}  # one per (run, layer)
            moved = n * piece
            for direction, ts in (("store", st), ("load", ld)):
                med = float(np.median(ts))
                timing.append({"size": label, "blocks": n, "pattern": pattern, "direction": direction,
                               "dmas": dmas[direction],
                               "ms": round(med * 1e3, 3), "GB/s per device": round(moved / med / 1e9, 2),
                               "GB/s all devices": round(moved * n_dev / med / 1e9, 2)})

    # 3. allocating a large host tier
    eng.release()
    free = read_host_memory().available or 0
    tier = int(min(args.tier_gib * 2**30, 0.8 * free))
    chunk = layout.block_bytes  # all devices of this host
    tier_slots = max(1, tier // chunk)
    big = direct_dma.DirectPrograms(layout, blocks_per_chunk=1, slab_rows=_slab_rows(tier_slots, chunk),
                                    memory_kind="pinned_host", capacity=1000)
    t0 = time.perf_counter()
    slabs = big.alloc_slabs()
    jax.block_until_ready(slabs)
    alloc_s = time.perf_counter() - t0
    del slabs

    print_table(rows, title=f"bench_tpu_chip: round trips through the direct kernel ({n_dev} x {kind})")
    print_table(timing, title="GB/s per call (median of %d)" % args.reps)
    print_table([{"tier GiB": round(tier_slots * chunk / 2**30, 1), "slabs": len(big.slab_rows),
                  "allocate s": round(alloc_s, 2), "compile s": round(compile_s, 2)}], title="host tier")
    write_json("tpu_chip", {"machine": machine(), "devices": n_dev, "device_kind": kind, "round_trips": rows,
                            "calls": timing, "tier_bytes": tier_slots * chunk, "alloc_s": alloc_s,
                            "compile_s": compile_s})
    return 1 if failed else 0


def _slab_rows(slots: int, chunk: int, max_slab: int = 16 << 30) -> tuple[int, ...]:
    per = max(1, max_slab // chunk)
    full, rest = divmod(slots, per)
    return (per,) * full + ((rest,) if rest else ())


if __name__ == "__main__":
    sys.exit(main())
