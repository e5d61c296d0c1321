"""Damaged, foreign and half-written files: always a counted miss, never bytes."""

from __future__ import annotations

import json
import os
import signal
import struct
import time

import numpy as np
import pytest

from fs_helpers import CHUNK, aligned, key, layout, payload, run_child
from tpu_offload.core.fs import admin
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.fileio import aligned_empty
from tpu_offload.core.fs.format import HEADER_SIZE, VERSION, pack_header, payload_checksum


def _published(tier, i):
    buf = aligned()
    buf[:] = payload(i)
    assert tier.submit_write(key(i), buf).wait(30)
    return tier.path_of(key(i))


def _patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _expect_rejected(tier, i, reason, quarantined=False):
    out = aligned()
    out[:] = 0xAB
    path = tier.path_of(key(i))
    assert tier.read_into(key(i), out) is False
    assert tier.counters()[f"corrupt_{reason}"] >= 1
    if reason == "magic":  # without our magic it is someone else's file: a miss, left where it is
        assert os.path.exists(path)
        return
    assert not os.path.exists(path), "a rejected file must leave the lookup path"
    assert not tier.contains(key(i))
    assert tier.read_into(key(i), out) is False  # now a plain miss
    qdir = os.path.join(tier.ns_dir, fslayout.QUARANTINE)
    q = os.listdir(qdir) if os.path.isdir(qdir) else []
    assert any(n.startswith(key(i).hex()) and reason in n for n in q) == quarantined


@pytest.mark.parametrize("offset,reason", [
    (HEADER_SIZE, "checksum"),            # first payload byte
    (HEADER_SIZE + CHUNK - 1, "checksum"),  # last payload byte
    (HEADER_SIZE + CHUNK // 2, "checksum"),
    (0, "magic"),
    (20, "header_checksum"),              # inside the layout digest
    (33, "header_checksum"),              # payload length
    (52, "header_checksum"),              # inside the key
    (4090, "header_checksum"),            # the header checksum itself
])
def test_flipped_bytes(root, make_tier, offset, reason):
    t = make_tier(root)
    _flip(_published(t, 1), offset)
    _expect_rejected(t, 1, reason)


@pytest.mark.parametrize("size,reason", [(0, "truncated"), (100, "truncated"),
                                         (HEADER_SIZE, "truncated"), (HEADER_SIZE + CHUNK - 1, "truncated")])
def test_truncated(root, make_tier, size, reason):
    t = make_tier(root)
    os.truncate(_published(t, 2), size)
    _expect_rejected(t, 2, reason)


def test_quarantine_keeps_the_bad_file_aside(root, make_tier):
    t = make_tier(root, quarantine=True)
    _flip(_published(t, 3), HEADER_SIZE + 10)
    _expect_rejected(t, 3, "checksum", quarantined=True)


def _rewrite_header(path, *, version=VERSION, digest=None, key_bytes=None, payload_len=CHUNK):
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        body = f.read()
    hdr = aligned_empty(HEADER_SIZE)
    pack_header(hdr, digest or layout().digest(), key_bytes, payload_len, payload_checksum(body))
    if version != VERSION:  # a well-formed header of another format version
        struct.pack_into("<H", hdr, 8, version)
    _patch(path, 0, hdr.tobytes())


def test_foreign_format_version(root, make_tier):
    t = make_tier(root)
    _rewrite_header(_published(t, 4), version=VERSION + 1, key_bytes=key(4))
    _expect_rejected(t, 4, "version")


def test_foreign_layout(root, make_tier):
    """A file of another layout placed where ours would be (copied by hand)."""
    t = make_tier(root)
    _rewrite_header(_published(t, 5), digest=layout(dtype="float16").digest(), key_bytes=key(5))
    _expect_rejected(t, 5, "layout")


def test_file_under_the_wrong_key(root, make_tier):
    t = make_tier(root)
    src = _published(t, 6)
    dst = t.path_of(key(7))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)
    _expect_rejected(t, 7, "key")


def test_another_layout_never_sees_our_files(root, make_tier):
    ours = make_tier(root)
    _published(ours, 8)
    theirs = make_tier(root, fingerprint=layout(tp_rank=1, tp_size=2))
    assert theirs.ns_dir != ours.ns_dir
    assert not theirs.contains(key(8)) and theirs.read_into(key(8), aligned()) is False


_KILL_CHILD = r"""
import os, sys, time, numpy as np
from prometheus_client import CollectorRegistry
from fs_helpers import aligned, key, layout, payload
from tpu_offload.core.fs import FileTier, FsMetrics
root, mode = sys.argv[1], sys.argv[2]
t = FileTier(root, layout(), int(sys.argv[3]), capacity_bytes=None, threads=2, fs_metrics=FsMetrics(CollectorRegistry()))
if mode == "pause":
    def hold(tmp):
        print("PAUSED", tmp, flush=True)
        time.sleep(600)
    t.files.before_publish = hold
    buf = aligned(int(sys.argv[3])); buf[:] = 7
    t.submit_write(key(1), buf)
    time.sleep(600)
else:  # stream large writes until killed
    i = 0
    n = int(sys.argv[3])
    bufs = [aligned(n) for _ in range(4)]
    for j, b in enumerate(bufs):
        b[:] = np.random.default_rng(j).integers(0, 256, n, dtype=np.uint8)
    while True:
        tk = [t.submit_write(key(i + j), bufs[(i + j) % 4]) for j in range(4)]
        for x in tk:
            if x is not None:
                x.wait()
        print("DONE", i + 3, flush=True)
        i += 4
"""


def _spawn(code, *args):
    import subprocess
    import sys

    from fs_helpers import REPO, child_env
    env = child_env()
    env["PYTHONPATH"] = os.path.join(REPO, "tests", "fs") + os.pathsep + env["PYTHONPATH"]
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_sigkill_before_publish_leaves_only_an_invisible_temp(root, make_tier):
    big = 32 << 20
    p = _spawn(_KILL_CHILD, root, "pause", str(big))
    try:
        line = p.stdout.readline()
        assert line.startswith("PAUSED"), (line, p.stderr.read() if p.poll() is not None else "")
        tmp = line.split()[1]
        assert os.path.getsize(tmp) == HEADER_SIZE + big  # fully written, not yet renamed
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert p.returncode == -signal.SIGKILL
    t = make_tier(root, chunk_bytes=big, stale_tmp_s=600)
    assert not t.contains(key(1)) and t.read_into(key(1), aligned(big)) is False
    # Young, but its writer ran on this host and is gone: reaped at once (tests/fs/test_fs_budget.py).
    assert not os.path.exists(tmp) and t.counters()["dead_temps_removed"] == 1
    assert t.keys_lru_order() == []


def test_sigkill_mid_stream_never_exposes_partial_files(root, make_tier):
    n = 8 << 20
    p = _spawn(_KILL_CHILD, root, "stream", str(n))
    try:
        assert p.stdout.readline().startswith("DONE"), p.stderr.read() if p.poll() is not None else ""
        time.sleep(0.15)  # kill at an arbitrary point of a later batch
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    t = make_tier(root, chunk_bytes=n, stale_tmp_s=0)  # reaps the dead writer's temps
    scan = fslayout.scan_namespace(t.ns_dir)
    assert scan.temps == []
    rep = admin.verify(root)
    assert rep.bad == [] and rep.ok == len(scan.chunks) >= 4
    expected = [np.random.default_rng(j).integers(0, 256, n, dtype=np.uint8) for j in range(4)]
    out = aligned(n)
    hits = 0
    for i in range(len(scan.chunks) + 8):
        if t.read_into(key(i), out):
            hits += 1
            assert np.array_equal(out, expected[i % 4])
    assert hits == len(scan.chunks)


def test_stale_temps_survive_a_young_age_limit_via_cli(root, make_tier):
    t = make_tier(root)
    _published(t, 1)
    d = os.path.dirname(t.path_of(key(1)))
    tmp = os.path.join(d, ".tmp.0000.1.cafe")
    open(tmp, "wb").close()
    r = run_child("from tpu_offload.core.fs.cli import main; import sys; sys.exit(main(sys.argv[1:]))",
                  "evict", root, "--budget", "1TiB", "--tmp-age", "3600", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["temps_removed"] == 0 and os.path.exists(tmp)
