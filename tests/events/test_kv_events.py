"""The router's view of our host tier: real vLLM KV-event publisher, a ZMQ subscriber
decoding with vLLM's own event types (``benchmarks.serving.events``), a short workload.

llm-d's router scores the CPU tier from these events, so every chunk that enters or leaves
the tier must be announced as ``BlockStored`` / ``BlockRemoved`` with medium ``CPU``, and
the blocks the subscriber believes are resident must be exactly what the tier holds.
One in-process engine (about 30-60 s here); the host tier is 8 chunks, the workload
stores 14, so evictions are announced too.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from events_helpers import wait_for

pytestmark = pytest.mark.engine

SLOTS = 8
PROMPTS = 7  # 2 full blocks each: 14 chunks into 8 slots



@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVEventsConfig

    from benchmarks.serving.events import KVEventListener
    from benchmarks.serving.model import tiny_llama_class
    from gpu_offload import testing

    tmp = tmp_path_factory.mktemp("kv_events")
    model = tiny_llama_class()()
    path = model.write(str(tmp / "model"))
    endpoint = f"ipc://{tmp / 'events.sock'}"
    block_bytes = model.kv_bytes_per_token() * 128
    ktc = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "HostOffloadSpec", "spec_module_path": "gpu_offload.spec",
                                      "cpu_bytes_to_use": SLOTS * block_bytes, "self_describing_kv_events": True},
    }
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, kv_transfer_config=ktc,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint))
    listener = KVEventListener(endpoint)
    time.sleep(0.5)
    try:
        yield llm, testing.the_manager(), listener
    finally:
        listener.close()
        llm.llm_engine.engine_core.shutdown()


def _run_workload(llm, vocab: int) -> None:
    from vllm import SamplingParams

    rng = np.random.default_rng(3)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(PROMPTS):  # one at a time: each store lands before the next prompt
        llm.generate([{"prompt_token_ids": rng.integers(3, vocab, 300).tolist()}], sp, use_tqdm=False)
    for _ in range(3):  # steps that submit and complete the last store
        llm.generate([{"prompt_token_ids": [5] * 8}], sp, use_tqdm=False)


def _tier_hashes(manager) -> set:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    return {maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))) for k in manager.index.keys_lru_order()}


def test_every_chunk_in_and_out_of_the_cpu_tier_is_announced(engine):
    from benchmarks.serving.model import tiny_llama_class

    llm, manager, listener = engine
    _run_workload(llm, tiny_llama_class()().vocab_size)
    stored = manager.stored_chunks
    evicted = manager.index.evictions
    assert stored == 2 * PROMPTS and evicted == stored - SLOTS, (stored, evicted)
    assert wait_for(lambda: listener.summary()["by_medium"].get("CPU", {}).get("removed_blocks", 0) >= evicted)
    s = listener.summary()
    assert s["decode_errors"] == 0 and s["seq_gaps"] == 0 and s["untagged_events"] == 0, s
    cpu = s["by_medium"]["CPU"]
    assert cpu["stored_events"] == stored, s  # one BlockStored per chunk, medium CPU
    assert cpu["removed_blocks"] == evicted, s  # every eviction, medium CPU
    assert cpu["untracked_removals"] == 0, s
    assert set(s["by_medium"]) <= {"GPU", "CPU"}, s


def test_subscriber_view_matches_what_the_tier_holds(engine):
    llm, manager, listener = engine
    held = _tier_hashes(manager)
    assert len(held) == SLOTS
    assert wait_for(lambda: listener.blocks("CPU") == held), (len(listener.blocks("CPU")), len(held))
