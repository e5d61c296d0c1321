"""Resets (a weight update): replicas that reset together keep sharing, and no namespace is leaked."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from fs_helpers import FILE, filled, key, layout, payload, write_all
from tpu_offload.connector.fs import FsMover, reset_salt, salted
from tpu_offload.core.config import OffloadConfig


def _files(ns_dir):
    return sorted(f for _, _, fs in os.walk(ns_dir) for f in fs if not f.startswith(".tmp."))


def test_retire_deletes_the_namespace_files_ours_and_other_instances_but_not_foreign(root, make_tier):
    a, b = make_tier(root), make_tier(root)
    write_all(a, 1, 2)
    write_all(b, 3)  # another replica's, in the same namespace
    theirs = os.path.join(a.ns_dir, "ee", "ee", "ee" * 36)
    os.makedirs(os.path.dirname(theirs))
    with open(theirs, "wb") as f:
        f.write(b"not ours" * 100)
    assert a.retire(timeout=10) == 3
    assert _files(a.ns_dir) == ["ee" * 36], "a reset leaked files, or deleted someone else's"


def test_replicas_resetting_to_one_epoch_share_a_namespace(tmp_path, caplog):
    epoch = tmp_path / "epoch"
    epoch.write_text("weights-v7\n")
    cfg = OffloadConfig(fs_reset_epoch_file=str(epoch))
    s1, s2 = reset_salt(cfg, ""), reset_salt(cfg, "")  # two replicas
    assert s1 == s2 and s1.startswith("epoch-") and "weights" not in s1
    epoch.write_text("weights-v8")
    s3 = reset_salt(cfg, s1)
    assert s3 != s1 and s3 == reset_salt(cfg, "")
    with caplog.at_level(logging.WARNING):
        s4 = reset_salt(cfg, s3)  # not bumped: reusing the salt would serve the old weights' KV
        s5 = reset_salt(OffloadConfig(), "")
    assert s4 not in (s3, "") and s5 != reset_salt(OffloadConfig(), "")
    assert sum("random namespace" in r.getMessage() for r in caplog.records) >= 2


def test_epoch_file_setting_is_an_absolute_path():
    import pytest
    from tpu_offload.core.config import ConfigError

    assert OffloadConfig.from_sources({"fs_reset_epoch_file": "/run/epoch"}, env={}).fs_reset_epoch_file == "/run/epoch"
    with pytest.raises(ConfigError, match="fs_reset_epoch_file"):
        OffloadConfig.from_sources({"fs_reset_epoch_file": "epoch"}, env={})


class _Engine:
    """The two things ``FsMover`` reads of the host engine: a slot's views and validity."""

    def __init__(self, slots, nbytes):
        self.rows = [np.zeros(nbytes, np.uint8) for _ in range(slots)]
        self.valid = np.ones(slots, bool)

    def row_views(self, slot):
        return [self.rows[slot]]


def test_five_resets_leave_no_old_namespace_behind(root):
    chunk = FILE - 4096
    cfg = OffloadConfig(shared_storage_path=root, fs_capacity_bytes=8 * FILE, fs_allow_unauthenticated=True)
    eng = _Engine(4, chunk)
    mover = FsMover(cfg, layout(), eng)
    namespaces = [mover.tier.ns_dir]
    try:
        for r in range(5):
            for s in range(4):
                eng.rows[s][:] = payload(10 * r + s, chunk)
                mover.write(key(10 * r + s), s)
            assert mover.tier.flush(10)
            mover.reset(f"salt{r}")
            namespaces.append(mover.tier.ns_dir)
        assert namespaces[-1] == os.path.join(root, salted(layout(), "salt4").namespace())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_files(ns) for ns in namespaces[:-1]):
            time.sleep(0.05)
        assert [len(_files(ns)) for ns in namespaces[:-1]] == [0] * 5, "a reset leaked its namespace's files"
    finally:
        mover.close(timeout=10)
