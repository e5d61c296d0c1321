"""Session leases on the file tier: leased files go after unleased ones of the tier, until the lease expires.

Tiers on the real disk with a budget of a few files; a fake clock drives
expiry. The leased prefix is always the least recent, so each test that
expects it kept fails on a tier that ignores leases (the ``lease=False``
cases show plain LRU taking it first).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fs_helpers import CHUNK, FILE, aligned, key, payload
from tpu_offload.core.config import OffloadConfig
from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.index import FileIndex
from tpu_offload.core.leases import LeaseTable
from tpu_offload.core.metrics import OffloadMetrics


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _write_all(tier, idx, salt: bytes = b""):
    for i in idx:  # one at a time: each write's eviction sees the order so far
        buf = aligned()
        buf[:] = payload(i)
        t = tier.submit_write(key(i), buf, salt=salt) if salt else tier.submit_write(key(i), buf)
        assert t is not None and t.wait(30)


def _present(tier, idx, salt: bytes = b"") -> list[int]:
    return [i for i in idx if tier.contains(key(i), salt)]


def _tier(make_tier, root, files: int = 4, fraction: float = 0.5, sessions: int = 8, **kw):
    """A tier of ``files`` chunk files, its lease table on a fake clock."""
    t = make_tier(root, capacity_bytes=files * FILE, threads=1, touch_interval_s=0, rescan_interval_s=3600,
                  rescan_bytes=1 << 40,  # no rescan between writes: it would put passed-over files back by time
                  lease_max_fraction=fraction, lease_max_sessions=sessions, **kw)
    clock = Clock()
    t.leases = LeaseTable(sessions, int(fraction * files), clock)
    return t, clock


def test_index_takes_unleased_entries_first_and_moves_the_leased_ones_it_passed():
    idx = FileIndex(touch_interval_s=0)
    for i in range(6):
        idx.add(bytes([i]), 10)
    leased = {bytes([0]), bytes([1])}
    out, honoured = idx.pop_lru_until(40, leased)
    assert [k for k, _ in out] == [bytes([2]), bytes([3])] and honoured == 2
    assert idx.keys_lru_order() == [bytes([4]), bytes([5]), bytes([0]), bytes([1])]
    out, honoured = idx.pop_lru_until(10, leased)  # only leased ones left after 4 and 5: the least recent goes
    assert [k for k, _ in out] == [bytes([4]), bytes([5]), bytes([0])] and honoured == 1
    assert idx.keys_lru_order() == [bytes([1])] and idx.used_bytes == 10
    out, honoured = idx.pop_lru_until(0, leased)
    assert [k for k, _ in out] == [bytes([1])] and honoured == 0  # nothing unleased went: nothing honoured


def test_without_leases_the_index_is_plain_lru():
    idx = FileIndex(touch_interval_s=0)
    for i in range(4):
        idx.add(bytes([i]), 10)
    out, honoured = idx.pop_lru_until(20, None)
    assert [k for k, _ in out] == [bytes([0]), bytes([1])] and honoured == 0


@pytest.mark.parametrize("lease", [True, False])
def test_leased_files_are_evicted_after_unleased_ones(root, make_tier, lease):
    t, _ = _tier(make_tier, root)
    _write_all(t, range(4))
    if lease:
        assert t.lease("agent", 60, [key(0), key(1)]) == 2
    _write_all(t, [4, 5])
    assert _present(t, range(6)) == ([0, 1, 4, 5] if lease else [2, 3, 4, 5])
    assert t.counters()["evicted"] == 2
    # the first eviction passed over both and moved them to the recent end: the second did not meet them
    assert t.leases.honoured == (2 if lease else 0)
    assert t.stats().leased_chunks == (2 if lease else 0)


def test_leases_hold_at_most_their_share_of_the_tier(root, make_tier):
    t, _ = _tier(make_tier, root, files=4, fraction=0.5)  # 2 files
    _write_all(t, range(4))
    assert t.lease("agent", 60, [key(0), key(1), key(2)]) == 2  # the head of the prefix, up to the share
    assert t.lease("other", 60, [key(3)]) == 0  # the share is taken
    _write_all(t, [4, 5, 6])
    assert _present(t, range(7)) == [0, 1, 5, 6]  # 2 was past the share: evicted like any other


def test_when_only_leased_files_are_left_the_least_recent_go(root, make_tier):
    t, _ = _tier(make_tier, root, files=4, fraction=1.0)
    _write_all(t, range(4))
    assert t.lease("agent", 60, [key(i) for i in range(4)]) == 4
    _write_all(t, [4])  # a write never fails because of leases
    assert _present(t, range(5)) == [1, 2, 3, 4]
    assert len(t.leases) == 3  # the evicted file holds no lease any more


def test_an_expired_lease_protects_nothing_and_a_renewal_extends_it(root, make_tier):
    t, clock = _tier(make_tier, root)
    _write_all(t, range(4))
    t.lease("a", 30, [key(0)])
    t.lease("b", 30, [key(1)])
    clock.t += 25
    assert t.renew("b", 30) and not t.renew("nobody", 30)
    clock.t += 10  # a ran out 5 s ago; b runs 20 s more
    _write_all(t, [4, 5])
    assert _present(t, range(6)) == [1, 3, 4, 5]
    assert t.leases.expired == 1 and t.leases.sessions() == 1


def test_leases_follow_the_tenant_names_with_a_secret(root, make_tier):
    t, _ = _tier(make_tier, root, secret=b"s" * 32)
    salt = b"tenant-1"
    _write_all(t, range(4), salt=salt)
    t.lease("agent", 60, [key(0), key(1)], salt=salt)
    _write_all(t, [4, 5], salt=salt)
    assert _present(t, range(6), salt) == [0, 1, 4, 5]


def test_lease_metrics_are_labelled_by_the_file_tier(root, make_tier):
    reg = CollectorRegistry()
    t, clock = _tier(make_tier, root, metrics=OffloadMetrics(reg))
    g = lambda name: reg.get_sample_value(name, {"tier": "fs"})  # noqa: E731
    _write_all(t, range(4))
    t.lease("agent", 60, [key(0), key(1)])
    assert g("tpu_offload_tier_leased_bytes") == 2 * t.chunk_bytes
    _write_all(t, [4])
    assert g("tpu_offload_lease_honoured_chunks_total") == 2
    clock.t += 61
    t.rescan()  # counts the leases that ran out while nothing was evicted
    assert g("tpu_offload_leases_expired_total") == 1
    assert g("tpu_offload_tier_leased_bytes") == 0


def test_from_config_sizes_the_table_from_the_budget_and_the_share(root, fp):
    cfg = OffloadConfig(shared_storage_path=root, fs_capacity_bytes=10 * FILE, fs_allow_unauthenticated=True,
                        lease_max_fraction=0.3, lease_max_sessions=7)
    t = FileTier.from_config(cfg, fp, CHUNK)
    try:
        assert t.leases.max_chunks == 3 and t.leases.max_sessions == 7
    finally:
        t.close(10)
    for off in (OffloadConfig(shared_storage_path=root, fs_capacity_bytes=10 * FILE, fs_allow_unauthenticated=True,
                              lease_max_fraction=0.0),
                OffloadConfig(shared_storage_path=root, fs_allow_unauthenticated=True)):  # no budget: no eviction
        t = FileTier.from_config(off, fp, CHUNK)
        try:
            assert t.leases is None and t.lease("agent", 60, [key(0)]) == 0 and not t.renew("agent", 60)
        finally:
            t.close(10)
