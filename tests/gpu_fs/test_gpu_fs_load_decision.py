"""The load decision in the real vLLM engine: as the file tier slows, hits move from load to recompute,
with the tokens of no connector, and no request waits for the slow mount.

``a`` publishes the chunks of two prompts; each replica (``load_decision: auto``) then runs a cold
prompt (its prefill teaches the engine's time per token) with the first prompt, then the second
prompt, whose hit the decision is measured on. Every file read of the slow replica is delayed at the
tier's syscall wrapper (``fileio.fault``, as in ``test_gpu_fs_hang.py``): its probe prices the mount
before the first prompt (a probe read still outstanding counts as at least its age) or the hedge gives
the load up at its recompute time, so neither prompt waits for a read; the unthrottled replica loads both.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_fs_helpers import EngineRun, shipped_kv_transfer_config

pytestmark = pytest.mark.engine
DELAY_S = 10.0  # per file read of the slow replica (well above a recompute even on a loaded 2-core machine)
DEADLINE_S = 30.0


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


COLD, P1, P2 = ids(30, 300), ids(31, 520), ids(32, 520)  # P1, P2: 2 chunks of 256 tokens each


def test_decision_moves_from_load_to_recompute_as_the_file_tier_slows(fs_model_dir, tmp_path):
    shared = tmp_path / "shared"
    steps = [{"prompts": [COLD, P1]}, {"prompts": [P2]}]
    ref_run = EngineRun(tmp_path, "ref", fs_model_dir, None, steps)  # beside ``a``; the replicas run alone
    a = EngineRun(tmp_path, "a", fs_model_dir, shipped_kv_transfer_config(shared), [{"prompts": [P1, P2]}]).result()
    ref = ref_run.result()
    assert len(a["steps"][0]["new_files"]) == 4
    auto = {"load_decision": "auto", "load_decision_bias": 0.5, "fs_io_timeout_s": DEADLINE_S}
    slow = EngineRun(tmp_path, "slow", fs_model_dir, shipped_kv_transfer_config(shared, **auto), steps,
                     fault={"op": "read", "hang_s": DELAY_S}).result()
    fast = EngineRun(tmp_path, "fast", fs_model_dir, shipped_kv_transfer_config(shared, **auto), steps).result()
    for run in (fast, slow):
        assert [s["outputs"] for s in run["steps"]] == [s["outputs"] for s in ref["steps"]]  # no-connector tokens
        # prefill timed from each step's scheduling to the worker report echoing its id
        assert run["steps"][0]["prefill_echoed"]
    assert fast["steps"][0]["fs_hits"] >= 2  # P1 loaded from files
    assert fast["steps"][0]["load_error_blocks"] == 0
    # the first request after start included: nothing waits for a slow read (probe or hedge)
    assert all(s["step_s"] < DELAY_S / 2 for s in slow["steps"]), slow["steps"]
    # The premise: recomputing P2's 512 tokens takes well under what the slow tier took for P1's two chunks.
    assert ref["steps"][1]["step_s"] < DELAY_S / 2, ref["steps"]
    assert fast["steps"][1]["fs_hits"] == 2, fast["steps"]
    assert fast["steps"][1]["decisions"].get("load/auto/fs", 0) >= 512
    assert slow["steps"][1]["fs_hits"] == 0, slow["steps"]
    assert slow["steps"][1]["decisions"].get("recompute/auto/fs", 0) >= 512, slow["steps"]
    assert slow["steps"][1]["load_error_blocks"] == 0
