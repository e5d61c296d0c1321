"""A hung or failing mount costs a recompute, never a hung request (``fs_io_timeout_s``).

FUSE: ``/dev/fuse`` exists on this machine but mounting needs privileges and a
FUSE library we do not ship, so the faults are injected at the syscall
wrapper (``fileio.fault``: called before every ``preadv``/``pwritev``/presence
``stat`` of the tier). A hang is a sleep there, longer than the deadline;
EIO and ENOSPC are raised there as the kernel would return them.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

from fs_helpers import CHUNK, aligned, filled, key, layout, payload, write_all
from tpu_offload.core.fs import fileio
from tpu_offload.core.fs.tier import TierState

SECRET = b"Hd7kQ2xV9mT4pW1nR6sZ3cL8fB0gJ5yA"
DEADLINE = 0.3
HANG = 2.0


@pytest.fixture
def faults(monkeypatch):
    """``faults(op=..., hang=s | error=errno)``: the next syscalls of that kind hang or fail, until ``clear``."""
    rules: dict[str, tuple] = {}
    release = threading.Event()

    def hook(op: str) -> None:
        rule = rules.get(op)
        if rule is None:
            return
        kind, arg = rule
        if kind == "hang":
            release.wait(arg)
        else:
            raise OSError(arg, os.strerror(arg))

    monkeypatch.setattr(fileio, "fault", hook)

    class F:
        def hang(self, op, s=HANG):
            rules[op] = ("hang", s)

        def fail(self, op, err):
            rules[op] = ("error", err)

        def clear(self):
            rules.clear()
            release.set()

    f = F()
    yield f
    f.clear()


def _metric(t, name, **labels):
    return t.fs_metrics.registry.get_sample_value(name, {"tier": t.name, **labels}) or 0.0


def test_a_hung_read_is_reported_failed_at_its_deadline_and_never_lands_late(root, make_tier, faults):
    t = make_tier(root, secret=SECRET, io_timeout_s=DEADLINE)
    write_all(t, 1)
    out = aligned()
    out[:] = 0xAB
    box, landed = {}, threading.Event()
    faults.hang("read")
    t0 = time.monotonic()
    assert t.submit_read(key(1), out, lambda ok: (box.setdefault("ok", ok), box.setdefault("t", time.monotonic()),
                                                   landed.set()))
    assert landed.wait(5), "a hung read was never reported"
    assert box["ok"] is False and box["t"] - t0 < DEADLINE + 0.5, box["t"] - t0
    assert t.counters()["read_timeouts"] == 1
    assert _metric(t, "tpu_offload_fs_ops_total", op="read", result="timeout") == 1
    faults.clear()  # the mount answers again: the late read must not write into the caller's buffer
    deadline = time.monotonic() + 5
    while t.counters().get("late_reads_dropped", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.counters()["late_reads_dropped"] == 1
    assert (out == 0xAB).all(), "a read that came back after its deadline wrote into the (reused) buffer"
    ok = threading.Event()
    assert t.submit_read(key(1), out, lambda r: r and ok.set()) and ok.wait(5)  # a healthy mount: a hit
    assert np.array_equal(out, payload(1))


def test_a_hung_write_is_dropped_counted_and_never_blocks_the_slot_owner(root, make_tier, faults):
    t = make_tier(root, secret=SECRET, io_timeout_s=DEADLINE)
    faults.hang("write")
    slot = filled(1)
    ticket = t.submit_write(key(1), slot)
    time.sleep(0.05)  # the write is in its pwritev now
    t0 = time.monotonic()
    assert ticket.cancel_or_wait() is True  # the engine may reuse the slot: no hang, no wait past the deadline
    assert time.monotonic() - t0 < DEADLINE + 0.3
    slot[:] = payload(2)  # the slot's next bytes
    faults.clear()
    assert t.flush(timeout=10)
    assert not t.contains(key(1)) and not os.path.exists(t.path_of(key(1))), "an abandoned write was published"
    assert t.counters()["write_timeouts"] == 1
    assert _metric(t, "tpu_offload_fs_dropped_writes_total", reason="timeout") == 1
    assert not [f for _, _, fs in os.walk(t.ns_dir) for f in fs if f.startswith(".tmp.")], "its temp was left"
    write_all(t, 3)  # the mount is fine again: writes publish
    assert t.contains(key(3))


def test_eio_is_a_miss_or_a_dropped_write_with_a_metric_each(root, make_tier, faults):
    t = make_tier(root, secret=SECRET, io_timeout_s=DEADLINE)
    write_all(t, 1)
    faults.fail("read", errno.EIO)
    out = aligned()
    assert t.read_into(key(1), out) is False
    assert _metric(t, "tpu_offload_fs_ops_total", op="read", result="eio") == 1
    faults.fail("write", errno.EIO)
    assert t.submit_write(key(2), filled(2)).wait(10) is False
    assert _metric(t, "tpu_offload_fs_dropped_writes_total", reason="eio") == 1
    assert t.state is TierState.RW  # EIO is one file's problem, not the tier's
    faults.clear()
    assert t.read_into(key(1), out) and np.array_equal(out, payload(1))


def test_enospc_drops_the_write_with_its_metric_and_turns_the_tier_read_only(root, make_tier, faults):
    t = make_tier(root, secret=SECRET, io_timeout_s=DEADLINE)
    write_all(t, 1)
    faults.fail("write", errno.ENOSPC)
    assert t.submit_write(key(2), filled(2)).wait(10) is False
    assert _metric(t, "tpu_offload_fs_dropped_writes_total", reason="enospc") == 1
    assert t.state is TierState.READ_ONLY
    out = aligned()
    assert t.read_into(key(1), out)  # reads continue


def test_a_hung_presence_check_is_a_miss_within_the_deadline(root, make_tier, faults):
    from gpu_offload.vllm.fs_specs import FileView

    t = make_tier(root, secret=SECRET, io_timeout_s=DEADLINE)
    write_all(t, 1)
    view = FileView(root, [layout()], CHUNK, secret=SECRET, io_timeout_s=DEADLINE)
    assert view.contains(key(1))
    faults.hang("stat")
    for contains in (view.contains, lambda k: t.contains(key(9))):
        t0 = time.monotonic()
        assert contains(key(1)) is False
        assert time.monotonic() - t0 < DEADLINE + 0.3
        t0 = time.monotonic()
        assert contains(key(1)) is False and time.monotonic() - t0 < 0.05  # known hung: no new wait
    faults.clear()
    time.sleep(DEADLINE + 0.05)
    assert view.contains(key(1))
