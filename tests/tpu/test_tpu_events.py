"""The TPU connector's KV-event translation for the file tier (medium STORAGE).

The real-engine check is tests/tpu_engine/test_tpu_engine_files.py (write-through); these pin
what a short engine run does not reach: a write-back file landing after its chunk left host
RAM, retraction on removal and on a cache reset, and the announcement cap.
"""

from __future__ import annotations

from types import SimpleNamespace

from tpu_offload.connector.compat import maybe_convert_block_hash as ext
from tpu_offload.connector.events import EventTranslator
from tpu_offload.core.keys import make_chunk_key
from tpu_offload.core.manager import ChunkEvent, Medium

BS = 4


def request(n_blocks: int):
    return SimpleNamespace(block_hashes=[bytes([i + 1]) * 32 for i in range(n_blocks)],
                           all_token_ids=list(range(100, 100 + n_blocks * BS)), lora_request=None)


def keyed(req, i):
    return make_chunk_key(req.block_hashes[i])


def kinds(events):
    return [(type(e).__name__, e.medium, len(e.token_ids) if hasattr(e, "token_ids") else None) for e in events]


def test_a_write_back_file_after_the_host_eviction_keeps_its_payload():
    t = EventTranslator(BS, 1)
    req = request(2)
    k0, k1 = keyed(req, 0), keyed(req, 1)
    t.record(k0, req, 0)
    t.record(k1, req, 1)
    t.translate([ChunkEvent((k0, k1), Medium.CPU, False)])
    out = t.translate([ChunkEvent((k1,), Medium.CPU, True)])  # evicted; its write-back is still queued
    assert kinds(out) == [("BlockRemoved", "CPU", None)]
    t.files([k1], [])
    out = t.translate([])
    assert kinds(out) == [("BlockStored", "STORAGE", BS)]
    assert out[0].parent_block_hash == ext(req.block_hashes[0]) and out[0].token_ids == req.all_token_ids[BS:]
    t.files([], [k1])
    out = t.translate([])
    assert kinds(out) == [("BlockRemoved", "STORAGE", None)] and out[0].block_hashes == [ext(req.block_hashes[1])]
    assert t.partial_file_events == 0


def test_a_reset_retracts_every_announced_file():
    t = EventTranslator(BS, 1)
    req = request(3)
    keys = [keyed(req, i) for i in range(3)]
    for i, k in enumerate(keys):
        t.record(k, req, i)
    t.translate([ChunkEvent(tuple(keys), Medium.CPU, False)])
    t.files(keys, [])
    t.translate([])
    t.reset()  # the file tier moves to a salted namespace: none of these files is found again
    out = t.translate([ChunkEvent(tuple(keys), Medium.CPU, True)])
    assert sorted(kinds(out)) == sorted([("BlockRemoved", "CPU", None)] + [("BlockRemoved", "STORAGE", None)] * 3)


def test_announcements_are_capped_oldest_retracted_first():
    t = EventTranslator(BS, 1, max_files=2)
    req = request(3)
    keys = [keyed(req, i) for i in range(3)]
    t.files(keys, [])  # files found with no host payload: key-only, and counted
    out = t.translate([])
    assert kinds(out) == [("BlockStored", "STORAGE", 0)] * 3 + [("BlockRemoved", "STORAGE", None)]
    assert [e.block_hashes for e in out if type(e).__name__ == "BlockRemoved"] == [[ext(req.block_hashes[0])]]
    assert t.partial_file_events == 3
