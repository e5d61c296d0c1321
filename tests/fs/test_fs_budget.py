"""One budget shared by several writers: rescans by bytes written, temps in the budget, dead writers' temps.

The guarantee (docs/file-tier/README.md): a writer rescans after ``rescan_bytes``
(default: a 16th of its budget) as well as every ``rescan_interval_s``, so N
writers sharing one directory stay within budget + N x rescan_bytes, plus
writes in flight. Temp files count in the budget, and the temp of a writer
that ran on this host (pid namespace) and is gone is reaped at the next
rescan instead of sitting outside the budget for ``stale_tmp_s``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from fs_helpers import FILE, filled, key, write_all
from tpu_offload.core.fs import admin
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.format import MAGIC


def _on_disk(ns_dir) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ns_dir) for f in fs)


def test_writers_sharing_a_budget_stay_within_the_stated_tolerance(root, make_tier):
    """Four writers, interleaved, time-based rescans out of reach (an hour): bytes written trigger them."""
    budget = 16 * FILE
    tiers = [make_tier(root, capacity_bytes=budget, rescan_interval_s=3600) for _ in range(4)]
    bound = budget + len(tiers) * max(FILE, budget // 16)  # the documented default of rescan_bytes
    peak = 0
    for i in range(24):
        for w, t in enumerate(tiers):
            assert t.submit_write(key(1000 * w + i), filled(i)).wait(30)
            peak = max(peak, _on_disk(tiers[0].ns_dir))
    assert peak <= bound, f"peak {peak / budget:.2f} x the budget, allowed {bound / budget:.2f} x"
    for t in tiers:
        t.flush(10)
    assert _on_disk(tiers[0].ns_dir) <= budget


def _temp(ns_dir, name, body: bytes):
    d = os.path.join(ns_dir, "00", "00")
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(body)
    return p


def test_temp_bytes_count_in_the_budget(root, make_tier):
    t = make_tier(root, capacity_bytes=6 * FILE)
    live = [_temp(t.ns_dir, fslayout.temp_name("00"), MAGIC + bytes(FILE - len(MAGIC))) for _ in range(2)]
    t.rescan()
    for i in range(6):
        assert t.submit_write(key(i + 1), filled(i)).wait(30)
    t.flush(10)
    assert all(os.path.exists(p) for p in live), "a live writer's temp was removed"
    assert _on_disk(t.ns_dir) <= 6 * FILE, "temps were outside the budget"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temps_of_dead_writers_on_this_host_are_reaped_early_and_no_others(root, make_tier):
    t = make_tier(root)
    pid = _dead_pid()
    ours = fslayout.temp_name("00")  # .tmp.<key16>.<pid>.<host tag>.<token>.<n>
    parts = ours.split(".")
    dead = ".".join(parts[:3] + [str(pid)] + parts[4:])
    other_host = ".".join(parts[:3] + [str(pid), "0badc0de"] + parts[5:])
    old_format = ".".join(parts[:3] + [str(pid)] + parts[5:])  # no host tag: cannot be judged by pid
    paths = {n: _temp(t.ns_dir, n, MAGIC + b"partial") for n in (dead, other_host, old_format, ours)}
    t.rescan()
    assert not os.path.exists(paths[dead]) and t.counters()["dead_temps_removed"] == 1
    assert all(os.path.exists(paths[n]) for n in (other_host, old_format, ours))
    again = _temp(t.ns_dir, dead.replace("00.", "01.", 1), b"")  # empty: a writer killed before its first byte
    assert fslayout.temp_writer_dead(os.path.basename(again))
    rep = admin.evict(root, budget_bytes=1 << 40)  # the CLI too, whatever --tmp-age
    assert rep.temps_removed == 1 and not os.path.exists(again)
    assert all(os.path.exists(paths[n]) for n in (other_host, old_format, ours))
