"""The TPU scheduler offers no file hits while its worker's tier is off, and forgets failed files without events.

A tier turns off when its namespace directory cannot be used (another uid's,
a symlink, a full disk at creation). Offering a file hit then only plans a
load that fails and a recompute; the worker reports the state in its step
report and the scheduler stops asking until the tier is back.
"""

from __future__ import annotations

import functools
import os
import time

import pytest

from test_tpu_fs_forged import plant_random_mac, run
from tpu_offload.core.fs import TierState
from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture
def make(fs_harness):
    return functools.partial(fs_harness, staging_blocks=8, blocks_per_chunk=2, fs_write_mode="write_through")


def test_no_file_hits_while_the_workers_tier_is_off(make):
    p = prompt(4 * 2 * BS, 41)
    a = make()
    out = run(a, p)
    ns = a.wrk.fs.tier.ns_dir
    os.chown(ns, 65534, 65534)  # another uid's directory: never adopted, the tier is off
    b = make()
    assert b.wrk.fs.tier.state is TierState.OFF
    run(b, prompt(2 * BS, 40))  # any step: its report tells the scheduler the tier is off
    assert b.sch._fs_off, "the worker's tier is off and the scheduler does not know"
    asked = []
    real = b.sch.fs.contains
    b.sch.fs.contains = lambda *a, **k: asked.append(a) or real(*a, **k)
    assert run(b, p) == out
    assert asked == [], "file hits offered while the worker's tier is off"
    b.sch.fs.contains = real
    os.chown(ns, os.geteuid(), os.getegid())  # put back: the tier comes back within its retry delay
    b.wrk.fs.tier._retry_at = time.monotonic()  # (the delay, fs tier's readonly_retry_s, has passed)
    run(b, prompt(4 * 2 * BS, 44))  # its stores (write attempts) retry the namespace
    end = time.monotonic() + 10
    while b.wrk.fs.tier.state is TierState.OFF and time.monotonic() < end:
        time.sleep(0.02)
    assert b.wrk.fs.tier.state is TierState.RW
    run(b, prompt(4 * 2 * BS, 42))  # a step's report carries the state back
    assert not b.sch._fs_off


def test_a_failed_file_is_offered_again_once_ours_without_kv_events(make):
    p = prompt(4 * 2 * BS, 43)
    a = make(enable_events=False)
    out = run(a, p)
    keys = sorted((k for k, toks in a.tokens.items() if toks == p[: len(toks)]), key=lambda k: len(a.tokens[k]))
    plant_random_mac(a.wrk.fs.tier.path_of(keys[0]))
    b = make(enable_events=False)
    assert [run(b, p) for _ in range(3)] == [out] * 3
    assert b.wrk.fs.tier.counters()["auth_replaced"] == 1
    assert not b.sch._fs_bad, "with enable_events false the failed-file set is never cleared"
