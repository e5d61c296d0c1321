"""The scrypt salt per deployment: made once in the shared directory, shared by every replica and the CLI.

Why: with one fixed salt a dictionary of candidate secrets computed once
serves every deployment. Each test fails on a tier whose salt is a constant.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading

import numpy as np
import pytest

from fs_helpers import aligned, key, layout, payload, write_all
from tpu_offload.core.fs import kdfsalt
from tpu_offload.core.fs.auth import FsAuth
from tpu_offload.core.fs.cli import main

SECRET = b"1BcfxCZ6L5sgxr5a00FSSelvv+17IUMhrwMy+RWd+I0="  # 32 random bytes, base64
OTHER_SECRET = b"Tvg5s8Y1km2aGL7tigmImQcyDpREuVt6j9fqICZvOqA="


def _read(t, i):
    out = aligned()
    return t.read_into(key(i), out), out


def test_two_deployments_with_one_secret_derive_different_names(tmp_path, make_tier):
    """Same secret, same model, two shared directories: nothing public is the same (no shared dictionary)."""
    a = make_tier(str(tmp_path / "a"), secret=SECRET)
    b = make_tier(str(tmp_path / "b"), secret=SECRET)
    assert os.path.basename(a.ns_dir) != os.path.basename(b.ns_dir)
    assert os.path.basename(a.ns_dir) != FsAuth(SECRET).namespace(layout().digest())  # not the fixed salt
    for t in (a, b):
        p = os.path.join(t.root, kdfsalt.SALT_FILE)
        st = os.lstat(p)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
        assert open(p, "rb").read().startswith(b"tpu-offload-fs-salt v1 ")


def test_replicas_share_the_first_salt_and_the_cli_verifies_with_it(root, make_tier, tmp_path, capsys):
    a = make_tier(root, secret=SECRET)
    write_all(a, 1, 2)
    salt_file = open(os.path.join(root, kdfsalt.SALT_FILE), "rb").read()
    b = make_tier(root, secret=SECRET)
    ok, out = _read(b, 1)
    assert ok and np.array_equal(out, payload(1)) and b.ns_dir == a.ns_dir
    assert open(os.path.join(root, kdfsalt.SALT_FILE), "rb").read() == salt_file  # made once
    assert a.flush(timeout=30)
    sf = tmp_path / "secret"
    sf.write_bytes(SECRET + b"\n")
    os.chmod(sf, 0o600)
    assert main(["verify", root, "--secret-file", str(sf), "--json"], env={}) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["checked"] == 2 and rep["ok"] == 2 and not rep["forged"], rep


def test_racing_first_replicas_all_get_one_salt(root):
    got, barrier = [], threading.Barrier(8)

    def one():
        barrier.wait()
        got.append(kdfsalt.auth_for_root(SECRET, root).kdf_salt)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(got) == 8 and len(set(got)) == 1
    assert sorted(os.listdir(root)) == [kdfsalt.SALT_FILE]  # no temp left behind


@pytest.mark.parametrize("plant", ["garbage", "unvouched", "other_secret", "symlink", "fifo"])
def test_a_salt_file_not_vouched_for_by_our_secret_is_refused_with_one_warning(root, tmp_path, make_tier,
                                                                               caplog, plant):
    """Planted before our first start (to choose the salt), or made by another deployment: not used."""
    p = os.path.join(root, kdfsalt.SALT_FILE)
    if plant == "garbage":
        open(p, "wb").write(b"hello\n")
    elif plant == "unvouched":  # a salt of the planter's choice, a check value made up
        open(p, "wb").write(b"tpu-offload-fs-salt v1 " + b"00" * 32 + b" " + b"11" * 16 + b"\n")
    elif plant == "other_secret":
        kdfsalt.auth_for_root(OTHER_SECRET, root)
    elif plant == "symlink":
        target = tmp_path / "elsewhere"
        kdfsalt.auth_for_root(SECRET, str(tmp_path))  # a valid salt file of ours, but not here
        os.rename(tmp_path / kdfsalt.SALT_FILE, target)
        os.symlink(target, p)
    else:
        os.mkfifo(p)
    before = os.lstat(p)
    with caplog.at_level(logging.WARNING, logger="tpu_offload.auth"):
        t = make_tier(root, secret=SECRET)
        make_tier(root, secret=SECRET)
    msgs = [r.getMessage() for r in caplog.records if kdfsalt.SALT_FILE in r.getMessage()]
    assert len(msgs) == 1 and "fixed salt" in msgs[0], msgs
    assert os.path.basename(t.ns_dir) == FsAuth(SECRET).namespace(layout().digest())
    write_all(t, 1)
    assert _read(t, 1)[0]  # the tier works, on the fixed salt
    assert os.lstat(p).st_ino == before.st_ino  # never replaced: it may be another deployment's


def test_the_cli_without_a_salt_file_uses_the_fixed_salt_and_creates_nothing(root, tmp_path):
    from tpu_offload.core.fs.keyring import Keyring

    k = Keyring(SECRET).at(root)
    assert k.auth.kdf_salt == FsAuth(SECRET).kdf_salt
    assert os.listdir(root) == []


def test_a_filesystem_without_hard_links_still_gets_one_salt(root, monkeypatch):
    import errno

    def no_link(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    first = kdfsalt.auth_for_root(SECRET, root).kdf_salt
    assert first != FsAuth(SECRET).kdf_salt
    assert kdfsalt.auth_for_root(SECRET, root).kdf_salt == first
    assert sorted(os.listdir(root)) == [kdfsalt.SALT_FILE]
