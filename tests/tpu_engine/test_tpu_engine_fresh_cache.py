"""The engine on a fresh machine: an empty vLLM cache directory.

vLLM inspects each model class in a child process and caches the answer in
``$VLLM_CACHE_ROOT/modelinfos``. That child once resolved the platform on its
own and failed ("Model architectures [...] failed to be inspected"); the
suite passed only on a cache the vLLM suite had left behind, and never for an
architecture that suite does not load (Qwen3). Here both architectures start
from an empty cache, in a fresh process, and must decode as HF does.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import hf_reference
from engine_child import run_jobs
from tpu_offload.testing.engine_run import Shape
from tpu_offload.testing.workloads import DETERMINISM

pytestmark = pytest.mark.engine

ARCHS = {"kv4": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def test_llama_and_qwen3_start_with_an_empty_vllm_cache(model_dir, tmp_path):
    cache = tmp_path / "vllm-cache"
    shapes = [Shape(name, "float32", tp=1, block_size=16, num_blocks=40) for name in ARCHS]
    jobs = [{"shape": dataclasses.asdict(s), "model_dir": model_dir(s.model, s.dtype), "kv": None,
             "workload": DETERMINISM.name} for s in shapes]
    results = run_jobs(jobs, tmp_path, env={"VLLM_CACHE_ROOT": str(cache)})

    # inspected here, not served from some other warm cache
    assert {f.removesuffix(".json").rsplit("-", 1)[1] for f in os.listdir(cache / "modelinfos")} == set(ARCHS.values())
    for s, result in zip(shapes, results):
        refs = hf_reference.greedy(model_dir(s.model, s.dtype), DETERMINISM.prompts, DETERMINISM.max_tokens)
        compared = 0
        for tokens, ref in zip(result["tokens"], refs):
            n = hf_reference.agreed_prefix(ref, 1e-3)
            assert tokens[:n] == ref.tokens[:n], s.model
            compared += n
        assert compared >= len(refs) * DETERMINISM.max_tokens // 2, f"{s.model}: too few tokens away from a tie"
