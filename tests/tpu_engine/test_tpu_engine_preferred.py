"""tpu-inference 0.32 serves the architectures in ``_VLLM_PREFERRED_ARCHITECTURES`` with vLLM's
model (its torchax path) even where it has a JAX one: each is under a real-engine test here, and a
tpu-inference that prefers another is noticed (this fails until that one is tested too)."""

from __future__ import annotations

import importlib
import os

import pytest

from tpu_offload.testing.tiny_families import FAMILIES

pytestmark = pytest.mark.engine

HERE = os.path.dirname(os.path.abspath(__file__))
TESTED = {  # architecture -> the test that serves it with our connector, or refuses it
    "GptOssForCausalLM": ("test_tpu_engine_families.py", "test_tp1_our_connector_round_trip"),
    "Qwen3MoeForCausalLM": ("test_tpu_engine_families.py", "test_tp1_our_connector_round_trip"),
    "KimiK25ForConditionalGeneration": ("test_tpu_engine_dp.py",
                                        "test_kimi_k25_serves_the_tiny_deepseek_v3_text_model"),
    "Qwen3_5MoeForConditionalGeneration": ("test_tpu_engine_hybrids.py",
                                           "test_qwen3_5_moe_is_refused_at_start_naming_the_model_and_reason"),
}


def test_every_vllm_preferred_architecture_has_its_engine_test():
    loader = importlib.import_module("tpu_inference.models.common.model_loader")
    assert set(loader._VLLM_PREFERRED_ARCHITECTURES) == set(TESTED)
    for arch, (path, test) in TESTED.items():
        assert f"def {test}(" in open(os.path.join(HERE, path)).read(), (arch, path, test)
    # the families test runs every family in tiny_families.FAMILIES
    assert {f.architecture for f in FAMILIES.values()} >= {"GptOssForCausalLM", "Qwen3MoeForCausalLM"}
