"""The ``xla`` gather/scatter kernel (jax_backend/xla_kernel.py), the GPU default, run on CPU.

Bit-exact against a numpy reference at pass sizes that hit every bucket (and
its padding), scattered and adjacent blocks, several chunks per block group,
TP 1 and 2; the programs are all compiled ahead of time, one per bucket.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from test_tpu_dma_kernel import check
from test_tpu_roundtrip import bits, make_caches
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine, xla_kernel

pytestmark = pytest.mark.jax


def test_buckets_cover_every_pass_size():
    assert xla_kernel.buckets(1) == (1,)
    assert xla_kernel.buckets(64) == (1, 4, 16, 64)
    assert xla_kernel.buckets(40) == (1, 4, 16, 40)
    sizes = xla_kernel.buckets(40)
    assert [xla_kernel.bucket_of(n, sizes) for n in (1, 2, 4, 5, 16, 17, 40)] == [1, 4, 4, 16, 16, 40, 40]
    with pytest.raises(ValueError, match="41 blocks exceeds the staging buffer's 40"):
        xla_kernel.bucket_of(41, sizes)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunks", [1, 3, 10])
def test_round_trip_bit_exact(tp, chunks):
    mesh = make_mesh("auto", (1, tp))
    caches = make_caches(mesh, jnp.float32)  # 40 blocks
    ref = [bits(c) for c in caches]
    layout = KVLayout.from_caches(caches)
    eng = TransferEngine(layout, num_slots=16, blocks_per_chunk=2, staging_blocks=20, kernel="xla")
    assert eng.programs.kernel == "xla"
    eng.precompile()
    compiled = eng.programs.compiles
    rng = np.random.default_rng(chunks)
    perm = rng.permutation(20)  # blocks 0..19 stored, loaded into 20..39
    src = [perm[2 * i:2 * i + 2].tolist() for i in range(chunks)]
    dpos = 20 + rng.permutation(20)
    dst = [dpos[2 * i:2 * i + 2].tolist() for i in range(chunks)]
    dst = [[d[0], -1] if i == 0 else d for i, d in enumerate(dst)]  # a block already computed is skipped
    slots = rng.permutation(16)[:chunks].tolist()
    eng.store(caches, [StoreChunk(s, b) for s, b in zip(slots, src)]).block_until_ready()
    eng.complete_store(slots, True)
    caches, done = eng.load(caches, [LoadChunk(s, b) for s, b in zip(slots, dst)])
    done.block_until_ready()
    check(ref, caches, src, dst)
    assert eng.programs.compiles == compiled, "a pass compiled a program while serving"


def test_programs_scale_with_the_pass():
    """No program holds more scratch than about twice its own bucket's bytes: nothing at staging size
    or cache size. (XLA:CPU's cost model counts a gather's or scatter's whole operand as accessed,
    so bytes accessed say nothing here; the GPU run measures time.)"""
    mesh = make_mesh("auto", (1, 1))
    sh = NamedSharding(mesh, P(None, None, "model", None))
    caches = [jax.device_put(jnp.zeros((300, 16, 4, 32), jnp.float32), sh) for _ in range(2)]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=1, staging_blocks=256,
                         kernel="xla")
    block = sum(g.piece_bytes for g in eng.layout.groups)
    for name in ("gather", "scatter"):
        progs = getattr(eng.programs, name)().programs
        assert sorted(progs) == [1, 4, 16, 64, 256]
        for b, p in progs.items():
            assert p.memory_analysis().temp_size_in_bytes <= 2 * b * block + 4096, (name, b)


def test_default_on_gpu_only_for_whole_blocks():
    from tpu_offload.jax_backend.programs import default_kernel

    assert default_kernel("gpu") == "xla"
    assert default_kernel("cpu") == "loop"
    assert default_kernel("tpu") == "dma"


def test_split_runs_into_power_of_two_pieces():
    sizes = (8, 4, 2, 1)
    # rows 10..20 from staging 0..10 (one run of 11 = 8 + 2 + 1), then row 3 from staging 11 alone
    got = xla_kernel.split_runs(list(range(10, 21)) + [3], list(range(11)) + [11], sizes)
    assert got == [([10], [0]), ([], []), ([18], [8]), ([20, 3], [10, 11])]
    # adjacent in the slab but not in staging: no run
    assert xla_kernel.split_runs([5, 6], [0, 2], sizes) == [([], []), ([], []), ([], []), ([5, 6], [0, 2])]


@pytest.mark.parametrize("adjacent", [True, False])
def test_host_copies_by_runs_bit_exact(adjacent):
    mesh = make_mesh("auto", (1, 2))
    caches = make_caches(mesh, jnp.float32)
    ref = [bits(c) for c in caches]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=24, blocks_per_chunk=1, staging_blocks=16,
                         kernel="xla")
    assert xla_kernel.run_sizes(eng.programs) == (16, 8, 4, 2, 1)
    src = [[b] for b in range(14)]
    dst = [[20 + b] for b in range(14)]
    slots = list(range(5, 19)) if adjacent else np.random.default_rng(1).permutation(24)[:14].tolist()
    eng.store(caches, [StoreChunk(s, b) for s, b in zip(slots, src)]).block_until_ready()
    eng.complete_store(slots, True)
    caches, done = eng.load(caches, [LoadChunk(s, b) for s, b in zip(slots, dst)])
    done.block_until_ready()
    check(ref, caches, src, dst)
    # a second load of part of them, into other blocks
    caches, done = eng.load(caches, [LoadChunk(s, [30 + i]) for i, s in enumerate(slots[3:9])])
    done.block_until_ready()
    got = bits(caches[0])
    assert all(np.array_equal(got[30 + i], ref[0][3 + i]) for i in range(6))
