"""``tpu-offload-fs`` with the secret: only files signed with it are ours.

The attack this suite replays: another tenant with write access
to our keyed namespace (same uid) keeps magic-prefixed junk fresh under
names like ours. Without the key the CLI counted it against our budget and
kept it while ``evict --budget`` deleted our authenticated chunks, once a
file of the other tenant too; ``verify`` passed a forged file. With the key
the junk is never counted, never deleted, verify reports it and exits 1;
without the key, evict and verify refuse a keyed namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import xxhash

from fs_helpers import CHUNK, FILE, aligned, key, layout, payload
from tpu_offload.core.fs.cli import main
from tpu_offload.core.fs.format import HEADER_SIZE, MAC_OFF, MAGIC

SECRET = b"Mt0WaM8db/yeq0FyHGJxhx9/GNxYX5jMKSuvV3UTm08="  # 32 random bytes, base64
OTHER = b"iFn0RjsiLU0DHAyjHXImR0DKUw75GY+znkz2V02P+ZI="


def _tier(make_tier, root, secret, idx, salt=b"", fp=None):
    t = make_tier(root, secret=secret, fingerprint=fp)
    for i in idx:
        b = aligned()
        b[:] = payload(i)
        assert t.submit_write(key(i), b, salt).wait(30)
    assert t.flush(timeout=30)
    return t


def _secret_file(tmp_path, secret=SECRET) -> str:
    p = tmp_path / f"secret-{secret[:4].decode()}"
    p.write_bytes(secret + b"\n")
    os.chmod(p, 0o600)
    return str(p)


def _cli(capsys, *argv, env=None):
    code = main(list(argv), env={} if env is None else env)
    cap = capsys.readouterr()
    return code, (json.loads(cap.out) if "--json" in argv and cap.out.strip() else cap.out), cap.err


def _junk(ns_dir: str, n: int, size: int = FILE) -> list[str]:
    """Magic-prefixed junk under names like ours, kept fresh: what a tenant without the key can make."""
    out = []
    rng = np.random.default_rng(7)
    for i in range(n):
        name = rng.bytes(20).hex()
        d = os.path.join(ns_dir, name[:2], name[2:4])
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, name)
        with open(p, "wb") as f:
            f.write(MAGIC + rng.bytes(size - len(MAGIC)))
        out.append(p)
    return out


def _plant_random_mac(path: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[MAC_OFF:MAC_OFF + 32] = os.urandom(32)
    struct.pack_into("<Q", data, HEADER_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(data[: HEADER_SIZE - 8])))
    with open(path + ".x", "wb") as f:
        f.write(bytes(data))
    os.rename(path + ".x", path)


def _swap_payload_keep_header(path: str) -> None:
    """Our signed header, someone else's payload, the header's checksum field made to match (it is signed)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    evil = os.urandom(len(data) - HEADER_SIZE)
    data[HEADER_SIZE:] = evil
    struct.pack_into("<Q", data, 40, xxhash.xxh3_64_intdigest(evil))
    struct.pack_into("<Q", data, HEADER_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(data[: HEADER_SIZE - 8])))
    with open(path + ".x", "wb") as f:
        f.write(bytes(data))
    os.rename(path + ".x", path)


@pytest.fixture
def volume(root, make_tier, tmp_path):
    """Our 4 chunks, another tenant's 3 in its own keyed namespace, and 6 junk files in ours."""
    ours = _tier(make_tier, root, SECRET, range(4))
    theirs = _tier(make_tier, root, OTHER, range(10, 13))
    junk = _junk(ours.ns_dir, 6)
    return ours, theirs, junk, _secret_file(tmp_path)


def _files(ns_dir):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(ns_dir) for f in fs)


def test_with_the_key_junk_is_not_counted_and_evict_deletes_nothing_of_ours(capsys, volume):
    ours, theirs, junk, sf = volume
    root = os.path.dirname(ours.ns_dir)
    ours_before, theirs_before = _files(ours.ns_dir), _files(theirs.ns_dir)
    # A budget our 4 files fit under (high 90%) but not with the junk: nothing to evict.
    code, rep, _ = _cli(capsys, "evict", root, "--budget", str(5 * FILE), "--secret-file", sf, "--json")
    assert code == 0 and not rep["triggered"], rep
    ns = rep["namespaces"][os.path.basename(ours.ns_dir)]
    assert ns["used_before"] == 4 * FILE  # the junk is not counted
    assert rep["not_ours"] == 6 + 3  # the junk and the other tenant's (its signature is not ours)
    assert _files(ours.ns_dir) == ours_before and _files(theirs.ns_dir) == theirs_before
    # Over budget: only our authenticated chunks go, LRU first; junk and the other tenant stay.
    code, rep, _ = _cli(capsys, "evict", root, "--budget", str(3 * FILE), "--high", "90", "--low", "70",
                        "--secret-file", sf, "--json")
    assert code == 0 and rep["evicted_files"] == 2, rep
    assert all(os.path.exists(p) for p in junk), "another tenant's file was deleted"
    assert _files(theirs.ns_dir) == theirs_before
    assert sum(os.path.exists(ours.path_of(key(i))) for i in range(4)) == 2


def test_without_the_key_evict_and_verify_refuse_a_keyed_namespace(capsys, volume):
    ours, theirs, junk, _ = volume
    root = os.path.dirname(ours.ns_dir)
    before = _files(root)
    for argv in (("evict", root, "--budget", str(FILE)), ("verify", root), ("verify", root, "--delete")):
        code, _, err = _cli(capsys, *argv)
        assert code == 2, argv
        assert "keyed namespace" in err and "--secret-file" in err and "another tenant" in err
    assert _files(root) == before
    code, out, _ = _cli(capsys, "inspect", root, "--json")  # looking is allowed, and says it checked nothing
    assert code == 0
    assert {n["namespace"]: n["authenticated"] for n in out["namespaces"]} == {
        os.path.basename(ours.ns_dir): None, os.path.basename(theirs.ns_dir): None}


def test_inspect_with_the_key_counts_only_authenticated_files(capsys, volume):
    ours, theirs, junk, sf = volume
    code, out, _ = _cli(capsys, "inspect", os.path.dirname(ours.ns_dir), "--secret-file", sf, "--json")
    by = {n["namespace"]: n for n in out["namespaces"]}
    mine, other = by[os.path.basename(ours.ns_dir)], by[os.path.basename(theirs.ns_dir)]
    assert (mine["files"], mine["unauthenticated_files"], mine["bytes"]) == (4, 6, 4 * FILE)
    assert (other["files"], other["unauthenticated_files"]) == (0, 3)


def test_a_namespace_where_every_file_is_forged_is_reported_with_its_own_exit_code(capsys, volume):
    """Every file of our namespace swapped for a forgery: verify must not pass it in silence."""
    ours, theirs, junk, sf = volume
    for p in junk:
        os.unlink(p)
    shutil.rmtree(theirs.ns_dir)
    root = os.path.dirname(ours.ns_dir)
    code, out, err = _cli(capsys, "verify", root, "--secret-file", sf)
    assert code == 0, (out, err)
    for i in range(4):
        _swap_payload_keep_header(ours.path_of(key(i)))  # the header MAC no longer verifies: forged
    code, out, err = _cli(capsys, "verify", root, "--secret-file", sf)
    assert code == 6 and f"NOT OURS {os.path.basename(ours.ns_dir)}" in out + err


def test_verify_with_the_key_reports_forged_files_and_exits_1(capsys, volume):
    ours, theirs, junk, sf = volume
    root = os.path.dirname(ours.ns_dir)
    code, out, _ = _cli(capsys, "verify", root, "--namespace", os.path.basename(ours.ns_dir), "--secret-file", sf)
    assert code == 1 and "6 forged" in out  # the junk
    for p in junk:
        os.unlink(p)
    code, out, err = _cli(capsys, "verify", root, "--secret-file", sf, "--json")
    assert out["ok"] == 4 and out["checked"] == 4, out  # the other tenant's namespace is not judged ...
    assert code == 6 and out["foreign_namespaces"] == [os.path.basename(theirs.ns_dir)]  # ... but reported
    assert f"NOT OURS {os.path.basename(theirs.ns_dir)}" in err
    _plant_random_mac(ours.path_of(key(1)))  # a forged header MAC: verify must not pass it
    _swap_payload_keep_header(ours.path_of(key(2)))  # payload replaced, checksum fixed: breaks the header MAC
    code, out, _ = _cli(capsys, "verify", root, "--secret-file", sf, "--json", "--delete")
    assert code == 1 and out["forged"] == 2 and out["ok"] == 2, out
    # Our signed header with a payload not signed with it: our file, tampered; --delete removes it
    # (the tier would write over it). A header not signed by us: never ours to delete.
    assert not os.path.exists(ours.path_of(key(1)))
    assert os.path.exists(ours.path_of(key(2))), "a file not signed by us is not ours to delete"


def test_verify_checks_a_tenant_salt_in_full_only_when_given(capsys, root, make_tier, tmp_path):
    t = _tier(make_tier, root, SECRET, [1], salt=b"tenant-a")
    sf = _secret_file(tmp_path)
    code, out, _ = _cli(capsys, "verify", root, "--secret-file", sf, "--json")
    assert code == 0 and out["unverified_salt"] == 1 and out["ok"] == 0
    code, out, _ = _cli(capsys, "verify", root, "--secret-file", sf, "--salt", "tenant-a", "--json")
    assert code == 0 and out["ok"] == 1 and out["unverified_salt"] == 0
    with open(t.path_of(key(1), b"tenant-a"), "r+b") as f:  # damage the payload: its MAC catches it
        f.seek(HEADER_SIZE + 100)
        f.write(b"\xff" * 8)
    code, out, _ = _cli(capsys, "verify", root, "--secret-file", sf, "--salt", "tenant-a", "--json")
    assert code == 1 and out["bad"], out


def test_budgets_are_per_namespace_by_default(capsys, root, make_tier, tmp_path):
    a = _tier(make_tier, root, SECRET, range(3), fp=layout(model="org/a"))
    b = _tier(make_tier, root, SECRET, range(3), fp=layout(model="org/b"))
    sf = _secret_file(tmp_path)
    code, rep, _ = _cli(capsys, "evict", root, "--budget", str(4 * FILE), "--secret-file", sf, "--json")
    assert code == 0 and not rep["triggered"] and set(rep["namespaces"]) == {
        os.path.basename(a.ns_dir), os.path.basename(b.ns_dir)}
    code, rep, _ = _cli(capsys, "evict", root, "--budget", str(4 * FILE), "--budget-scope", "total",
                        "--secret-file", sf, "--json")
    assert code == 0 and rep["triggered"] and rep["evicted_files"] >= 2


def test_the_key_comes_from_the_connectors_settings_too(capsys, volume, tmp_path):
    ours, theirs, junk, sf = volume
    root = os.path.dirname(ours.ns_dir)
    cfg = tmp_path / "ktc.json"
    cfg.write_text(json.dumps({"kv_connector": "x", "kv_connector_extra_config": {"fs_secret_file": sf}}))
    for extra, env in ((("--config", str(cfg)), {}), ((), {"TPU_OFFLOAD_FS_SECRET_FILE": sf}),
                       ((), {"TPU_OFFLOAD_FS_SECRET": SECRET.decode()})):
        code, out, _ = _cli(capsys, "inspect", root, "--json", *extra, env=env)
        assert code == 0 and {n["namespace"]: n["files"] for n in out["namespaces"]}[
            os.path.basename(ours.ns_dir)] == 4, (extra, env)
    bad = tmp_path / "weak"
    bad.write_text("aaaaaaaaaaaaaaaaaaaa")
    code, _, err = _cli(capsys, "inspect", root, "--secret-file", str(bad))
    assert code == 2 and "32 random bytes" in err


def test_make_secret(capsys, tmp_path):
    p = tmp_path / "s"
    code, out, _ = _cli(capsys, "make-secret", str(p))
    assert code == 0 and oct(os.stat(p).st_mode & 0o777) == "0o600"
    code, _, err = _cli(capsys, "make-secret", str(p))  # never overwrites
    assert code == 2 and "must not exist" in err


@pytest.mark.parametrize("secret", [None, SECRET])
def test_copies_of_a_signed_file_under_temp_names_cost_evict_at_most_the_tiers_temp_cap(capsys, root, make_tier,
                                                                                        tmp_path, secret):
    """14 copies of one of our files under temp names (14 "writers"): the CLI counts them as the tier
    does (a quarter of the budget, newest first), deletes the rest first, and keeps most real chunks."""
    t = _tier(make_tier, root, secret, range(16))
    d = os.path.dirname(t.path_of(key(0)))
    copies = []
    for i in range(14):
        p = os.path.join(d, f".tmp.{key(0).hex()[:16]}.{900000 + i}.0badc0de.01234567.{i}")
        shutil.copyfile(t.path_of(key(0)), p)
        copies.append(p)
    t.close()
    argv = ["evict", root, "--budget", str(16 * FILE), "--json"]
    code, rep, _ = _cli(capsys, *argv, *(["--secret-file", _secret_file(tmp_path)] if secret else []))
    assert code == 0 and rep["triggered"] and rep["reached_low"], rep
    assert rep["temps_over_cap"] == 10 and rep["temps_over_cap_removed"] == 10, rep
    assert sum(os.path.exists(p) for p in copies) == 4
    # 16 chunks + 4 counted temps = 20 files against a low mark of 12.8: 8 chunks go, 8 stay (was 0).
    kept = sum(os.path.exists(t.path_of(key(i))) for i in range(16))
    assert kept == 8, rep
