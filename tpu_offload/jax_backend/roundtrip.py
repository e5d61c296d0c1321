"""Real bytes through the real ``TransferEngine``, device -> host -> device, for the self-check.

The caches are filled with random bits (every bit pattern but NaNs), stored
into shuffled host slots, loaded back into other blocks of a zeroed cache and
compared bit for bit: a wrong slot, block, shard, replica or byte shows. The
same bytes are then moved by a raw ``jax.device_put`` to the host memory kind
and back, so our GB/s can be read against what the runtime itself does.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.layout import KVLayout


def random_caches(avals: Sequence, replicas: int, seed: int = 0) -> list[np.ndarray]:
    """Random bits shaped like ``avals``; with repeated KV heads, the shards of one head are
    identical, as tpu-inference's repeated heads are (the engine stores each head once).

    NaNs become 0: XLA:CPU's ``ppermute`` (the scatter's rebuild of repeated heads) canonicalizes
    bf16 NaN payloads (0x7fbf -> 0x7fc0), and no KV cache depends on a NaN's payload."""
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        dtype = np.dtype(a.dtype)
        bits = rng.integers(0, 256, size=int(np.prod(a.shape)) * dtype.itemsize, dtype=np.uint8)
        x = bits.view(dtype).reshape(a.shape)
        try:
            with np.errstate(invalid="ignore"):
                x[np.isnan(x)] = 0
        except TypeError:  # an integer cache (quantized): every pattern is a value
            pass
        if replicas > 1:
            axis, parts = _head_axis(a)
            pieces = np.split(x, parts, axis=axis)
            x = np.concatenate([pieces[j - j % replicas] for j in range(parts)], axis=axis)
        out.append(np.ascontiguousarray(x))
    return out


def _head_axis(aval) -> tuple[int, int]:
    """(the cache dim sharded over the model axis, its shard count)."""
    mesh, spec = aval.sharding.mesh, tuple(aval.sharding.spec)
    for i, e in enumerate(spec):
        axes = (e,) if isinstance(e, str) else tuple(e or ())
        if "model" in axes:
            return i, int(np.prod([mesh.shape[n] for n in axes]))
    return 0, 1


def _zeros(aval):
    return jax.jit(lambda: jnp.zeros(aval.shape, aval.dtype), out_shardings=aval.sharding)()


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def round_trip(avals: Sequence, mesh, *, replicas: int, blocks_per_chunk: int, staging_blocks: int,
               memory_kind: str, path: str | None = None, reps: int = 3, seed: int = 0,
               kernel: str | None = None) -> dict:
    """Store every whole chunk of ``avals``' caches, load it back elsewhere, compare, time both.

    Returns the figures (bytes, seconds, GB/s, ours and raw) and ``mismatches``: the layers
    whose loaded blocks differ from the stored ones in any bit (empty: bit exact). ``path``: the
    engine's host path (None: its default)."""
    host = random_caches(avals, replicas, seed)
    caches = [jax.device_put(x.copy(), a.sharding) for x, a in zip(host, avals)]  # a copy: CPU may alias
    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    bpc = blocks_per_chunk
    n = layout.num_blocks // bpc
    if n < 1:
        raise ValueError(f"{layout.num_blocks} blocks cannot hold one chunk of {bpc} blocks")
    staging = max(bpc, min(staging_blocks, n * bpc) // bpc * bpc)
    engine = TransferEngine(layout, num_slots=n, blocks_per_chunk=bpc, staging_blocks=staging,
                            memory_kind=memory_kind, kernel=kernel, **({} if path is None else {"path": path}))
    t0 = time.perf_counter()
    engine.precompile()
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed + 1)
    slots = rng.permutation(n)
    src = [list(range(i * bpc, (i + 1) * bpc)) for i in range(n)]
    dst = src[::-1]  # chunk i comes back into the blocks of chunk n-1-i
    stores = [StoreChunk(int(slots[i]), src[i]) for i in range(n)]
    loads = [LoadChunk(int(slots[i]), dst[i]) for i in range(n)]

    def store():
        engine.store(caches, stores).block_until_ready()
        engine.complete_store(slots, True)

    out = [_zeros(a) for a in avals]

    def load():
        nonlocal out
        out, done = engine.load(out, loads)
        done.block_until_ready()

    store()  # warm: first dispatch
    load()
    store_s, load_s = _best(store, reps), _best(load, reps)
    mismatches = []
    for layer, (x, y) in enumerate(zip(host, out)):
        y = np.asarray(y)
        want = np.concatenate([x[src[i]] for i in range(n)]).view(np.uint8)
        got = np.concatenate([y[dst[i]] for i in range(n)]).view(np.uint8)
        if not np.array_equal(want, got):
            mismatches.append(layer)

    # The same bytes, raw: the runtime's own device -> host memory kind -> device copies.
    host_sh = [c.sharding.with_memory_kind(memory_kind) for c in caches]
    dev_sh = [c.sharding for c in caches]
    parked = jax.block_until_ready(jax.device_put(caches, host_sh))
    jax.block_until_ready(jax.device_put(parked, dev_sh))

    def raw_d2h():
        nonlocal parked
        parked = jax.block_until_ready(jax.device_put(caches, host_sh))

    raw_d2h_s = _best(raw_d2h, reps)
    raw_h2d_s = _best(lambda: jax.block_until_ready(jax.device_put(parked, dev_sh)), reps)

    moved = n * bpc * layout.block_bytes  # distinct bytes (each repeated head once)
    raw = sum(int(c.nbytes) for c in caches)
    gbps = lambda b, s: round(b / s / 1e9, 3) if s > 0 else None  # noqa: E731
    return {
        "devices": len(mesh.devices.flat), "layers": len(avals), "blocks": layout.num_blocks,
        "chunks": n, "staging_blocks": staging, "replicas": replicas, "memory_kind": memory_kind,
        "path": engine.path, "kernel": engine.programs.kernel, "in_flight_device_bytes": engine.in_flight_device_bytes,
        "bytes": moved, "raw_bytes": raw, "compile_s": round(compile_s, 3), "mismatches": mismatches,
        "store_s": store_s, "load_s": load_s, "raw_d2h_s": raw_d2h_s, "raw_h2d_s": raw_h2d_s,
        "store_gbps": gbps(moved, store_s), "load_gbps": gbps(moved, load_s),
        "raw_d2h_gbps": gbps(raw, raw_d2h_s), "raw_h2d_gbps": gbps(raw, raw_h2d_s),
    }
