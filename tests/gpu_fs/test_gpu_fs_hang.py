"""A hung mount in the real vLLM engine: a request whose chunk reads hang completes with the
tokens of no connector, within ``fs_io_timeout_s`` plus its recompute.

``a`` publishes the prompts' chunks (the shipped config, write-through); ``h`` is a fresh
replica with the same files whose every file read hangs for 20 s (injected at the tier's
syscall wrapper, ``fileio.fault``: FUSE cannot be mounted here); ``ref`` runs without a
connector. ``h``'s scheduler sees the files, plans loads, the reads pass their 1 s deadline,
the loads are reported failed and vLLM recomputes. ``h`` loads every hit (``load_decision: always``):
the deadline is what bounds a read there. Under the default (``auto``) the hedge gives up a hung
read sooner (``test_gpu_fs_load_decision_hedge.py``; on tpu-inference, ``test_tpu_engine_files.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_fs_helpers import EngineRun, shipped_kv_transfer_config

pytestmark = pytest.mark.engine
DEADLINE_S = 1.0
HANG_S = 20.0


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


P = [ids(11, 520), ids(12, 300)]  # 2 + 1 shipped chunks (256 tokens)


def test_a_hung_read_costs_a_recompute_not_a_hung_request(fs_model_dir, tmp_path):
    shared = tmp_path / "shared"
    ref_run = EngineRun(tmp_path, "ref", fs_model_dir, None, [{"prompts": P}, {"prompts": P}])  # beside ``a``
    a = EngineRun(tmp_path, "a", fs_model_dir, shipped_kv_transfer_config(shared), [{"prompts": P}]).result()
    ref = ref_run.result()
    assert len(a["steps"][0]["new_files"]) == 3
    ktc = shipped_kv_transfer_config(shared, fs_io_timeout_s=DEADLINE_S, load_decision="always")
    h = EngineRun(tmp_path, "h", fs_model_dir, ktc, [{"prompts": P}], fault={"op": "read", "hang_s": HANG_S}).result()
    step = h["steps"][0]
    assert step["outputs"] == ref["steps"][0]["outputs"]  # identical to no connector
    assert step["fs_hits"] == 3 and step["load_error_blocks"] > 0  # planned from files, failed, recomputed
    assert h["tier_counters"]["read_timeouts"] == 3
    # Within the deadline plus the recompute (ref's second step: the same prompts, warm engine), with slack
    # for this shared 2-core machine; a hung request would take HANG_S or forever.
    assert step["step_s"] < DEADLINE_S + ref["steps"][1]["step_s"] + 5.0 < HANG_S, (step["step_s"], ref["steps"])
