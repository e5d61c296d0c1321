"""A lease hint in ``kv_transfer_params`` reaches the TPU connector's host tier (vLLM's real scheduler,
stand-in runner): the leased session's prefix survives another session's traffic that evicts it without."""

import pytest

from tpu_standin import prompt
from tpu_offload.core.leases import HINT_KEY
from tpu_offload.core.manager import Lookup

pytestmark = pytest.mark.engine

CHUNKS = 4


def _session_then_traffic(harnesses, hint: dict | None):
    h = harnesses({"num_cpu_chunks": 8, "staging_blocks": 64, "blocks_per_chunk": 1},
                  num_blocks=128, max_num_batched_tokens=512)
    a = prompt(CHUNKS * h.sch.chunk_tokens, 1)
    h.add(a, max_tokens=1, kv_transfer_params=hint)
    h.run()
    mgr = h.sch.manager
    held_a = [k for k in mgr.keys_lru_order()][:CHUNKS]  # the first session's chunks, least recent
    for i in range(3):  # the other session's turns: 12 chunks through an 8-chunk tier
        h.add(prompt(CHUNKS * h.sch.chunk_tokens, 100 + i), max_tokens=1)
        h.run()
    return h, [mgr.lookup(k) is Lookup.HIT for k in held_a]


def test_a_leased_prefix_survives_another_sessions_traffic(harnesses):
    h, kept = _session_then_traffic(harnesses, {HINT_KEY: {"session": "agent-1", "ttl_s": 120}})
    leases = h.sch.manager.leases
    assert leases.sessions() == 1 and len(leases) == CHUNKS  # the hint reached the manager
    assert all(kept)
    assert leases.honoured > 0


def test_without_the_hint_the_same_traffic_evicts_it(harnesses):
    h, kept = _session_then_traffic(harnesses, None)
    assert h.sch.manager.leases.sessions() == 0
    assert not any(kept)


def test_a_bad_hint_is_ignored_and_the_request_served(harnesses):
    h = harnesses({"num_cpu_chunks": 8, "staging_blocks": 64, "blocks_per_chunk": 1},
                  num_blocks=128, max_num_batched_tokens=512)
    rid = h.add(prompt(2 * h.sch.chunk_tokens, 7), max_tokens=2, kv_transfer_params={HINT_KEY: {"session": 3}})
    h.run()
    assert rid in h.finished and h.sch.manager.leases.sessions() == 0
