"""The router's view of our file tier on vLLM: real publisher, real subscriber, medium STORAGE.

Every chunk file the workers publish must be announced as ``BlockStored`` with medium
``STORAGE`` and the chunk's full payload (block hashes, tokens), every file removed (here:
the file tier's own capacity eviction) as ``BlockRemoved``, and at the end the subscriber's
STORAGE and CPU sets must be exactly the files on disk and the host tier. Write-back files
land after their chunk left the host tier; vLLM's event tracker would have dropped the
payload by then, so the host removal is held until the file lands (``file_events``).
One in-process engine per write mode: the host tier holds 8 chunks, the workload stores 14,
the file tier holds 10.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from events_helpers import wait_for

pytestmark = pytest.mark.engine

SLOTS = 8
FILES = 10
PROMPTS = 7  # 2 full blocks each: 14 chunks



@pytest.fixture(scope="module", params=["write_through", "write_back"])
def run(request, tmp_path_factory):
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from benchmarks.serving.events import KVEventListener
    from benchmarks.serving.model import tiny_llama_class
    from gpu_offload import testing
    from tpu_offload.core.fs.format import HEADER_SIZE

    mode = request.param
    tmp = tmp_path_factory.mktemp(f"kv_events_{mode}")
    model = tiny_llama_class()()
    path = model.write(str(tmp / "model"))
    endpoint = f"ipc://{tmp / 'events.sock'}"
    block_bytes = model.kv_bytes_per_token() * 128
    ktc = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "HostOffloadSpec", "spec_module_path": "gpu_offload.spec",
            "cpu_bytes_to_use": SLOTS * block_bytes, "self_describing_kv_events": True,
            "shared_storage_path": str(tmp / "fs"), "fs_write_mode": mode,
            "fs_allow_unauthenticated": True,  # files are matched to keys by name below: the unkeyed layout
            "fs_capacity_bytes": int((FILES + 0.5) * (HEADER_SIZE + block_bytes)),
        },
    }
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
              max_num_seqs=4, kv_transfer_config=ktc,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint))
    listener = KVEventListener(endpoint)
    time.sleep(0.5)
    manager, worker = testing.the_manager(), testing.the_worker()
    stored_keys: list[bytes] = []
    orig = manager.complete_store

    def complete_store(keys, req_context, success=True):
        if success:
            stored_keys.extend(keys)
        return orig(keys, req_context, success)

    manager.complete_store = complete_store
    try:
        rng = np.random.default_rng(3)
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for _ in range(PROMPTS):  # one at a time: each store lands before the next prompt
            llm.generate([{"prompt_token_ids": rng.integers(3, model.vocab_size, 300).tolist()}], sp,
                         use_tqdm=False)
        for _ in range(4):  # steps: the last store completes, the workers report their files
            assert worker.fs.flush(30)
            llm.generate([{"prompt_token_ids": [5] * 8}], sp, use_tqdm=False)
        yield {"mode": mode, "llm": llm, "manager": manager, "worker": worker, "listener": listener,
               "stored_keys": stored_keys, "fs": tmp / "fs"}
    finally:
        listener.close()
        llm.llm_engine.engine_core.shutdown()


def _hash(key):
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    return maybe_convert_block_hash(BlockHash(get_offload_block_hash(key)))


def _files_on_disk(root) -> set[str]:
    return {n for _, _, names in os.walk(root) for n in names if len(n) >= 32 and not n.startswith(".")}


def test_subscriber_sees_exactly_the_files_and_the_host_tier(run):
    from tpu_offload.core.fs.layout import key_hex

    manager, listener = run["manager"], run["listener"]
    assert len(run["stored_keys"]) == 2 * PROMPTS
    on_disk = _files_on_disk(run["fs"])
    want_files = {_hash(k) for k in run["stored_keys"] if key_hex(k) in on_disk}
    want_host = {_hash(k) for k in manager.index.keys_lru_order()}
    expect_files = FILES if run["mode"] == "write_through" else 2 * PROMPTS - SLOTS  # write-back: the evicted
    assert len(want_files) == expect_files, (len(want_files), sorted(on_disk))
    assert wait_for(lambda: listener.blocks("STORAGE") == want_files and listener.blocks("CPU") == want_host), \
        (len(listener.blocks("STORAGE")), len(want_files), len(listener.blocks("CPU")), len(want_host))
    s = listener.summary()
    assert s["decode_errors"] == 0 and s["seq_gaps"] == 0 and s["untagged_events"] == 0, s
    for medium in ("CPU", "STORAGE"):
        m = s["by_medium"][medium]
        assert m["untracked_removals"] == 0, s
        assert m["tokenless_stored_events"] == 0, s  # full payloads: the router can re-hash the tokens
    if run["mode"] == "write_through":  # 14 files into a 10-file tier: 4 evicted and announced removed
        assert s["by_medium"]["STORAGE"]["removed_blocks"] == 2 * PROMPTS - FILES, s
    assert run["manager"].file_events.held_timeouts == 0
