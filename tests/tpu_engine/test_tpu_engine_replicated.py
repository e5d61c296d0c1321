"""TP above the KV heads: tpu-inference replicates the KV head on every shard.

The model has one KV head and runs at TP 4 (as Llama-3-8B does at TP 16 on
a multi-host llm-d slice: more shards than KV heads). Tokens must survive a
round trip through our tier, and what crosses to the host must be the
model's real KV, each distinct head once, not TP copies of it.
"""

from __future__ import annotations

import pytest

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, hit_tokens, settle, totals, wrk
from tpu_offload.testing.tiny_models import KV1
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine

SHAPE = Shape("kv1", "bfloat16", tp=4, block_size=16, num_blocks=40)
W = ROUNDTRIP[16]


@pytest.fixture(scope="module")
def run(engines):
    base = engines.baseline(SHAPE, W, only=True)
    eng = engines.get(("ours", SHAPE), SHAPE, kv_transfer_config("offload.json", **OURS))
    first = W.run(eng)
    settle(eng)
    t1 = totals(eng)
    eng.reset_prefix_cache()
    second = W.run(eng)
    t2 = totals(eng)
    return {"base": base, "first": first, "second": second, "t1": t1, "t2": t2,
            "chunk_bytes": wrk(eng).engine.chunk_bytes, "kv_heads_in_cache": eng.runner.kv_caches[0].shape[2]}


def test_the_engine_really_replicates_the_kv_head(run):
    assert SHAPE.tp > KV1.num_kv_heads
    assert run["kv_heads_in_cache"] * 2 // 2 >= SHAPE.tp // 2  # packed K/V rows for TP copies of the head


def test_round_trip_gives_identical_tokens(run):
    assert run["first"] == run["base"]
    assert run["second"] == run["base"]
    hits = run["t2"].get("hit_tokens", 0) - run["t1"].get("hit_tokens", 0)
    assert hits == sum(hit_tokens(len(p), SHAPE.block_size) for p in W.prompts)


def test_host_and_transfer_bytes_per_chunk_are_the_real_kv_size(run):
    real = KV1.kv_bytes_per_token(2) * SHAPE.block_size  # blocks_per_chunk 1
    assert run["chunk_bytes"] == real, "host bytes per chunk"
    t1 = run["t1"]
    assert t1["store_bytes"] / t1["stored_chunks"] == real, "device-to-host bytes per chunk"
    t2 = run["t2"]
    loaded = t2["loaded_chunks"] - t1.get("loaded_chunks", 0)
    assert (t2["load_bytes"] - t1.get("load_bytes", 0)) / loaded == real, "host-to-device bytes per chunk"
