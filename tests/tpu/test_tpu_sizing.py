"""One chunk size and one slot count for both halves, from vLLM 0.32's own KV-cache configs.

Each case builds the worker's ``KVCacheConfig`` with vLLM's own functions
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``) and the
scheduler's with ``generate_scheduler_kv_cache_config`` (which collapses a
``UniformTypeKVCacheSpecs`` to its first layer's spec), then resolves our
settings from each: the same bytes per chunk (the sum of every layer's
page), the same slot count. Gemma 4's shape (sliding and global layers of
different head sizes, one uniform-type group) is the case that crashed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

from tpu_offload.connector import sizing  # noqa: E402
from tpu_offload.connector.settings import resolve  # noqa: E402
from tpu_offload.core.config import ConfigError  # noqa: E402

BLOCK = 16


def _vllm_config(layout: str, hybrid: bool):
    from vllm.config import VllmConfig

    vc = VllmConfig()
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.block_size = BLOCK
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    return vc


def _full(heads=4, head=128, dtype=torch.float32, window=None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window:
        return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=dtype,
                                 sliding_window=window)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=dtype)


def _mla():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=torch.bfloat16,
                            cache_dtype_str="auto")


CASES = {
    # uniform: one FullAttentionSpec group
    "uniform": (lambda: {f"layer.{i}": _full() for i in range(4)}, False, "FullAttentionSpec"),
    # Gemma 4 on tpu-inference's JAX path: every layer full attention, the global one wider
    "uniform-type": (lambda: {"layer.0": _full(), "layer.1": _full(), "layer.2": _full(head=256),
                              "layer.3": _full(), "layer.4": _full(head=256, heads=2)}, False,
                     "UniformTypeKVCacheSpecs"),
    # gpt-oss on the vLLM-model path: sliding and full groups (vLLM's hybrid manager on)
    "sliding-hybrid": (lambda: {f"layer.{i}": _full(window=32 if i % 2 == 0 else None) for i in range(4)},
                       True, "FullAttentionSpec,SlidingWindowSpec"),
    # the same layers with the hybrid manager off: sliding merged into full attention
    "sliding-merged": (lambda: {f"layer.{i}": _full(window=32 if i % 2 == 0 else None) for i in range(4)},
                       False, "FullAttentionSpec"),
    # DeepSeek-style latent cache
    "mla": (lambda: {f"layer.{i}": _mla() for i in range(3)}, False, "MLAAttentionSpec"),
}


def _configs(case: str, layout: str):
    from vllm.v1.core import kv_cache_utils as u

    make, hybrid, kinds = CASES[case]
    vc = _vllm_config(layout, hybrid)
    specs = make()
    groups = u.get_kv_cache_groups(vc, specs)
    assert ",".join(sorted(type(g.kv_cache_spec).__name__ for g in groups)) == kinds
    worker = u.get_kv_cache_config_from_groups(vc, groups, 64 << 20)
    worker.kv_cache_layout = layout  # as the engine core records it for both halves
    scheduler = u.generate_scheduler_kv_cache_config([worker])
    want = sum(s.page_size_bytes for s in specs.values())  # every layer's page, once
    return vc, worker, scheduler, want


def _settings_config(vc, extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1),
        cache_config=vc.cache_config,
    )


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_both_halves_count_the_same_bytes_and_slots(case, layout):
    vc, worker, scheduler, want = _configs(case, layout)
    assert sizing.block_bytes(worker, vc) == want
    assert sizing.block_bytes(scheduler, vc) == want
    cfg = _settings_config(vc, {"cpu_bytes": "3MiB", "blocks_per_chunk": 2, "staging_blocks": 8})
    sw, ss = resolve(cfg, worker, env={}), resolve(cfg, scheduler, env={})
    assert sw.chunk_bytes == ss.chunk_bytes == 2 * want
    assert sw.num_slots == ss.num_slots == (3 << 20) // (2 * want)


def test_gemma4_uniform_type_page_is_not_multiplied_by_its_layers():
    """The crash: ``UniformTypeKVCacheSpecs.page_size_bytes`` already sums every layer."""
    vc, worker, scheduler, want = _configs("uniform-type", "LBNHC")
    (group,) = worker.kv_cache_groups
    assert group.kv_cache_spec.page_size_bytes == want
    (collapsed,) = scheduler.kv_cache_groups
    assert collapsed.kv_cache_spec.page_size_bytes * len(collapsed.layer_names) != want  # what the scheduler had
    assert sizing.check_views(worker, vc) == want


def test_a_scheduler_view_that_cannot_be_read_is_a_start_up_error_naming_both_figures():
    """Without tensors to read the collapsed group's other pages from, the halves would disagree:
    the worker refuses to start, naming both figures."""
    vc, worker, _, want = _configs("uniform-type", "LBNHC")
    worker.kv_cache_tensors = []
    wrong = sizing.block_bytes(sizing.scheduler_view(worker), vc)
    with pytest.raises(ConfigError, match=rf"gives {want} bytes per block.*scheduler's view of it {wrong}"):
        sizing.check_views(worker, vc)


def test_caches_that_hold_another_size_are_a_start_up_error_naming_both_figures():
    s = SimpleNamespace(chunk_bytes=229376, blocks_per_chunk=1, num_slots=146)
    sizing.check_chunk_bytes(s, 229376)
    with pytest.raises(ConfigError, match=r"gives 229376 bytes per chunk.*146 host slots.*caches hold 1146880"):
        sizing.check_chunk_bytes(s, 1146880)
