"""MLA's latent cache: stored once, sharded over the devices that each hold a whole copy.

tpu-inference keeps DeepSeek's latent cache ``(blocks, bs / 32, 32, lora + rope)``
replicated on every device of the model axis (``P(BATCH, KV_CONTEXT)``).
Each device keeps a 1/TP slice of every block in staging and in the host
tier; a load reassembles the whole block on every device, so the copies stay
identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.layout import KVLayout

LAYERS, BLOCKS, LATENT = 3, 24, 256  # latent: kv_lora_rank + rope, padded to 128 lanes


def latent_caches(mesh, rows=1, dtype=jnp.bfloat16, seed=0):
    """tpu-inference's MLA cache (32-token packing) for 32 * ``rows``-token pages, replicated over "model"."""
    rng = np.random.default_rng(seed)
    sh = NamedSharding(mesh, P("data", None))
    return [jax.device_put(rng.standard_normal((BLOCKS, rows, 32, LATENT)).astype(dtype), sh) for _ in range(LAYERS)]


def host_bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("path", ["program", "device_put"])
@pytest.mark.parametrize("rows", [1, 8], ids=["page32", "page256"])
def test_latent_cache_is_stored_once_and_restored_on_every_copy(mesh, path, rows):
    caches = latent_caches(mesh, rows)
    tp = mesh.shape["model"]
    layout = KVLayout.from_caches(caches)
    (g,) = layout.groups
    assert g.replicas == tp and g.replica_axes == ("model",)
    assert g.split_dim == (0 if rows % tp == 0 else 1)  # the first block dimension that divides
    one_copy = rows * 32 * LATENT * 2 * LAYERS
    assert layout.block_bytes == one_copy  # not tp copies
    assert layout.device_block_bytes() == one_copy // tp
    eng = TransferEngine(layout, num_slots=6, blocks_per_chunk=2, staging_blocks=4, path=path)
    ref = [host_bits(c) for c in caches]
    eng.store(caches, [StoreChunk(1, [3, 7]), StoreChunk(4, [0, 11]), StoreChunk(0, [5, 6])]).block_until_ready()
    eng.complete_store([1, 4, 0], True)
    caches, done = eng.load(caches, [LoadChunk(4, [20, 21]), LoadChunk(1, [-1, 22]), LoadChunk(0, [23, 19])])
    done.block_until_ready()
    got = [host_bits(c) for c in caches]
    for layer in range(LAYERS):
        for dst, src in ((20, 0), (21, 11), (22, 7), (23, 5), (19, 6)):
            assert np.array_equal(got[layer][dst], ref[layer][src]), (layer, dst)
        assert np.array_equal(got[layer][:19], ref[layer][:19])
    for c in caches:  # every device's copy is the whole, same latent cache
        shards = [np.asarray(s.data).view(np.uint16) for s in c.addressable_shards]
        assert len(shards) == tp and all(np.array_equal(s, shards[0]) for s in shards)
        assert c.sharding.spec == P("data", None)


def test_host_slab_holds_each_devices_slice_once(mesh):
    caches = latent_caches(mesh, 1)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=4, blocks_per_chunk=1, staging_blocks=2)
    (slab,) = eng.slabs[0]
    tp = mesh.shape["model"]
    assert slab.shape == (4, 1, LAYERS, 1, 32, LATENT)  # rows, bpc, layers, the block
    local = {tuple(s.data.shape) for s in slab.addressable_shards}
    assert local == {(4, 1, LAYERS, 1, 32 // tp, LATENT)}  # a 1/tp slice per device, no copies
