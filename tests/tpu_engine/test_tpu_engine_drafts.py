"""Speculative decoding with our connector, in the real engine on CPU.

tpu-inference 0.32's registry holds three drafters with a model of their own
(``Eagle3LlamaForCausalLM``, ``Gemma4MTPModel``, ``DFlashForCausalLM`` /
``DFlashDraftModel``). A drafter writes its own KV layers after the
connector's save has run for the step, so our connector refuses any
``speculative_config`` with a draft model (``connector/compat.py``). Here,
with a tiny Llama target and a tiny EAGLE-3 drafter (``tiny_drafts``):

* the engine with our connector fails to start with that one error, and the
  same engine without it starts and serves, drafting (so the refusal is
  ours, not the engine's);
* a failed start leaves vLLM's model-parallel groups behind in the process;
  the next engine here is a MoE model, which needs the expert-parallel group
  the dense target's groups lack (``engine_run.refused_start`` tears them
  down, as a started engine's shutdown does);
* n-gram speculation (no draft model) with our connector: tokens identical
  to the same engine without a connector, and after vLLM's prefix cache is
  reset every full block comes from our tier.
"""

from __future__ import annotations

import pytest

from tpu_offload.testing.engine_run import EngineRun, Shape, kv_transfer_config, refused_start
from tpu_offload.testing.offload_helpers import OURS, store_then_hit_every_block
from tiny_drafts import EAGLE3_TARGET, write_eagle3
from tpu_offload.testing.tiny_families import QWEN3_MOE
from tpu_offload.testing.workloads import ROUNDTRIP, Workload, prompt

pytestmark = pytest.mark.engine

SHAPE = Shape(EAGLE3_TARGET.name, "bfloat16", tp=1, block_size=16)
W = ROUNDTRIP[16]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# repeated text, so n-gram lookup finds matches and drafts from the first decode step
REPEATS = Workload.of("ngram16", [[prompt(61, 40) * 3, prompt(62, 33) * 5]], block_size=16)


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):
    target = model_dir(SHAPE.model, SHAPE.dtype)
    return target, write_eagle3(str(tmp_path_factory.mktemp("eagle3-draft")), EAGLE3_TARGET)


def eagle3(paths) -> dict:
    return {"method": "eagle3", "model": paths[1], "num_speculative_tokens": 2}


def drafted(eng: EngineRun) -> int:
    """Draft tokens vLLM's scheduler has verified since the engine started (its metrics)."""
    return sum(m.value for m in eng.llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")


def test_eagle3_drafter_is_refused_at_start_by_our_connector_alone(paths, engines):
    engines.close()  # one engine (and worker connector) per process
    err = refused_start(paths[0], SHAPE, kv_transfer_config("offload.json", **OURS), speculative_config=eagle3(paths))
    assert type(err).__name__ == "ConfigError", repr(err)
    assert str(err).startswith("speculative_config.method='eagle3': the draft model writes its KV layers after "
                               "the connector has stored the step's chunks"), str(err)
    assert "a method without a draft model (ngram)" in str(err)

    # the same engine without our connector starts, drafts with the EAGLE-3 model, and serves
    eng = engines.get(("eagle3", SHAPE), SHAPE, None, speculative_config=eagle3(paths))
    assert type(eng.runner.drafter).__name__ == "Eagle3Proposer"
    out = W.run(eng)
    assert [len(t) for t in out] == [W.max_tokens] * len(W.prompts)
    assert drafted(eng) > 0

    # a failed start leaves nothing behind: a MoE model (expert-parallel group) starts next
    eng = engines.get(("moe-after-refusal", QWEN3_MOE.name), Shape(QWEN3_MOE.name, "bfloat16", tp=1, block_size=16))
    assert len(W.run(eng)) == len(W.prompts)


def test_ngram_speculation_with_our_connector_gives_identical_tokens_and_hits(paths, engines):
    base = REPEATS.run(engines.get(("ngram", SHAPE), SHAPE, None, speculative_config=NGRAM))
    eng = engines.get(("ngram-ours", SHAPE), SHAPE, kv_transfer_config("offload.json", **OURS),
                      speculative_config=NGRAM)
    store_then_hit_every_block(eng, REPEATS, base, SHAPE.block_size)
    assert drafted(eng) > 0, "n-gram lookup drafted while our connector stored and loaded"
