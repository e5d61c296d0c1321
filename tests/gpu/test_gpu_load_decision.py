"""The load decision in the vLLM manager: keys looked up as vLLM's scheduler does (in order, with the
positions it records in the request's ``ReqContext``) read as misses past the prefix worth loading."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

from gpu_offload.vllm.manager import HostTierManager
from tpu_offload.core.costs import FILE, HOST, PENDING, PrefillCost, TransferCost

MB = 1 << 20
TOKENS = 256  # per chunk: 2 blocks of 128


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


class Files:
    """What a ``FileView`` answers to the manager: which keys have a file."""

    def __init__(self, keys):
        self.keys = set(keys)

    def contains(self, k, salt=b""):
        return k in self.keys

    def reset(self, epoch):
        pass


def ctx(req_id: str, n: int) -> ReqContext:
    c = ReqContext(req_id=req_id)
    for i in range(n):
        c.set_offload_key_position(key(i), (i + 1) * TOKENS)
    return c


def scan(mgr, c, n: int, start: int = 0) -> list[LookupResult]:
    """vLLM's ``_maximal_prefix_lookup``: in order, stop at the first miss."""
    out = []
    for i in range(start, n):
        r = mgr.lookup(key(i), c)
        out.append(r)
        if r is LookupResult.MISS:
            break
    return out


@pytest.fixture
def make():
    made = []

    def _make(mode="auto", file_s_per_mb=None, pending: TransferCost | None = None):
        m = HostTierManager(16, MB, blocks_per_chunk=2, tokens_per_block=128, files=Files(key(i) for i in (2, 3, 4)),
                            load_decision=mode)
        m.costs.prefill = PrefillCost(1e-4)  # recompute: 25.6 ms per chunk
        for _ in range(8):
            m.costs.tiers[HOST].observe(MB, 1e-4)
            if file_s_per_mb is not None:
                m.costs.tiers[FILE].observe(MB, file_s_per_mb)
        out = m.prepare_store([key(0), key(1)], ctx("w", 0))
        m.complete_store(out.keys_to_store, ctx("w", 0))
        if pending is not None:  # after that store, which it would learn from
            m.costs.tiers[PENDING] = pending
        made.append(m)
        return m

    yield _make
    for m in made:
        m.shutdown()


H, M, P = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def test_a_fast_file_tier_is_loaded_a_slow_one_recomputed(make):
    assert scan(make(file_s_per_mb=0.001), ctx("r", 6), 6) == [H, H, H, H, H, M]
    slow = make(file_s_per_mb=1.0)
    assert scan(slow, ctx("r", 6), 6) == [H, H, M]
    slow.on_schedule_end(ScheduleEndContext(new_req_ids=["r"], preempted_req_ids=()))
    assert slow.decision_tokens == {("load", "auto", HOST): 2 * TOKENS, ("recompute", "auto", FILE): 3 * TOKENS}
    stats = slow.get_stats()
    assert stats is not None


def test_always_loads_everything_and_a_rescan_decides_again(make):
    assert scan(make("always", file_s_per_mb=1.0), ctx("r", 6), 6) == [H, H, H, H, H, M]
    m = make(file_s_per_mb=1.0)
    c = ctx("r", 6)
    assert scan(m, c, 6) == [H, H, M]
    for _ in range(16):  # the mount recovered
        m.costs.tiers[FILE].observe(MB, 1e-4)
    assert scan(m, c, 6) == [H, H, H, H, H, M]  # vLLM asks again: a new scan, a new decision
    assert scan(m, c, 6, start=1) == [H, H, H, H, M]  # after one device-prefix chunk


def test_a_chunk_still_being_stored_is_recomputed_when_waiting_costs_more(make):
    slow = make(pending=TransferCost(1e9, 0.5))  # its stores take half a second
    alloc = slow.prepare_store([key(5)], ctx("w", 0))  # in flight
    assert alloc.keys_to_store == [key(5)]
    c = ctx("r", 2)
    c.set_offload_key_position(key(5), 3 * TOKENS)  # the request's third chunk, after two host chunks
    keys = [key(0), key(1), key(5)]
    assert [slow.lookup(k, c) for k in keys] == [H, H, M]  # not waited for: recomputed
    fast = make(pending=TransferCost(1e9, 1e-4))
    fast.prepare_store([key(5)], ctx("w", 0))
    c = ctx("q", 2)
    c.set_offload_key_position(key(5), 3 * TOKENS)
    assert [fast.lookup(k, c) for k in keys] == [H, H, P]  # waiting pays: vLLM waits for the store


def test_a_load_teaches_the_tier_its_time(make):
    m = make()
    before = m.costs.tiers[HOST].samples
    m.prepare_load([key(0), key(1)], ctx("r", 2))
    m.complete_load([key(0), key(1)], ctx("r", 2))
    assert m.costs.tiers[HOST].samples == before + 1 and m.costs.tiers[HOST].oldest_age() == 0.0
    m.prepare_load([key(2)], ctx("r", 3))  # from a file: promoted, then loaded
    m.complete_load([key(2)], ctx("r", 3))
    assert m.costs.tiers[FILE].samples == 1


def test_steps_are_timed_to_the_reports_that_echo_them(make):
    """vLLM with async scheduling schedules a step when the previous one is dispatched: a step is timed
    from its scheduling to the worker report that echoes its id (hooks), not to the next schedule."""
    from gpu_offload.vllm.file_events import FileTierWorkerMetadata

    now = [0.0]
    m = make()
    m.costs.prefill = PrefillCost(1e-3, clock=lambda: now[0])
    for _ in range(20):
        a, b = m.step_sent(512), m.step_sent(512)  # b scheduled as a is dispatched
        assert b == a + 1
        now[0] += 0.05
        m.steps_done([a])
        now[0] += 0.05
        m.steps_done(FileTierWorkerMetadata(steps=[b]).aggregate(FileTierWorkerMetadata(steps=[b])).steps)
    assert m.costs.prefill.echoed
    assert m.costs.prefill.s_per_token == pytest.approx(0.05 / 512)
