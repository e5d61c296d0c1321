"""Two tenants on one shared directory with one deployment secret, on the TPU connector.

Tenant A's requests carry ``cache_salt="tenant-a"``, tenant B's
``"tenant-b"``. With the file tier's secret, each request's files are named,
signed and verified with keys derived from the secret and its salt
(``core/fs/auth.py``), as on vLLM: the salt travels from the scheduler (which
sees vLLM's ``Request``) to the worker in every store, promotion and
write-back order. B holds the deployment secret and can write the
directory (same uid, as on a shared PVC); it learns A's chunk keys but not
A's salt. Its forged chunks, validly signed with its own keys or the
deployment's, are misses counted in ``tpu_offload_fs_auth_failures_total``;
the stand-in forward checks every KV position A reads, so a forged hit would
fail the run.
"""

import functools
import os

import numpy as np
import pytest

from tpu_standin import chunk_files, prompt

pytestmark = pytest.mark.engine

BS = 16
A, B = "tenant-a", "tenant-b"


@pytest.fixture
def make(fs_harness, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("ZkX1m9V0pT3qR7wN5sL2hB8cD4fJ6gYa0eU1iO3kP5s=\n")  # 32 random bytes, base64
    os.chmod(secret, 0o600)
    return functools.partial(fs_harness, staging_blocks=8, blocks_per_chunk=2, fs_write_mode="write_through",
                             fs_secret_file=str(secret))


def auth_metric(h) -> float:
    return sum(s.value for fam in h.wrk.fs.tier.fs_metrics.registry.collect() for s in fam.samples
               if s.name == "tpu_offload_fs_auth_failures_total")


def matched(h) -> list:
    seen = []
    orig = h.conn_s.get_num_new_matched_tokens
    h.conn_s.get_num_new_matched_tokens = lambda r, n: seen.append(orig(r, n)) or seen[-1]
    return seen


def run(h, p, salt, max_tokens=2):
    rid = h.add(p, max_tokens=max_tokens, cache_salt=salt)
    h.run()
    assert h.wrk.fs.pending_writes() == 0 and h.wrk.fs.tier.flush(timeout=30)
    return h.finished[rid]


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
def test_tenants_files_are_their_own_and_forgeries_are_misses(make, tmp_path, mode):
    p = prompt(4 * 2 * BS, 21)  # 4 chunks
    extra = {"fs_write_mode": mode} if mode == "write_through" else {"fs_write_mode": mode, "num_cpu_chunks": 4}
    a = make(**extra)
    out_a = run(a, p, A)
    if mode == "write_back":  # another prompt evicts p's chunks from the host tier (4): written back, A's keys
        a.add(prompt(4 * 2 * BS, 22), max_tokens=1, cache_salt=A)
        a.run()
        assert a.wrk.fs.tier.flush(timeout=30)
    keys_a = [k for k, toks in a.tokens.items() if toks == p[: len(toks)]]
    assert len(keys_a) == 4
    tier = a.wrk.fs.tier
    ns = tier.ns_dir
    name = lambda k, salt: os.path.basename(tier.path_of(k, salt))  # noqa: E731
    files_a = set(chunk_files(ns))
    assert {name(k, A.encode()) for k in keys_a} <= files_a, "A's files are not named with A's keys"
    assert not {name(k, b"") for k in keys_a} & files_a, "A's files use the deployment's keys"

    b = make(**extra)
    hits_b = matched(b)
    out_b = run(b, p, B)
    assert hits_b[0] == (0, False) and b.wrk.totals.get("loaded_chunks", 0) == 0  # B found nothing of A's
    assert out_b == out_a  # the same prompt, recomputed
    assert not any(b.sch.fs.contains(k, B.encode()) for k in keys_a)  # A's keys alone are not enough
    if mode == "write_through":
        assert set(chunk_files(ns)) - files_a, "B wrote no files of its own"

    # B forges A's chunks: files for A's keys under the names A uses (it lists them), with a payload of
    # its choice, signed with its own keys (first two) or the deployment's (last two); and valid files
    # for A's keys under the deployment's names (where a connector without per-deployment keys would look).
    forger = b.wrk.fs.tier
    evil = np.random.default_rng(666).integers(0, 256, forger.chunk_bytes, dtype=np.uint8)
    for i, k in enumerate(keys_a):
        salt = B.encode() if i < 2 else b""
        fid = bytes.fromhex(name(k, A.encode()))
        assert forger.files.write(fid, fid.hex(), memoryview(evil), tk=forger._keys(salt)) is None
        assert forger.submit_write(k, evil) is not None
    assert forger.flush(timeout=30)
    assert all(os.path.exists(tier.path_of(k, b"")) for k in keys_a)

    a2 = make(**extra)
    before = auth_metric(a2)
    hits = matched(a2)
    out_a2 = run(a2, p, A)  # the forward checks every position: a forged hit would raise here
    assert hits[0] == (len(p) - 1, True)  # the forged files look present...
    assert a2.wrk.totals.get("loaded_chunks", 0) == 0  # ...and none was served
    assert a2.wrk.fs.tier.counters()["auth_failures"] == 4 and auth_metric(a2) - before == 4
    assert out_a2 == out_a
    assert a2.check_tier() >= 2  # what it recomputed and stored is the right KV
    assert all(os.path.exists(tier.path_of(k, A.encode())) for k in keys_a), "not ours to delete"
