"""The scan actions the tier and the CLI share (``actions``): each acts only on the file scanned."""

from __future__ import annotations

import os
import time

import pytest

from fs_helpers import aligned, key
from tpu_offload.core.fs import actions, layout as fslayout


def _written(make_tier, root, *idx):
    t = make_tier(root)
    for i in idx:
        assert t.submit_write(key(i), aligned()).wait(10)
    return t


def test_unlink_found_spares_a_file_used_or_replaced_since_the_scan(root, make_tier):
    t = _written(make_tier, root, 1, 2)
    found = {f.name: f for f in fslayout.scan_namespace(t.ns_dir).chunks}
    k1, k2 = fslayout.key_hex(key(1)), fslayout.key_hex(key(2))
    later = time.time() + 5
    os.utime(t.path_of(key(1)), (later, later))  # restamped by a reader after the scan
    assert not actions.unlink_found(t.ns_dir, found[k1]) and os.path.exists(t.path_of(key(1)))
    assert actions.unlink_found(t.ns_dir, found[k2]) and not os.path.exists(t.path_of(key(2)))
    assert not actions.unlink_found(t.ns_dir, found[k2])  # gone already: someone else's delete


def test_restamp_and_quarantine_act_on_that_file_only(root, make_tier):
    t = _written(make_tier, root, 1)
    kh, path = fslayout.key_hex(key(1)), t.path_of(key(1))
    dirs = fslayout.chunk_relpath(kh)[:2]
    future = time.time() + 86400
    os.utime(path, (future, future))
    now = actions.server_now(t.ns_dir)
    assert now is not None and actions.in_future(os.stat(path).st_mtime, now)
    st = actions.restamp(t.ns_dir, dirs, kh, now)
    assert st is not None and not actions.in_future(st.st_mtime, now)
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not actions.quarantine(t.ns_dir, d, kh, st.st_ino + 1, "checksum")  # another inode now
        assert actions.quarantine(t.ns_dir, d, kh, st.st_ino, "checksum (bad)")
    finally:
        os.close(d)
    q = fslayout.scan_namespace(t.ns_dir)
    assert [f.name for f in q.quarantined] == [f"{kh}.checksum.{os.getpid()}"] and not q.foreign


def test_restamp_never_goes_through_a_symlinked_fanout(root, make_tier, tmp_path):
    t = _written(make_tier, root, 1)
    kh = fslayout.key_hex(key(1))
    d = os.path.dirname(t.path_of(key(1)))
    os.rename(d, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", d)
    before = os.stat(tmp_path / "elsewhere" / kh).st_mtime
    with pytest.raises(OSError):
        actions.restamp(t.ns_dir, fslayout.chunk_relpath(kh)[:2], kh, time.time() - 3600)
    assert os.stat(tmp_path / "elsewhere" / kh).st_mtime == before
