"""The engine's direct host path on CPU, through the kernel's XLA stand-in (direct_dma.stand_in_call).

The kernel itself runs on TPU only (interpret mode cannot run its ref bitcast); its compiled form is checked
by tests/tpu_compiler/test_direct_kernel.py. Here the engine's bookkeeping around it is: slots to slab rows,
runs, calls per slab, several blocks per chunk, the start-up round trip and its verdict, and that nothing
picks the path off TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from tpu_offload.connector import registration
from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine, direct_dma

NB, LAYERS = 40, 3

pytestmark = pytest.mark.jax


def make_caches(seed=0, bs=64, dim=64):
    """Per device one head: a block's piece is bs x dim bf16 (64 x 64: 8 KiB, two 4 KiB tiles)."""
    sh = NamedSharding(make_mesh(), P(None, None, "model", None))
    keys = jax.random.split(jax.random.key(seed), LAYERS)
    return [jax.device_put(jax.random.normal(k, (NB, bs, 8, dim)).astype(jnp.bfloat16), sh) for k in keys]


def bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the direct path be built on CPU (it runs the stand-in there)."""
    real = direct_dma.supported
    monkeypatch.setattr(direct_dma, "supported", lambda layout, platform=None: real(layout, platform="tpu"))


def engine(caches, bpc=1, slots=16, max_slab_bytes=None):
    kw = {} if max_slab_bytes is None else {"max_slab_bytes": max_slab_bytes}
    return TransferEngine(KVLayout.from_caches(caches), num_slots=slots, blocks_per_chunk=bpc, staging_blocks=8,
                          path="direct", **kw)


@pytest.mark.parametrize("bpc", [1, 2])
def test_store_then_load_elsewhere_is_bit_exact(on_cpu, bpc):
    """Chunks stored from scattered and adjacent blocks into shuffled slots across several slabs (more than a
    call's capacity), loaded back into other blocks: every byte where it belongs, one call per (group, slab)."""
    caches = make_caches()
    ref = [bits(c) for c in caches]
    per_chunk = (64 * 8 * 64 * 2) * LAYERS * bpc  # a block of every layer, all 8 heads, x bpc
    eng = engine(caches, bpc=bpc, max_slab_bytes=5 * per_chunk)  # slabs of 5 chunks: a pass spans several
    assert eng.path == "direct" and len(eng.programs.slab_rows) > 2 and eng.slabs[0][0].dtype == jnp.uint8
    n = 9 if bpc == 1 else 5
    src = [[1 + i * bpc + j for j in range(bpc)] for i in range(n)]  # adjacent blocks...
    src[3] = [30 + j for j in range(bpc)]  # ...and one far away
    slots = np.random.default_rng(1).permutation(16)[:n]
    eng.store(caches, [StoreChunk(int(s), b) for s, b in zip(slots, src)]).block_until_ready()
    eng.complete_store(slots, True)
    assert eng.last_dmas["store"] >= LAYERS
    out = [jnp.zeros_like(c) for c in caches]
    dst = [[NB - 1 - i * bpc - j for j in range(bpc)] for i in range(n)]
    out, done = eng.load(out, [LoadChunk(int(s), d) for s, d in zip(slots, dst)])
    done.block_until_ready()
    for r, o in zip(ref, out):
        got = bits(o)
        for s, d in zip(src, dst):
            assert np.array_equal(got[d], r[s])


def test_start_up_round_trip_passes_and_leaves_no_valid_slot(on_cpu):
    caches = make_caches()
    eng = engine(caches)
    new, why = eng.check_direct(caches)
    assert why is None and not eng.valid.any() and len(new) == LAYERS
    assert all(not v.any() for s in range(16) for v in eng.row_views(s))  # the rows it used are zeroed again


def test_start_up_round_trip_sees_a_wrong_byte(on_cpu, monkeypatch):
    """A view that moved one byte wrong (here: the load flips a byte of the first layer) is reported."""
    caches = make_caches()
    eng = engine(caches)
    real = eng.direct.load

    def flipping(gi, rows=None):
        prog = real(gi, rows)

        def run(caches, slab, *ops):
            out = list(prog(caches, slab, *ops))
            out[0] = out[0].at[1, 0, 0, 0].set(out[0][1, 0, 0, 0] + 1)
            return tuple(out)

        return run

    monkeypatch.setattr(eng.direct, "load", flipping)
    _, why = eng.check_direct(caches)
    assert why is not None and "came back different" in why


def test_nothing_picks_it_off_tpu():
    """auto on CPU (and GPU) keeps the staging path, and an explicit direct there is refused with the reason."""
    caches = make_caches()
    layout = KVLayout.from_caches(caches)
    assert "TPU only" in direct_dma.supported(layout)
    assert registration.pick_path("program", OffloadConfig(), layout) == "program"
    with pytest.raises(ConfigError, match="TPU only"):
        registration.pick_path("direct", OffloadConfig(transfer_path="direct"), layout)
    with pytest.raises(ValueError, match="TPU only"):
        engine(caches)


def test_auto_picks_it_on_tpu_where_it_can(on_cpu):
    layout = KVLayout.from_caches(make_caches())
    assert registration.pick_path("program", OffloadConfig(), layout, platform="tpu") == "direct"
    # where the bytes outlive the process (snapshots, shared files), auto keeps the staging path's layout
    assert registration.pick_path("program", OffloadConfig(snapshot_path="/s"), layout, platform="tpu") == "program"
    assert registration.pick_path("program", OffloadConfig(transfer_path="program"), layout, platform="tpu") == "program"
    small = KVLayout.from_caches(make_caches(bs=16, dim=32))  # 1 KiB pieces: not whole tiles
    assert registration.pick_path("program", OffloadConfig(), small, platform="tpu") == "program"


def test_a_failed_round_trip_falls_back_loudly(on_cpu, caplog):
    """The registration hook: a direct engine whose round trip differs is released and the staging path's
    engine built instead, with an error in the log; a passing one is kept."""
    caches = make_caches()
    runner = type("R", (), {"kv_caches": caches})()
    eng = engine(caches)
    assert registration.start_up_round_trip(eng, runner, lambda: pytest.fail("rebuilt")) is eng
    bad = engine(runner.kv_caches)
    bad.check_direct = lambda kv: (kv, "the direct kernel's round trip came back different in slot(s) [8]")
    fallback = object()
    assert registration.start_up_round_trip(bad, runner, lambda: fallback) is fallback
    assert bad.slabs is None and bad.staging is None  # the tier freed before another is allocated
    assert any(r.levelname == "ERROR" and "falling back to the staging path" in r.message for r in caplog.records)
