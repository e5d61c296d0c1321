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


def _files_after_traffic(harnesses, root, hint: dict | None, file_bytes: int):
    """A 4-chunk host tier over an 8-file file tier: session A's prefix, then another session's 12 chunks."""
    from tpu_standin import fs_secret_file

    h = harnesses({"num_cpu_chunks": 4, "staging_blocks": 64, "blocks_per_chunk": 1, "shared_storage_path": str(root),
                   "fs_secret_file": fs_secret_file(root.parent), "fs_write_mode": "write_through",
                   "fs_capacity_bytes": 8 * file_bytes}, num_blocks=128, max_num_batched_tokens=512)
    tier = h.wrk.fs.tier
    assert tier.file_bytes == file_bytes
    a = prompt(CHUNKS * h.sch.chunk_tokens, 1)
    h.add(a, max_tokens=1, kv_transfer_params=hint)
    h.run()
    assert h.wrk.fs.pending_writes() == 0 and tier.flush(timeout=30)
    mine = [k for k, toks in h.tokens.items() if toks == a[: len(toks)]]
    assert len(mine) == CHUNKS and all(tier.contains(k) for k in mine)
    for i in range(3):
        h.add(prompt(CHUNKS * h.sch.chunk_tokens, 100 + i), max_tokens=1)
        h.run()
        assert h.wrk.fs.pending_writes() == 0 and tier.flush(timeout=30)
    return tier, [tier.contains(k) for k in mine]


def test_the_hint_reaches_the_workers_file_tier(harnesses, fs_harness, tmp_path):
    """Through the step's metadata: the leased prefix's files outlive traffic that evicts them without it."""
    file_bytes = fs_harness(blocks_per_chunk=1).wrk.fs.tier.file_bytes  # the size of one chunk file here
    hint = {HINT_KEY: {"session": "agent-1", "ttl_s": 120}}
    tier, kept = _files_after_traffic(harnesses, tmp_path / "leased", hint, file_bytes)
    assert tier.leases.sessions() == 1 and len(tier.leases) == CHUNKS  # 8 files * 0.5
    assert all(kept) and tier.leases.honoured > 0
    tier, kept = _files_after_traffic(harnesses, tmp_path / "plain", None, file_bytes)
    assert tier.leases.sessions() == 0 and not any(kept)
