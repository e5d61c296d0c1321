"""gpt-oss, Gemma 4, Llama 4, Qwen3-MoE and the multimodal classes (Llama Guard 4, Qwen2.5-VL)
with our connector at TP 2, precompile on, as served. Gemma 4 as ``Gemma4ForConditionalGeneration``
is left out here: its caches, and so our programs, are exactly ``gemma4``'s (its TP 2 tokens are
checked in test_tpu_engine_families.py).

One child process (2 emulated devices, tpu-inference's precompile on, our
connector's too) runs, per family, a no-connector engine for the reference tokens
(precompile skipped: it changes which programs compile when, not what they compute)
and then ours with the shipped config (prefix caching on, so sliding-window layers move every block:
``sliding_window: auto``). Each warms up in every token bucket, then runs a
store pass and two passes after ``reset_prefix_cache()``: tokens identical to
no connector, every full block of the second and third pass from our tier,
and none of our programs compiled after start (a control drops them and
sees them compile).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine_child import run_jobs
from tpu_offload.testing.engine_run import DEVICES_ENV, PRECOMPILE_ENV, Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, hit_tokens
from tpu_offload.testing.tiny_families import FAMILIES
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine

BLOCK = 16
W = ROUNDTRIP[BLOCK]
NAMES = ("gpt-oss", "gemma4", "llama4", "qwen3-moe", "llama-guard4", "qwen2.5-vl")
OUR_PROGRAMS = ("gather_local", "scatter_local", "jit(store)", "jit(load)", "jit(take)", "jit(put)", "jit(make)")


def jobs(name: str, model_dir) -> list[dict]:
    """The family's two runs: the reference tokens (a plain run, no warm-up, tpu-inference's precompile
    skipped; the child drops a job's env after it, so ours starts precompiling again), then ours, served."""
    fam = FAMILIES[name]
    shape = Shape(fam.name, "bfloat16" if fam.bf16_only else "float32", tp=2, block_size=BLOCK,
                  max_num_batched_tokens=256, max_num_seqs=16)  # warm-up: sub-page prompts fill each bucket
    job = {"shape": dataclasses.asdict(shape), "model_dir": model_dir(shape.model, shape.dtype),
           "workload": W.name, "env": dict(fam.engine_env), "engine_kw": dict(fam.engine_kwargs)}
    return [{**job, "kv": None, "env": {**job["env"], "SKIP_JAX_PRECOMPILE": "1"}},
            {**job, "kv": kv_transfer_config("offload.json", **OURS, skip_precompile=False), "passes": 3,
             "count_compiles": True, "control": True}]


@pytest.fixture(scope="module")
def served_all(model_dir, tmp_path_factory):
    """Every family's runs in one child process (one start of JAX, vLLM and tpu-inference, not six)."""
    work = tmp_path_factory.mktemp("served")
    env = {DEVICES_ENV: "2", PRECOMPILE_ENV: "1", "VLLM_XLA_CACHE_PATH": str(work / "xla-cache")}
    results = run_jobs([j for n in NAMES for j in jobs(n, model_dir)], work, timeout_s=1500, env=env)
    return {n: (results[2 * i], results[2 * i + 1]) for i, n in enumerate(NAMES)}


@pytest.fixture(params=NAMES)
def served(request, served_all):
    return served_all[request.param]


def test_tp2_precompiled_round_trips_give_identical_tokens_from_our_tier(served):
    base, ours = served
    assert ours["devices"] == 2
    assert ours["precompile_s"] > 0  # tpu-inference precompiled ours
    assert ours["passes"][0] == base["tokens"]
    want = sum(hit_tokens(len(p), BLOCK) for p in W.prompts)
    for later, hits in zip(ours["passes"][1:], ours["hits"]):
        assert later == base["tokens"]
        assert hits == want
    assert ours["ours_compiled_at_start"] > 0  # our precompile ran
    ours_late = [c for c in ours["compiles_after_warmup"] if any(p in c for p in OUR_PROGRAMS)]
    assert ours_late == [], "our programs compiled while serving"
    # control: with our programs dropped, the counter sees them compile (so the names above match)
    assert ours["control_tokens"] == base["tokens"] and ours["control_hits"] > 0
    assert [c for c in ours["control_compiles"] if any(p in c for p in OUR_PROGRAMS)], ours["control_compiles"]
