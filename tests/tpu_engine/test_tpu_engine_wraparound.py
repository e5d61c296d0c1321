"""A host tier filled past its slot count, per model family, in the real engine on CPU.

Each family's engine runs with a tier of a few slots, sized by ``cpu_bytes``
(so both halves must agree on what a chunk costs), and a workload that
stores several times that many chunks: the LRU wraps around again and
again while loads of the latest prefixes come back from it. Tokens are
identical to a no-connector engine of the same shape, and no error was
caught. The exact Gemma 4 setup that crashed (tpu-inference's JAX path,
sliding and global layers of different head sizes in one uniform-type
KV-cache group, TP 2, 16-token pages, ``auto`` windows) runs with vLLM's
prefix caching on and off; with it on, every round starts from an empty
prefix cache so the repeats come from our tier.

Then, on the Gemma 4 engine, failures are injected into each save, load and
completion path of both halves: the engine goes on, tokens stay identical
(failed loads recompute, failed stores are dropped and counted), and a
clean round afterwards hits again.
"""

from __future__ import annotations

import os

import pytest

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import delta, settle, totals, valid_slots, wrk, sch
from tpu_offload.testing.tiny_families import FAMILIES, use_engine_env
from tpu_offload.testing.workloads import prompt

pytestmark = pytest.mark.engine

BLOCK = 16
SLOTS = 8  # host slots each engine's tier holds (cpu_bytes = SLOTS chunks of its model)
# Six prompts of 6-7 chunks each (40 chunks) through an 8-slot tier, then repeats of the latest ones.
P = [prompt(200 + i, 100 + 8 * i) for i in range(6)]
ROUNDS = [[P[0], P[1]], [P[2], P[3]], [P[4], P[5]], [P[5]], [P[4], P[5]], [P[0]], [P[0], P[1]]]
FAMILY_SHAPES = {  # name -> (shape, vLLM prefix caching)
    "llama-kv1-tp2": (Shape("kv1", "float32", tp=2, block_size=BLOCK), True),  # one KV head repeated over TP
    "qwen3-tp1": (Shape("qwen3", "bfloat16", tp=1, block_size=BLOCK), True),
    "qwen2-tp1": (Shape("qwen2", "float32", tp=1, block_size=BLOCK), True),
    "gpt-oss-tp1": (Shape("gpt-oss", "bfloat16", tp=1, block_size=BLOCK), True),  # hybrid: 2 KV-cache groups
    "qwen3-moe-tp1": (Shape("qwen3-moe", "bfloat16", tp=1, block_size=BLOCK), True),  # vLLM-model path
    "llama4-tp1": (Shape("llama4", "bfloat16", tp=1, block_size=BLOCK), True),
    "llama-guard4-tp1": (Shape("llama-guard4", "bfloat16", tp=1, block_size=BLOCK), True),
    "qwen2.5-vl-tp1": (Shape("qwen2.5-vl", "float32", tp=1, block_size=BLOCK), True),  # M-RoPE
    "gemma4-tp2": (Shape("gemma4", "float32", tp=2, block_size=BLOCK), True),
    "gemma4-tp2-no-prefix-caching": (Shape("gemma4", "float32", tp=2, block_size=BLOCK), False),
}
# Distinct bytes of one 16-token chunk (K and V, every layer, each KV head once), as the caches hold them:
# cpu_bytes buys SLOTS of them only if both halves count chunks this way.
CHUNK_BYTES = {
    "kv1": 16 * 2 * 1 * 128 * 4 * 2,  # 1 KV head of 128 (repeated on both TP shards, stored once), 2 layers
    "qwen3": 16 * 2 * 4 * 128 * 2 * 2,  # 4 KV heads, bf16, 2 layers
    "qwen2": 16 * 2 * 2 * 128 * 4 * 2,  # 2 KV heads, float32, 2 layers
    "gpt-oss": 16 * 2 * 128 * 2 * 2,  # head_dim 64: K and V share one 128-lane row per head; 2 heads, 2 layers
    "qwen3-moe": 16 * 2 * 128 * 2 * 2,  # head_dim 64 too, 2 KV heads, bf16, 2 layers
    "llama4": 16 * 2 * 2 * 128 * 2 * 4,  # 2 KV heads, bf16, 4 layers
    "llama-guard4": 16 * 2 * 2 * 128 * 2 * 2,  # 2 KV heads, bf16, 2 layers
    "qwen2.5-vl": 16 * 2 * 2 * 128 * 4 * 2,  # 2 KV heads, float32, 2 layers
    "gemma4": 16 * 2 * 2 * (128 + 128 + 256) * 4,  # two sliding layers of head_dim 128, a global one of 256
}


def run_rounds(eng, caching: bool) -> list[list[int]]:
    out = []
    for r in ROUNDS:
        if caching:
            drain(eng)
            eng.reset_prefix_cache()  # the repeats must come from our tier, not vLLM's prefix cache
        out += eng.generate(r)
    return out


def drain(eng, timeout_s: float = 60.0) -> None:
    """Step until vLLM holds no finished request's blocks for us (a server keeps stepping for them:
    ``Scheduler.has_requests``; ``LLM.generate`` returns as soon as the last one finished)."""
    import time

    deadline = time.monotonic() + timeout_s
    while eng.core.scheduler.has_requests():
        assert time.monotonic() < deadline, "finished requests still hold blocks"
        eng.llm.llm_engine.step()


@pytest.fixture(scope="module", autouse=True)
def family_env(engines):
    saved = dict(os.environ)
    yield
    engines.close()
    use_engine_env(None)
    os.environ.clear()
    os.environ.update(saved)


def _engine(engines, key, shape: Shape, kv=None, **kw):
    family = FAMILIES.get(shape.model)
    if engines.key != key or engines.run is None:
        engines.close()
        use_engine_env(family)
    extra = dict(family.engine_kwargs) if family is not None else {}
    return engines.get(key, shape, kv, **extra, **kw)


_BASE: dict[Shape, list[list[int]]] = {}


def _baseline(engines, shape: Shape) -> list[list[int]]:
    if shape not in _BASE:
        eng = _engine(engines, ("wrap-baseline", shape), shape, enable_prefix_caching=False)
        _BASE[shape] = run_rounds(eng, caching=False)
    return _BASE[shape]


def _ours(engines, name: str):
    shape, caching = FAMILY_SHAPES[name]
    base = _baseline(engines, shape)
    kv = kv_transfer_config("offload.json", cpu_bytes=SLOTS * CHUNK_BYTES[shape.model], staging_blocks=32,
                            verify_checksums=True)
    eng = _engine(engines, ("wrap", name), shape, kv, enable_prefix_caching=caching)
    return eng, base, caching


@pytest.mark.parametrize("name", list(FAMILY_SHAPES))
def test_tier_wraps_around_with_identical_tokens(name, engines):
    eng, base, caching = _ours(engines, name)
    s, w = sch(eng), wrk(eng)
    assert s.s.num_slots == w.s.num_slots == w.engine.num_slots == SLOTS, "one slot count in both halves"
    assert s.s.chunk_bytes == w.s.chunk_bytes == w.chunk_bytes == CHUNK_BYTES[eng.shape.model], "one chunk size"
    t0 = totals(eng)
    assert run_rounds(eng, caching) == base
    settle(eng)
    t1 = totals(eng)
    stored = delta(t1, t0, "stored_chunks")
    assert stored >= 3 * SLOTS, f"{stored} chunks stored through {SLOTS} slots: the LRU must wrap several times"
    assert delta(t1, t0, "hit_tokens") > 0, "repeats of the latest prefixes come back from the tier"
    assert delta(t1, t0, "loaded_chunks") > 0
    for k in ("store_errors", "load_errors", "dropped_store_chunks"):
        assert delta(t1, t0, k) == 0, k
    assert not w.guard.counts and not eng.scheduler_connector.guard.counts, "no error was caught"
    assert len(valid_slots(eng)) <= SLOTS


# ---- failures injected into every path, on the Gemma 4 engine that crashed ------------------------------
def _boom(*a, **k):
    raise RuntimeError("injected")


def _index_error(*a, **k):
    raise IndexError("index 29 is out of bounds for axis 0 with size 29")  # the crash's own error


INJECT = {  # guard path -> (which half, attribute holder, attribute, replacement)
    "complete_store": ("worker", "engine", "complete_store", _index_error),
    "wait_for_save": ("worker", None, "_check_snapshot", _boom),
    "start_load_kv": ("worker", "engine", "check_loadable", _boom),
    "get_finished": ("worker", None, "_maybe_release", _boom),
    "get_num_new_matched_tokens": ("scheduler", None, "_decide", _boom),  # both lookup walks end in it
    "update_state_after_alloc": ("scheduler", "manager", "prepare_load", _boom),
    "build_connector_meta": ("scheduler", "stores", "plan", _boom),
}


@pytest.mark.parametrize("path", list(INJECT))
def test_injected_failures_never_reach_the_engine_step(path, engines, monkeypatch):
    eng, base, caching = _ours(engines, "gemma4-tp2")
    conn_w, conn_s = eng.worker_connector, eng.scheduler_connector
    half, holder, attr, fn = INJECT[path]
    owner = wrk(eng) if half == "worker" else sch(eng)
    target = getattr(owner, holder) if holder else owner
    guard = conn_w.guard if half == "worker" else conn_s.guard
    caught = guard.counts[path]
    errors = conn_w.worker.metrics.errors.labels(path=path)._value.get()
    t0 = totals(eng)
    monkeypatch.setattr(target, attr, fn)
    try:
        assert run_rounds(eng, caching) == base  # failed loads recompute, failed stores are dropped
    finally:
        monkeypatch.undo()
    settle(eng)
    t1 = totals(eng)
    assert guard.counts[path] > caught, f"the {path} failure was caught"
    assert conn_w.worker.metrics.errors.labels(path=path)._value.get() > errors, "and counted"
    if path in ("complete_store", "wait_for_save"):
        assert delta(t1, t0, "dropped_store_chunks") > 0
    # and the engine goes on: a clean pass, with hits from the tier again
    assert run_rounds(eng, caching) == base
    settle(eng)
    t2 = totals(eng)
    assert delta(t2, t1, "hit_tokens") > 0
    assert delta(t2, t1, "load_errors") == 0
