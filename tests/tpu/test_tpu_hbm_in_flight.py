"""device_put path: HBM held by transfers in flight stays within what the start-up check counted.

The stand-in harness runs vLLM's real scheduler and real JAX transfers; the
device's copies are made slow (each done array reports not ready for a few
polls, as a TPU whose device-to-host copies fall behind the steps would), so
without the bound the backlog of chunks sliced out of staging would grow.
"""

import pytest
from prometheus_client import REGISTRY

from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16


class _SlowDone:
    """A real done array that reports not ready for its first ``polls`` is_ready calls."""

    def __init__(self, done, polls: int):
        self.done, self.polls = done, polls

    def is_ready(self):
        self.polls -= 1
        return self.polls < 0 and self.done.is_ready()

    def block_until_ready(self):
        self.done.block_until_ready()
        return self


def _slow(h, polls=6):
    eng = h.wrk.engine
    store, load = eng.store, eng.load

    def slow_store(*a, **k):
        done = store(*a, **k)
        return None if done is None else _SlowDone(done, polls)

    def slow_load(*a, **k):
        caches, done = load(*a, **k)
        return caches, None if done is None else _SlowDone(done, polls)

    eng.store, eng.load = slow_store, slow_load


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "control-unbounded"])
def test_hbm_in_flight_stays_within_what_the_start_up_check_counted(harnesses, bounded):
    h = harnesses({"num_cpu_chunks": 64, "staging_blocks": 2, "blocks_per_chunk": 1, "transfer_path": "device_put"})
    eng, hbm = h.wrk.engine, h.wrk.hbm
    assert eng.path == "device_put" and hbm.bound == eng.in_flight_device_bytes == eng.staging_device_bytes > 0
    if not bounded:  # the control: what the same run holds when nothing bounds it
        hbm.bound = 1 << 62
    _slow(h)
    waits = REGISTRY.get_sample_value("tpu_offload_hbm_bound_deferrals_total", {"direction": "store"}) or 0
    p = prompt(12 * BS, 21)
    h.add(p, max_tokens=1)
    h.run()
    assert h.wrk.totals["stored_chunks"] == 12 and h.check_tier() == 12  # stores waited, none dropped
    assert h.sched.reset_prefix_cache()
    h.add(p, max_tokens=2)  # loads in staging-sized parts, each after the transfers before it
    h.add(prompt(12 * BS, 22), max_tokens=1)  # stores in the same steps as those loads
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 12 and h.wrk.totals.get("load_errors", 0) == 0
    assert h.runner.checked_positions > 0 and not h.runner.failures  # every restored block was read back right
    assert h.check_tier() == 24
    assert hbm.held == 0 and h.wrk.pending() == 0
    if bounded:
        assert hbm.peak <= hbm.bound
        assert h.wrk.totals["hbm_waited_stores"] > 0
        assert REGISTRY.get_sample_value("tpu_offload_hbm_bound_deferrals_total", {"direction": "store"}) > waits
    else:
        assert hbm.peak > eng.in_flight_device_bytes, "the slow copies must build a backlog, or this test proves nothing"
