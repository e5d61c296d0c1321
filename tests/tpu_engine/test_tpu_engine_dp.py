"""Our connector under tpu-inference's DP attention, in the real engine on CPU (2 attention-DP ranks).

tpu-inference then runs its ``DPScheduler``: one vLLM scheduler (and one
scheduler half of our connector) per rank, each in a forked process, and one
worker whose caches hold both ranks' block ranges side by side, sharded over
the ranks' devices. Three models at TP 2 with DP attention (so attention DP 2,
tensor parallel 1 inside each rank):

* the tiny DeepSeek-V3 (MLA, fp8 latent cache, 32-token pages);
* a dense Llama-shaped model with 4 KV heads (bf16, ``attn_dp_size`` 2);
* Kimi K2.5 (``KimiK25ForConditionalGeneration``, vLLM-preferred), its vision
  tower loaded, text prompts: the tiny DeepSeek-V3's text weights, so its
  tokens must equal DeepSeek-V3's.

Requests are routed round-robin (``DP_SCHED_ROUTING``), so a round of two
prompts puts one on each rank. Each: greedy tokens identical to the engine
without a connector; after vLLM's prefix cache is reset, every full block
comes back from the host tier; none of our
transfer programs compiles while serving (they were precompiled at start).
Then, with routing shifted by one request, each prompt lands on the other
rank and hits the chunks the first rank stored: one host copy, loaded into
the other rank's blocks (the ranks share the tier's index through the
worker's reports, connector/dp.py).
"""

from __future__ import annotations

import os

import pytest

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, CompileCounter, delta, valid_slots, wrk, zero_slots
from tpu_offload.testing.tiny_families import ENGINE_ENV_KEYS, FAMILIES, use_engine_env
from tpu_offload.testing.workloads import Workload, prompt

pytestmark = pytest.mark.engine

DP_ATTENTION = {"sharding": {"sharding_strategy": {"enable_dp_attention": True}}}
MODELS = {
    "deepseek-v3": (Shape("deepseek-v3", "bfloat16", tp=2, block_size=32), dict(FAMILIES["deepseek-v3"].engine_kwargs),
                    dict(FAMILIES["deepseek-v3"].engine_env)),
    # 4 KV heads would keep TP 2 (tpu-inference turns TP into attention DP only past the KV heads): ask for it
    "dense-kv4": (Shape("kv4", "bfloat16", tp=2, block_size=32), {"additional_config": {"sharding": {
        "sharding_strategy": {"enable_dp_attention": True, "attn_dp_size": 2}}}},
                  {"NEW_MODEL_DESIGN": "1"}),
    # Kimi K2.5 (vLLM-preferred): DeepSeek-V3's text model beside a vision tower (loaded), text prompts
    "kimi-k25": (Shape("kimi-k25", "bfloat16", tp=2, block_size=32), dict(FAMILIES["deepseek-v3"].engine_kwargs),
                 dict(FAMILIES["deepseek-v3"].engine_env)),
}
TWO = Workload.of("dp-two", [[prompt(51, 100), prompt(52, 165)]], block_size=32)  # one prompt per rank
SHIFT = Workload.of("dp-shift", [[prompt(53, 40)]], block_size=32)  # moves round-robin routing on by one
ENV = {"DP_SCHED_ROUTING": "round_robin"}


@pytest.fixture(scope="module", autouse=True)
def dp_env(engines):
    keys = set(ENGINE_ENV_KEYS) | set(ENV) | {"NEW_MODEL_DESIGN"}
    saved = {k: os.environ.get(k) for k in keys}
    CompileCounter.install()
    yield
    engines.close()
    use_engine_env(None)
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def engine(engines, name: str, ours: bool, kernel: str | None = None, slots: int | None = None):
    """``slots``: a host tier of that many chunks (``num_cpu_chunks``) instead of OURS' bytes."""
    shape, kwargs, env = MODELS[name]
    key = ("dp-ours" if ours else "dp-baseline", kernel, slots, shape)
    if engines.key != key or engines.run is None:
        engines.close()
        use_engine_env(None)
        os.environ.update({**env, **ENV})
    extra = {"transfer_kernel": kernel} if kernel else {}
    kv = kv_transfer_config("offload.json", **OURS, **extra) if ours else None
    if ours and slots is not None:
        del kv["kv_connector_extra_config"]["cpu_bytes"]
        kv["kv_connector_extra_config"]["num_cpu_chunks"] = slots
    return engines.get(key, shape, kv, **kwargs)


def baseline(engines, name: str) -> list[list[int]]:
    shape = MODELS[name][0]
    if (shape, TWO.name) not in engines.baselines:
        eng = engine(engines, name, ours=False)
        assert type(eng.core.scheduler).__name__ == "DPScheduler"
        eng.reset_prefix_cache()
        engines.baselines[shape, TWO.name] = TWO.run(eng)
    return engines.baselines[shape, TWO.name]


def full_blocks(w: Workload, block_size: int) -> int:
    return sum(min(len(p) // block_size * block_size, len(p) - 1) // block_size for p in w.prompts)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dp2_round_trip_on_each_rank_and_across_ranks(name, engines):
    base = baseline(engines, name)
    eng = engine(engines, name, ours=True)
    sched = eng.core.scheduler
    assert type(sched).__name__ == "DPScheduler" and sched.dp_size == 2
    w = wrk(eng)
    assert w.engine.layout.groups[0].block_axes, "the caches' block dimension is split over the ranks"
    compiled = w.engine.programs.compiles
    assert compiled > 0, "precompiled at start"
    chunks = full_blocks(TWO, eng.shape.block_size)
    t0 = dict(w.totals)
    eng.reset_prefix_cache()
    assert TWO.run(eng) == base  # prompt i on rank i
    t1 = dict(w.totals)
    assert delta(t1, t0, "stored_chunks") >= chunks
    eng.reset_prefix_cache()
    assert TWO.run(eng) == base  # again on the rank that stored it
    t2 = dict(w.totals)
    seam = eng.worker_connector._dp
    assert delta(t2, t1, "loaded_chunks") == chunks and seam.foreign == 0
    eng.reset_prefix_cache()
    SHIFT.run(eng)
    t3 = dict(w.totals)
    assert TWO.run(eng) == base  # now each prompt on the other rank: one host copy, loaded into its blocks
    t4 = dict(w.totals)
    assert delta(t4, t3, "loaded_chunks") == chunks
    assert seam.foreign == chunks, "every chunk came from the other rank's slots"
    assert delta(t4, t0, "load_errors") == 0 and seam.stale == 0
    assert w.engine.programs.compiles == compiled, "none of our programs compiled while serving"

    # negative control: what attention reads on both ranks is what came back from the host tier
    zero_slots(eng, valid_slots(eng), keep_checksums=True)
    eng.reset_prefix_cache()
    got = TWO.run(eng)
    assert got[0] != base[0] and got[1] != base[1]


def test_kimi_k25_serves_the_tiny_deepseek_v3_text_model(engines):
    """Its text weights are the tiny DeepSeek-V3's (``tiny_kimi``): the same greedy tokens at DP 2,
    so the engine loaded them where DeepSeek-V3's go (and the vision tower stays out of text)."""
    assert baseline(engines, "kimi-k25") == baseline(engines, "deepseek-v3")


def test_dp2_dma_kernel_round_trip_across_ranks(engines):
    """The DMA kernel (what a TPU runs under DP attention; TPU interpret mode here) in the real engine,
    with our programs precompiled at start: each rank's devices DMA its own blocks into their own
    host memory, and a load into the other rank carries them over (jax_backend/ranks.py). Identical
    tokens; a prompt stored on one rank and then routed to the other hits every chunk from the first
    rank's slots; DMAs issued; nothing compiled while serving."""
    name = "deepseek-v3"
    base = baseline(engines, name)
    eng = engine(engines, name, ours=True, kernel="dma")
    w = wrk(eng)
    assert w.engine.programs.kernel == "dma" and w.engine.layout.groups[0].ranks == 2
    compiled = w.engine.programs.compiles
    assert compiled > 0, "precompiled at start"
    chunks = full_blocks(TWO, eng.shape.block_size)
    t0 = dict(w.totals)
    eng.reset_prefix_cache()
    assert TWO.run(eng) == base  # prompt i on rank i: stored
    t1 = dict(w.totals)
    assert delta(t1, t0, "stored_chunks") >= chunks and w.engine.dmas["gather"] > 0
    eng.reset_prefix_cache()
    SHIFT.run(eng)
    t2 = dict(w.totals)
    assert TWO.run(eng) == base  # each prompt on the other rank
    t3 = dict(w.totals)
    seam = eng.worker_connector._dp
    assert delta(t3, t2, "loaded_chunks") == chunks and seam.foreign == chunks
    assert delta(t3, t0, "load_errors") == 0 and w.engine.dmas["scatter"] > 0
    assert w.engine.programs.compiles == compiled, "none of our programs compiled while serving"


# Eight prompts of 6-7 chunks (one 32-token block each) through a 16-chunk tier shared by both ranks,
# a reset of vLLM's prefix cache before every round, then repeats of the latest prompts and of the first.
WRAP_SLOTS = 16
WRAP = Workload.of("dp-wrap", [[prompt(60 + i, 200 + 8 * i) for i in (0, 1)], [prompt(60 + i, 200 + 8 * i) for i in (2, 3)],
                               [prompt(60 + i, 200 + 8 * i) for i in (4, 5)], [prompt(60 + i, 200 + 8 * i) for i in (6, 7)],
                               [prompt(67, 256)], [prompt(66, 248), prompt(67, 256)], [prompt(60, 200)],
                               [prompt(60, 200), prompt(61, 208)]], block_size=32)


def test_dp2_full_tier_wraps_around_with_identical_tokens(engines):
    """Issue 20's wrap-around at DP 2: DeepSeek-V3 with a host tier of 16 chunks that both ranks'
    schedulers fill, over 50 chunks stored through it (the LRU wraps around three times), repeats of
    the latest prompts loaded back on whichever rank they land: tokens identical to no connector, no
    store dropped, no error caught, never more valid slots than the tier holds."""
    name = "deepseek-v3"
    shape = MODELS[name][0]
    if (shape, WRAP.name) not in engines.baselines:
        eng = engine(engines, name, ours=False)
        engines.baselines[shape, WRAP.name] = _rounds(eng)
    base = engines.baselines[shape, WRAP.name]
    eng = engine(engines, name, ours=True, slots=WRAP_SLOTS)
    w = wrk(eng)
    assert w.engine.num_slots == WRAP_SLOTS
    t0 = dict(w.totals)
    assert _rounds(eng) == base
    t1 = dict(w.totals)
    stored = delta(t1, t0, "stored_chunks")
    assert stored >= 3 * WRAP_SLOTS, f"{stored} chunks stored through {WRAP_SLOTS} slots: the LRU must wrap"
    assert delta(t1, t0, "loaded_chunks") > 0, "repeats of the latest prompts come back from the tier"
    for k in ("store_errors", "load_errors", "dropped_store_chunks"):
        assert delta(t1, t0, k) == 0, k
    assert not w.guard.counts, "no error was caught"
    assert len(valid_slots(eng)) <= WRAP_SLOTS


def _rounds(eng) -> list[list[int]]:
    out = []
    for i in range(len(WRAP.rounds)):
        eng.reset_prefix_cache()  # the repeats must come from our tier, not vLLM's prefix cache
        out += WRAP.run(eng, rounds=[i])
    return out
