"""``connector/shapes.py`` (what ``selfcheck --offline`` sizes with, no tpu-inference imported) against
tpu-inference's own KV caches, read by the connector's ``KVLayout``: every model at TP 1 to 8."""

import pytest

from tpu_offload.connector import aot, shapes
from tpu_offload.jax_backend.layout import KVLayout


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(shapes.MODELS))
def test_offline_sizes_match_tpu_inference_caches(name, tp):
    model = shapes.MODELS[name]
    heads, replicas = aot.padded_kv_heads(model, tp)
    mesh = aot.compile_only_mesh("TPU7x:2x2x1", tp)
    caches = aot.kv_cache_avals(mesh, model, 16, 128)
    layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    s = shapes.cache_sizes(model, tp, 128)
    assert s.shape == tuple(caches[0].shape[1:])
    assert (s.block_bytes, s.device_block_bytes, s.replicated_block_bytes) == (
        layout.block_bytes, layout.device_block_bytes(), layout.replicated_block_bytes)
    assert s.kv_replicas == (1 if model.use_mla else replicas)


def test_tp_that_does_not_divide_the_heads_is_refused_as_tpu_inference_would():
    with pytest.raises(ValueError, match="cannot be repeated over TP 6"):
        shapes.cache_sizes(shapes.MODELS["Qwen2.5-7B"], 6, 128)  # fewer heads than TP, not a divisor of it
    with pytest.raises(ValueError, match="cannot be split over TP 3"):
        shapes.cache_sizes(shapes.MODELS["Qwen3-32B"], 3, 128)
