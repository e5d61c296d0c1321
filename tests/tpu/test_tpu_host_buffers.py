"""Host memory is allocated once on the path ``auto`` picks on TPU (program): storing more chunks adds no
host arrays and no host bytes, after 8, 72 and 1,000 chunks (the device_put path, opt-in, adds one host
array per stored chunk and device; the same count shows it)."""

import gc
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from test_tpu_roundtrip import NB, bits, make_caches
from tpu_offload.connector.worker import transfer_path
from tpu_offload.core.config import OffloadConfig
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine

pytestmark = pytest.mark.jax
HOST_KINDS = ("pinned_host", "unpinned_host")


def host_arrays() -> tuple[int, int]:
    """(live arrays in host memory, their bytes), over every device's shards."""
    gc.collect()  # arrays earlier tests dropped are not this engine's
    live = [a for a in jax.live_arrays() if getattr(a.sharding, "memory_kind", None) in HOST_KINDS]
    return len(live), sum(s.data.nbytes for a in live for s in a.addressable_shards)


def store_chunks(eng, caches, first: int, n: int) -> None:
    chunks = [StoreChunk(s, [s % NB]) for s in range(first, first + n)]
    eng.store(caches, chunks).block_until_ready()
    eng.complete_store([c.slot for c in chunks], True)


@pytest.mark.parametrize("path", ["auto", "device_put"])
def test_host_buffers_do_not_grow_with_chunks_stored(path):
    mesh = make_mesh("auto", (1, 8))
    caches = make_caches(mesh, jnp.bfloat16, seed=3, layers=2)
    tpu = [types.SimpleNamespace(platform="tpu")]
    picked = transfer_path(OffloadConfig(transfer_path=path), tpu)  # what registration picks on a TPU
    assert picked == ("program" if path == "auto" else "device_put")
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=1000, blocks_per_chunk=1, staging_blocks=64,
                         path=picked)
    before = host_arrays()
    counts, done = [], 0
    for target in (8, 72, 1000):
        store_chunks(eng, caches, done, target - done)
        done = target
        counts.append(host_arrays())
    if picked == "program":  # the slabs, made at construction: no array and no byte more, ever
        assert counts == [before] * 3, (before, counts)
        assert before[0] <= 8 * 1 and before[1] == 1000 * eng.layout.block_bytes  # 1 slab x 8 device shards
    else:  # one host array per stored chunk: what the opt-in path costs
        grew = [c[0] - before[0] for c in counts]
        assert all(g >= n for g, n in zip(grew, (8, 72, 1000))) and grew == sorted(grew), counts
    # and the tier still holds what was stored (the load donates the caches: compare with a copy)
    want = bits(caches[0])[999 % NB].copy()
    got, done_ = eng.load(caches, [LoadChunk(999, [5])])
    done_.block_until_ready()
    assert np.array_equal(bits(got[0])[5], want)
