"""One forged file must not disable a chunk for good (TPU connector, stand-in engine).

A same-uid tenant without the secret swaps a hot chunk's file for a
same-size file with a random MAC. A replica that needs the prefix plans a
load from it (a stat cannot tell), the read fails its MAC, the request
recomputes, and its store writes the chunk over the forged file. The next
requests and a fresh replica load our file again.
"""

from __future__ import annotations

import functools
import os
import struct

import pytest
import xxhash

from tpu_offload.core.fs.format import HEADER_SIZE, MAC_OFF
from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture
def make(fs_harness):
    return functools.partial(fs_harness, staging_blocks=8, blocks_per_chunk=2, fs_write_mode="write_through")


def run(h, p, max_tokens=2):
    rid = h.add(p, max_tokens=max_tokens)
    h.run()
    assert h.wrk.fs.pending_writes() == 0 and h.wrk.fs.tier.flush(timeout=30)
    return h.finished[rid]


def plant_random_mac(path: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[MAC_OFF:MAC_OFF + 32] = os.urandom(32)
    struct.pack_into("<Q", data, HEADER_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(data[: HEADER_SIZE - 8])))
    with open(path + ".forging", "wb") as f:
        f.write(bytes(data))
    os.rename(path + ".forging", path)


def test_a_forged_hot_chunk_is_ours_again_after_one_recompute(make):
    p = prompt(4 * 2 * BS, 31)  # 4 chunks
    a = make()
    out = run(a, p)
    keys = sorted((k for k, toks in a.tokens.items() if toks == p[: len(toks)]), key=lambda k: len(a.tokens[k]))
    assert len(keys) == 4
    path = a.wrk.fs.tier.path_of(keys[0])  # the hot one: every request for the prefix needs it
    assert a.wrk.fs.tier.authenticated
    plant_random_mac(path)
    forged = os.stat(path).st_ino

    b = make()  # a replica whose host tier is empty: it must load from files
    outs = [run(b, p) for _ in range(5)]
    assert outs == [out] * 5
    tier = b.wrk.fs.tier
    assert tier.counters()["auth_failures"] == 1 and tier.counters()["auth_replaced"] == 1
    assert os.stat(path).st_ino != forged  # replaced by our write (temp + rename over it)

    c = make()  # a fresh replica loads all four chunks from files, ours
    assert run(c, p) == out
    assert c.wrk.fs.tier.counters().get("reads_ok", 0) == 4 and c.wrk.fs.tier.counters().get("auth_failures", 0) == 0
    assert not b.sch._fs_bad, "the scheduler still hides a chunk whose file is ours again"
