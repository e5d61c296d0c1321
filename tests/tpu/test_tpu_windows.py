"""Sliding-window layers stored and loaded by their window only, under vLLM's real scheduler.

The stand-in runner slides on even layers (as gpt-oss) and checks, every
step, the KV attention would read: all of it for full layers, the window for
sliding ones. So a window-only store or load that left out a block a token
can attend to fails the run, while blocks outside every window may hold
anything.
"""

import pytest

from tpu_standin import prompt
from tpu_offload.core.config import ConfigError

pytestmark = pytest.mark.engine

BS = 16
WINDOW = 20  # tokens: a prefix's last ceil(20 / 16) = 2 blocks


@pytest.fixture(params=["program", "device_put"])
def windowed(harnesses, request):
    def make(mode="auto", prefix_caching=False, **extra):
        return harnesses({"num_cpu_chunks": 64, "staging_blocks": 16, "transfer_path": request.param,
                          "sliding_window": mode, **extra}, window=WINDOW, prefix_caching=prefix_caching, layers=4)

    return make


def stored_bytes(h):
    return h.wrk.totals.get("store_bytes", 0)


def test_window_only_store_and_load_give_the_same_kv(windowed):
    h = windowed()
    assert h.wrk.engine.layout.kv_groups == 2  # full layers and sliding layers move separately
    p = prompt(10 * BS, 3)
    h.add(p, max_tokens=1)
    h.run()
    assert h.wrk.totals["stored_chunks"] == 10
    assert sum(h.sch.tails.held.values()) == 2  # the sliding layers of the last 2 chunks only
    assert h.check_tier() == 10
    per_block_full = h.wrk.engine.layout.groups[0].block_bytes
    per_block_sliding = h.wrk.engine.layout.groups[1].block_bytes
    assert stored_bytes(h) == 10 * per_block_full + 2 * per_block_sliding
    h.add(p + prompt(7, 30), max_tokens=3)  # prefix caching is off: all of it comes from our tier
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 10
    assert h.wrk.totals["load_bytes"] == 10 * per_block_full + 2 * per_block_sliding
    assert h.runner.checked_positions > 0 and not h.runner.failures


def test_a_shorter_shared_prefix_without_its_window_is_a_miss_not_wrong_kv(windowed):
    h = windowed()
    p = prompt(10 * BS, 4)
    h.add(p, max_tokens=1)
    h.run()
    h.add(p[: 5 * BS] + prompt(8, 40), max_tokens=2)  # shares 5 chunks whose window was not stored
    h.run()
    assert h.wrk.totals.get("loaded_chunks", 0) == 0
    assert not h.runner.failures


def test_all_mode_stores_every_block(windowed):
    h = windowed(mode="all")
    assert h.wrk.engine.layout.kv_groups == 1
    p = prompt(10 * BS, 5)
    h.add(p, max_tokens=1)
    h.run()
    assert stored_bytes(h) == 10 * h.wrk.engine.layout.block_bytes
    h.add(p[: 5 * BS] + prompt(9, 40), max_tokens=2)
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 5  # every prefix can hit


def test_prefix_caching_on_moves_every_block_or_refuses_window(windowed):
    """With vLLM's prefix cache on, a window-only load would leave blocks that a shorter prefix
    reuses from HBM without their sliding-window KV: auto moves every block, window refuses."""
    h = windowed(mode="auto", prefix_caching=True)
    assert h.wrk.engine.layout.kv_groups == 1
    with pytest.raises(ConfigError, match=r"sliding_window='window'.*prefix cache"):
        windowed(mode="window", prefix_caching=True)


def test_control_a_window_one_block_short_is_caught(windowed):
    """Control: with one tail block fewer than the window needs, the runner sees stale KV."""
    h = windowed()
    h.sch.tails.blocks = 1
    p = prompt(10 * BS, 6)
    h.add(p, max_tokens=1)
    h.run()
    h.add(prompt(11, 12 * BS), max_tokens=1)  # other KV into the blocks the first request freed
    h.run()
    with pytest.raises(AssertionError, match="wrong KV"):
        h.add(p + prompt(7, 30), max_tokens=3)
        h.run()


def test_a_failed_window_load_recomputes_only_its_request_in_every_layer(windowed):
    """Two requests load in one step; the sliding-window bytes of one request's tail chunk are bad.
    That request is recomputed, and only it, from where its load began: restarting at the bad
    chunk would leave its sliding layers without the window before it (the runner checks)."""
    h = windowed(verify_checksums=True)
    a, b = prompt(6 * BS, 21), prompt(6 * BS, 22)
    h.add(a, max_tokens=1)
    h.add(b, max_tokens=1)
    h.run()
    eng, sch = h.wrk.engine, h.sch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    probe = Request("probe", a, SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    tail_key = sch._keys(probe)[-1]
    assert sch.tails.held[tail_key]
    slot = sch.manager.slot_of(tail_key)
    windowed_views = [v for gi, g in enumerate(eng.layout.groups) if g.kv_group in h.wrk.sliding_classes
                      for v in eng.row_views(slot, gi)]
    for v in windowed_views:
        v[...] = 0  # the checksum no longer matches
    affected = []
    real = h.sched._update_requests_with_invalid_blocks

    def spy(requests, invalid, *args, **kw):
        out = real(requests, invalid, *args, **kw)
        affected.append(set(out[0]))
        return out

    h.sched._update_requests_with_invalid_blocks = spy
    ra = h.add(a + prompt(31, 20), max_tokens=2)
    rb = h.add(b + prompt(32, 20), max_tokens=2)
    h.run()
    assert h.wrk.totals["load_errors"] == 1
    assert set().union(*affected) == {ra}, affected
    assert not h.runner.failures



def test_cache_classes_read_both_engine_paths_layer_names():
    from types import SimpleNamespace

    from tpu_offload.connector.windows import Windows

    w = Windows(128, frozenset({0, 2}))
    jax_path = SimpleNamespace(layer_name_to_kvcache_index={f"layer.{i}": i for i in range(4)})
    vllm_path = SimpleNamespace(layer_name_to_kvcache_index={f"model.layers.{i}.attn.attn": i for i in range(4)})
    shared = SimpleNamespace(layer_name_to_kvcache_index={"layer.0": 0, "layer.1": 0, "layer.2": 1, "layer.3": 2})
    assert w.cache_classes(jax_path, 4) == w.cache_classes(vllm_path, 4) == [(1,), (0,), (1,), (0,)]
    assert w.cache_classes(shared, 3) == [(0,), (1,), (0,)]  # an array a full layer also uses is full
    with pytest.raises(ValueError, match="no layer index"):
        w.cache_classes(SimpleNamespace(layer_name_to_kvcache_index={"attn": 0}), 1)


def test_kv_cache_groups_are_read_by_their_spec_class():
    """vLLM's hybrid manager gives sliding layers a SlidingWindowSpec group; with it off, their window
    is recorded on a FullAttentionSpec whose every block is kept (full, for the connector)."""
    import torch
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    from tpu_offload.connector.compat import group_windows

    kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    hybrid = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], SlidingWindowSpec(sliding_window=32, **kw)),
                                              KVCacheGroupSpec(["b"], FullAttentionSpec(**kw))])
    merged = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a", "b"], FullAttentionSpec(sliding_window=32, **kw))])
    assert group_windows(hybrid) == (32, None)
    assert group_windows(merged) == (None,)


def test_window_every_n_chunks_keeps_shorter_prefixes_hittable(windowed):
    """With window_every_chunks=5 the window before chunk 5 is kept too: a request sharing the first
    5 chunks (a system prompt) hits them, at the cost of that tail's sliding-window bytes."""
    h = windowed(window_every_chunks=5)
    p = prompt(10 * BS, 41)
    h.add(p, max_tokens=1)
    h.run()
    assert sorted(i for i, k in enumerate(h.sch._keys(_probe(h, p))) if h.sch.tails.held.get(k)) == [3, 4, 8, 9]
    g = h.wrk.engine.layout.groups
    assert h.wrk.totals["store_bytes"] == 10 * g[0].block_bytes + 4 * g[1].block_bytes
    h.add(p[: 5 * BS] + prompt(42, 40), max_tokens=2)
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 5
    assert not h.runner.failures


def _probe(h, tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("probe", tokens, SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
