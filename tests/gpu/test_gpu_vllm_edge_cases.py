"""Real vLLM engines at the edges: two engines in one process, a restart in one
process, and a hybrid model (two KV-cache groups) whose load fails.

Runs after the other engine modules (file order): it shuts the shared tiny
Llama engine down and leaves the hybrid engine running.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_offload import testing

from gpu_engines import start_engine

pytestmark = pytest.mark.engine


def prompt(seed: int, n: int) -> dict:
    return {"prompt_token_ids": np.random.default_rng(seed).integers(1, 500, size=n).tolist()}


def generate(llm, prompts, n_out: int = 8) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_a_second_offloading_engine_in_the_same_process_fails_at_start(engine, tiny_model_dir):
    llm, worker, _ = engine
    p = [prompt(101, 300)]
    first = generate(llm, p)
    with pytest.raises(RuntimeError, match="second vLLM engine with KV offloading"):
        start_engine(tiny_model_dir)
    llm.reset_prefix_cache()  # the first engine is untouched and still restores its own KV
    loaded = worker.stats.loaded_pages
    assert generate(llm, p) == first and worker.stats.loaded_pages - loaded == 2


def test_a_clean_restart_in_the_same_process_works(engines):
    """Shut the engine down, start another: its KV is its own again."""
    engines.close()
    llm, worker, manager = engines.get("hybrid")
    p = [prompt(102, 520)]
    first = generate(llm, p)
    hits = manager.hit_chunks
    llm.reset_prefix_cache()
    assert generate(llm, p) == first and manager.hit_chunks - hits >= 4
    assert worker.stats.load_error_blocks == 0


def test_hybrid_model_failed_load_is_recomputed_not_a_crash(hybrid_engine):
    llm, worker, manager = hybrid_engine
    assert len(worker.planner.group_tensors) == 2  # sliding window + full attention
    assert manager.device is None  # two KV-cache groups: no device sources, the plain prefix lookup
    p = [prompt(103, 600)]
    first = generate(llm, p)
    jobs, errs = worker.stats.load_jobs, worker.stats.load_error_jobs
    llm.reset_prefix_cache()
    testing.fail_next_loads(worker, 1)
    assert generate(llm, p) == first  # reported as failed_recving: vLLM recomputes the request
    assert worker.stats.load_error_jobs - errs == 1
    assert worker.stats.load_jobs - jobs == 1  # its chunks were dropped: no reload loop
    assert manager.forgotten_chunks >= 4
    assert generate(llm, [prompt(104, 200)])  # the engine keeps serving
