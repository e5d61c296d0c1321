"""The file tier's journal: what the router's KV events for the file tier are built from.

Every write outcome (published, or failed for any reason) and every removal of a file the
tier had seen must be journaled, and nothing else.
"""

from __future__ import annotations

import os

import numpy as np

from fs_helpers import CHUNK
from tpu_offload.core.fs.journal import FAILED, PUBLISHED, REMOVED, FileJournal
from tpu_offload.core.fs.format import HEADER_SIZE


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _data(i: int) -> np.ndarray:
    return np.full(CHUNK, i % 251, dtype=np.uint8)


def test_writes_evictions_and_rejections_are_journaled(root, make_tier):
    tier = make_tier(root, capacity_bytes=2 * (HEADER_SIZE + CHUNK))
    tier.journal = FileJournal()
    for i in range(3):
        assert tier.submit_write(_key(i), _data(i)) is not None
        assert tier.flush(10)
    got = tier.journal.take()
    assert (PUBLISHED, _key(0)) in got and (PUBLISHED, _key(2)) in got
    assert got.count((REMOVED, _key(0))) == 1  # the third file evicted the oldest
    assert len(got) == 4
    # Already on disk (another instance wrote it): still published.
    assert tier.submit_write(_key(2), _data(2)) is not None and tier.flush(10)
    assert tier.journal.take() == [(PUBLISHED, _key(2))]
    # A file corrupted under us is rejected on read: removed.
    with open(tier.path_of(_key(1)), "r+b") as f:
        f.seek(HEADER_SIZE + 5)
        f.write(b"\xff\xfe")
    assert not tier.read_into(_key(1), np.empty(CHUNK, np.uint8))
    assert tier.journal.take() == [(REMOVED, _key(1))]
    # A file deleted under us (another instance's eviction) reads as a miss: removed, once.
    os.unlink(tier.path_of(_key(2)))
    assert not tier.read_into(_key(2), np.empty(CHUNK, np.uint8))
    assert not tier.read_into(_key(2), np.empty(CHUNK, np.uint8))
    assert tier.journal.take() == [(REMOVED, _key(2))]


def test_dropped_writes_are_journaled_failed(root, make_tier):
    tier = make_tier(root, queue_depth=1, threads=1)
    tier.journal = FileJournal()
    outcomes = [tier.submit_write(_key(i), _data(i)) is not None for i in range(40)]
    assert tier.flush(30)
    got = tier.journal.take()
    dropped = [i for i, ok in enumerate(outcomes) if not ok]
    assert dropped, "a queue of one must drop some of 40 writes"
    assert sorted(k for kind, k in got if kind == FAILED) == sorted(_key(i) for i in dropped)
    assert len(got) == 40  # one outcome per write


def test_an_undrained_journal_stays_bounded():
    j = FileJournal(max_entries=4)
    for i in range(10):
        j.published(_key(i))
    assert j.lost == 6 and [k for _, k in j.take()] == [_key(i) for i in range(6, 10)]
