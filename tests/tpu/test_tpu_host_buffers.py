"""Host-memory buffers per host path, after 8, 72 and 1,000 stored chunks (8 emulated CPU devices).

Each pinned host buffer is a kernel memory mapping (``vm.max_map_count``,
65530 by default) and on a TPU host a vfio DMA entry. The ``program`` path's
tier is preallocated slabs: its count does not grow with the chunks stored.
The ``device_put`` path allocates one host array per stored chunk (one
buffer per device): it grows, so registration refuses a tier whose full
count would pass 90% of the limits, naming the sysctl and the settings.
"""

import gc

import jax
import jax.numpy as jnp
import pytest

from test_tpu_roundtrip import make_caches
from tpu_offload.core.config import ConfigError
from tpu_offload.jax_backend import KVLayout, StoreChunk, TransferEngine
from tpu_offload.jax_backend import memory

pytestmark = pytest.mark.jax
HOST_KINDS = ("pinned_host", "unpinned_host")


def host_buffers() -> int:
    """Host-memory buffers alive in this process: one per addressable shard of each host array.
    Collects first: host arrays earlier tests dropped must not leave the count mid-test."""
    gc.collect()
    return sum(len(a.addressable_shards) for a in jax.live_arrays() if a.sharding.memory_kind in HOST_KINDS)


def store_up_to(eng, caches, stored: int, target: int) -> int:
    while stored < target:
        n = min(eng.staging_chunks, target - stored)
        eng.store(caches, [StoreChunk(stored + i, [i]) for i in range(n)]).block_until_ready()
        eng.complete_store(range(stored, stored + n), True)
        stored += n
    return stored


@pytest.mark.parametrize("path", ["program", "device_put"])
def test_host_buffers_after_8_72_1000_chunks(mesh, path):
    caches = make_caches(mesh, jnp.bfloat16, layers=2)
    held = jax.live_arrays()  # earlier tests' arrays stay alive until the end: their release is not our count
    before = host_buffers()
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=1000, blocks_per_chunk=1, staging_blocks=8, path=path)
    devices = mesh.devices.size
    counts, stored = {}, 0
    for target in (8, 72, 1000):
        stored = store_up_to(eng, caches, stored, target)
        counts[target] = host_buffers() - before
    del held
    if path == "program":  # one slab per device, allocated at start, whatever is stored
        assert counts == {8: devices, 72: devices, 1000: devices}
    else:  # one host array per stored chunk, one buffer per device: grows with the chunks
        assert all(counts[n] >= n * devices for n in counts), counts
        assert counts[1000] > counts[72] > counts[8]


def test_device_put_refused_past_the_node_limits(mesh, tmp_path, monkeypatch):
    """The shipped tier (23,040 chunks x 8 devices) against the default vm.max_map_count; 8 emulated
    devices here, so the same arithmetic at a proportionally smaller limit file."""
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    monkeypatch.setattr(memory, "MAP_COUNT_FILE", str(limit))
    monkeypatch.setattr(memory, "DMA_ENTRY_FILE", str(tmp_path / "absent"))
    caches = make_caches(mesh, jnp.bfloat16, layers=1)
    layout = KVLayout.from_caches(caches)
    with pytest.raises(ConfigError) as e:
        TransferEngine(layout, num_slots=23040, blocks_per_chunk=1, staging_blocks=8, path="device_put")
    msg = str(e.value)
    assert "23040 chunks x 8 local devices x 1 groups = 184320 buffers" in msg
    assert "90% of vm.max_map_count = 65530" in msg and "at least 204800" in msg
    assert "transfer_path=program (TPU_OFFLOAD_TRANSFER_PATH" in msg and "at most 7372 chunks" in msg
    TransferEngine(layout, num_slots=7372, blocks_per_chunk=1, staging_blocks=8, path="device_put")
    TransferEngine(layout, num_slots=23040, blocks_per_chunk=1, staging_blocks=8, path="program")  # bounded
    limit.write_text("33554432\n")  # what configs/kustomize/tpu-v7's init container sets
    TransferEngine(layout, num_slots=23040, blocks_per_chunk=1, staging_blocks=8, path="device_put")
    with pytest.raises(ConfigError, match="vfio_iommu_type1 dma_entry_limit = 65535"):
        memory.check_host_buffers(23040, 8, 1, dma_entry_limit=65535)


@pytest.mark.parametrize("fail", ["missing-chunk", "transfer"])
def test_device_put_load_failure_leaves_live_staging(mesh, monkeypatch, fail):
    """A load whose chunk is missing, or whose batched host-to-device transfer raises, fails before
    anything is donated: staging stays live and later stores and loads are bit-exact."""
    import numpy as np

    from test_tpu_roundtrip import bits
    from tpu_offload.jax_backend import LoadChunk
    from tpu_offload.jax_backend import engine as engine_mod

    caches = make_caches(mesh, jnp.float32, layers=2, seed=3)
    ref = [bits(c) for c in caches]
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=1, staging_blocks=4,
                         path="device_put")
    eng.store(caches, [StoreChunk(s, [s]) for s in range(3)]).block_until_ready()
    eng.complete_store(range(3), True)
    if fail == "missing-chunk":
        eng.host[1] = None
        match = "host slot 1 holds nothing"
    else:
        real = jax.device_put

        def broken(x, *a, **kw):
            if isinstance(x, list):
                raise RuntimeError("injected transfer failure")
            return real(x, *a, **kw)

        monkeypatch.setattr(engine_mod.jax, "device_put", broken)
        match = "injected transfer failure"
    with pytest.raises(RuntimeError, match=match):
        eng.load(caches, [LoadChunk(s, [20 + s]) for s in range(3)])
    monkeypatch.undo()
    assert not any(st.is_deleted() for st in eng.staging)
    eng.store(caches, [StoreChunk(s, [s]) for s in range(3)]).block_until_ready()
    eng.complete_store(range(3), True)
    caches, done = eng.load(caches, [LoadChunk(s, [20 + s]) for s in range(3)])
    done.block_until_ready()
    got = [bits(c) for c in caches]
    for layer in range(2):
        for s in range(3):
            assert np.array_equal(got[layer][20 + s], ref[layer][s])


def test_device_put_path_one_program_and_one_transfer_per_pass(mesh, monkeypatch):
    """Per pass, in each direction: one call of the chunk program and one batched device_put, whatever
    the chunks (3 chunks in a 4-chunk staging buffer here)."""
    from tpu_offload.jax_backend import LoadChunk
    from tpu_offload.jax_backend import engine as engine_mod

    caches = make_caches(mesh, jnp.bfloat16, layers=2)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=8, blocks_per_chunk=1, staging_blocks=4,
                         path="device_put")
    eng.precompile()
    calls = {"device_put": 0, "take_chunks": 0, "put_chunks": 0}
    real_put = jax.device_put

    def counting_put(*a, **kw):
        calls["device_put"] += 1
        return real_put(*a, **kw)

    monkeypatch.setattr(engine_mod.jax, "device_put", counting_put)
    for key in (("take_chunks",), ("put_chunks", 0)):
        prog = eng.programs._cache[key]
        eng.programs._cache[key] = lambda *a, prog=prog, name=key[0]: (calls.__setitem__(name, calls[name] + 1),
                                                                       prog(*a))[1]
    eng.store(caches, [StoreChunk(s, [s]) for s in range(3)]).block_until_ready()
    assert calls == {"device_put": 1, "take_chunks": 1, "put_chunks": 0}
    eng.complete_store(range(3), True)
    caches, done = eng.load(caches, [LoadChunk(s, [20 + s]) for s in range(3)])
    done.block_until_ready()
    assert calls == {"device_put": 2, "take_chunks": 1, "put_chunks": 1}
