"""Sliding-window layers offloaded by their window, in the real engine (gpt-oss, Gemma 4).

Gemma 4 runs on tpu-inference's JAX path, one block table for every layer:
the window needs vLLM's prefix caching off (tpu_offload/connector/windows.py).
gpt-oss runs on its vLLM-model path, where vLLM's hybrid KV-cache manager
(kept on: the connector supports it) gives its sliding layers a KV-cache
group of their own: the window is used with prefix caching off and on. Each
runs the round trip with our connector: identical tokens to no connector, the second
pass restored from our tier, and the sliding-window layers moving only the
chunks at the end of each stored prefix. A tail chunk whose sliding-window
bytes are bad recomputes its request with identical tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import os

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, delta, hit_tokens, settle, totals, valid_slots, wrk
from tpu_offload.testing.tiny_families import FAMILIES
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine

BLOCK = 16
ROUND = ROUNDTRIP[BLOCK]
WINDOWED = ("gpt-oss", "gemma4")  # the families with sliding-window layers
TP1 = {n: Shape(n, "bfloat16" if FAMILIES[n].bf16_only else "float32", tp=1, block_size=BLOCK) for n in WINDOWED}
# (shape, vLLM prefix caching). gpt-oss runs on tpu-inference's vLLM-model path, where vLLM's hybrid
# KV-cache manager gives its sliding layers a group of their own: the window is safe with prefix caching on.
SHAPES = {f"{n}-tp1": (TP1[n], False) for n in WINDOWED}
SHAPES["gpt-oss-tp2"] = (Shape("gpt-oss", TP1["gpt-oss"].dtype, tp=2, block_size=BLOCK), False)
SHAPES["gpt-oss-tp1-prefix-caching"] = (TP1["gpt-oss"], True)


@pytest.fixture(scope="module", autouse=True)
def family_env():
    """Each family's engine environment for this module only."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def windowed(request, engines, family_env):
    shape, caching = SHAPES[request.param]
    os.environ.update(dict(FAMILIES[shape.model].engine_env))  # as the families' own tests set it
    base = engines.baseline(TP1[shape.model], ROUND, only=True)
    eng = engines.get(("window", shape, caching), shape, kv_transfer_config("offload.json", **OURS),
                      enable_prefix_caching=caching)
    assert wrk(eng).s.hybrid == (shape.model == "gpt-oss")  # one block table per KV-cache group
    return shape, base, eng, caching


def again(eng, caching: bool) -> None:
    """Make the next pass come from our tier: forget vLLM's prefix cache where it has one."""
    if caching:
        eng.reset_prefix_cache()


def test_window_only_round_trip_gives_identical_tokens(windowed):
    shape, base, eng, caching = windowed
    layout = wrk(eng).engine.layout
    sliding = [g for g in layout.groups if g.kv_group in wrk(eng).sliding_classes]
    assert sliding, "the sliding-window layers form their own groups"
    t0 = totals(eng)
    assert ROUND.run(eng) == base
    settle(eng)
    t1 = totals(eng)
    chunks = delta(t1, t0, "stored_chunks")
    assert chunks == sum(len(p) // BLOCK for p in ROUND.prompts)
    every = chunks * layout.block_bytes
    tail = wrk(eng).s.tail_blocks
    windowed_bytes = sum(g.block_bytes for g in sliding)
    with_window = sum(eng.scheduler_connector.scheduler.tails.held.values())
    # each prompt's last `tail` chunks at least (a prefill split over steps leaves a tail per step)
    assert tail * len(ROUND.prompts) <= with_window < chunks
    assert delta(t1, t0, "store_bytes") == every - windowed_bytes * (chunks - with_window)
    again(eng, caching)
    assert ROUND.run(eng) == base
    t2 = totals(eng)
    assert delta(t2, t1, "hit_tokens") == sum(hit_tokens(len(p), BLOCK) for p in ROUND.prompts)
    assert delta(t2, t1, "load_errors") == 0
    assert delta(t2, t1, "load_bytes") < delta(t2, t1, "loaded_chunks") * layout.block_bytes


def test_bad_window_bytes_recompute_the_request_with_identical_tokens(windowed):
    shape, base, eng, caching = windowed
    w = wrk(eng).engine
    sch = eng.scheduler_connector.scheduler
    tails = [sch.manager.slot_of(k) for k, has in sch.tails.held.items() if has and sch.manager.slot_of(k) is not None]
    assert tails
    for slot in tails:  # the sliding-window layers' bytes of every tail chunk (checksums then fail)
        for gi, g in enumerate(w.layout.groups):
            if g.kv_group in wrk(eng).sliding_classes:
                for v in w.row_views(slot, gi):
                    v[...] = np.zeros_like(v)
    again(eng, caching)
    t0 = totals(eng)
    assert ROUND.run(eng) == base
    t1 = totals(eng)
    assert delta(t1, t0, "load_errors") == len(tails)  # each request's tail failed: all recomputed
    assert valid_slots(eng)




def test_control_the_restored_window_is_what_sliding_layers_read(windowed):
    """Negative control: zero only the sliding-window layers' bytes of the tail chunks, checksums
    refreshed (a corruption no check can see): the restored tokens change."""
    from tpu_offload.testing.workloads import NEGATIVE

    shape, _, eng, caching = windowed
    w, sch = wrk(eng).engine, eng.scheduler_connector.scheduler
    neg = NEGATIVE[BLOCK]
    before = {k for k, has in sch.tails.held.items() if has}
    first = neg.run(eng)
    settle(eng)
    again(eng, caching)
    assert neg.run(eng) == first  # restored from our tier
    tails = [sch.manager.slot_of(k) for k, has in sch.tails.held.items() if has and k not in before]
    assert tails
    for slot in tails:
        for gi, g in enumerate(w.layout.groups):
            if g.kv_group in wrk(eng).sliding_classes:
                for v in w.row_views(slot, gi):
                    v[...] = np.zeros_like(v)
        w.checksums[slot] = w._checksum(slot)
    again(eng, caching)
    t0 = totals(eng)
    assert neg.run(eng) != first
    assert delta(totals(eng), t0, "load_errors") == 0
