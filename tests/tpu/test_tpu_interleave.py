"""Interleaved lookups under vLLM's real scheduler (connector/interleave.py).

A prefix whose chunks alternate between HBM's prefix cache and the host tier
is served whole: HBM chunks are copied on the device, host chunks loaded. The
stand-in runner checks every position's KV before each forward, so a copy
from a wrong or reused block fails the run.
"""

import pytest

from tpu_offload.core import costs
from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS, BPC = 16, 2


def pool(h):
    return h.sched.kv_cache_manager.block_pool


def chunk_blocks(h, req_hashes, c):
    """HBM block ids caching chunk ``c`` of a request with ``req_hashes`` (None: not all cached)."""
    ids = []
    for b in range(c * BPC, (c + 1) * BPC):
        got = pool(h).get_cached_block(req_hashes[b], [0])
        if not got:
            return None
        ids.append(got[0].block_id)
    return ids


def interleave(h, p):
    """Run ``p`` (host and HBM then hold all six chunks), then make them alternate:
    c0 both, c1 host only, c2 HBM only, c3 host only, c4 HBM only, c5 both."""
    rid = h.add(p, max_tokens=1)
    hashes = []
    real = h.conn_s.update_state_after_alloc

    def keep(request, blocks, n):
        if request.request_id == rid:
            hashes.extend(request.block_hashes)
        return real(request, blocks, n)

    h.conn_s.update_state_after_alloc = keep
    h.run()
    del h.conn_s.update_state_after_alloc
    keys = h.sch._keys(type("R", (), {"block_hashes": hashes})())
    assert all(h.sch.manager.lookup(k).name == "HIT" for k in keys[:6])
    assert h.sch.manager.discard([keys[2], keys[4]]) == [keys[2], keys[4]]
    for c in (1, 3):
        pool(h).evict_blocks(set(chunk_blocks(h, hashes, c)))
    layout = [(chunk_blocks(h, hashes, c) is not None, h.sch.manager.lookup(keys[c]).name == "HIT") for c in range(6)]
    assert layout == [(True, True), (False, True), (True, False), (False, True), (True, False), (True, True)]
    return hashes


@pytest.fixture(params=["program", "device_put"])
def make(harnesses, request):
    def _make(**extra):
        return harnesses({"num_cpu_chunks": 64, "staging_blocks": 16, "blocks_per_chunk": BPC,
                          "transfer_path": request.param, **extra})

    return _make


@pytest.mark.parametrize("pacing", ["off", "on"])
def test_alternating_prefix_is_served_whole_from_hbm_and_host(make, pacing):
    h = make(transfer_pacing=pacing)  # on: the copy is a queued piece, sent after the forward (program path)
    p = prompt(6 * BPC * BS, 21)
    interleave(h, p)
    s0, w0 = dict(h.sch.totals), dict(h.wrk.totals)
    pins = []
    real = h.conn_s.update_state_after_alloc

    def spy(request, blocks, n):
        real(request, blocks, n)
        plan = h.sch.loads.plans.get(request.request_id)
        if plan is not None:  # the sources are held for the copy: out of the free queue, referenced
            pins.extend(pool(h).blocks[i].ref_cnt for ids in plan.src if ids for i in ids)

    h.conn_s.update_state_after_alloc = spy
    h.add(p + [7, 8, 9], max_tokens=2)
    h.run()
    assert not h.runner.failures
    d = {k: h.sch.totals.get(k, 0) - s0.get(k, 0) for k in ("hit_tokens", "hbm_hit_chunks")}
    w = {k: h.wrk.totals.get(k, 0) - w0.get(k, 0) for k in ("loaded_chunks", "hbm_copied_chunks", "load_errors")}
    # vLLM's own hit is chunk 0; the other five come back: c2, c4, c5 from HBM (preferred), c1, c3 from the host
    assert d == {"hit_tokens": 5 * BPC * BS, "hbm_hit_chunks": 3}, d
    assert w == {"loaded_chunks": 2, "hbm_copied_chunks": 3, "load_errors": 0}, w
    assert pins and min(pins) >= 1
    assert h.sch.hbm.pinned == 0 and not h.sch.loads.hbm_orders  # every source block went back to vLLM
    assert h.check_tier() >= 6  # chunks 2 and 4, copied from HBM, are stored again from their new blocks
    from prometheus_client import REGISTRY

    assert (REGISTRY.get_sample_value("tpu_offload_hit_chunks_total", {"tier": "hbm"}) or 0) >= 3


def test_off_the_hit_ends_at_the_first_chunk_the_tiers_lack(make):
    h = make(interleaved_lookups=False)
    p = prompt(6 * BPC * BS, 22)
    interleave(h, p)
    s0 = dict(h.sch.totals)
    h.add(p + [7, 8, 9], max_tokens=2)
    h.run()
    assert not h.runner.failures
    assert h.sch.totals.get("hit_tokens", 0) - s0.get("hit_tokens", 0) == BPC * BS  # c1 only
    assert not h.wrk.totals.get("hbm_copied_chunks")


def test_source_taken_by_the_allocation_falls_back_to_the_host(make):
    """HBM chunks whose blocks vLLM hands out between the lookup and the allocation (its own free
    queue) come from the host when it holds them, or recompute; never a copy of reused blocks."""
    h = make()
    p = prompt(6 * BPC * BS, 23)
    hashes = interleave(h, p)
    victim = chunk_blocks(h, hashes, 5)  # c5: HBM and host; its HBM blocks vanish right after the lookup
    real = h.conn_s.get_num_new_matched_tokens

    def lookup(request, computed):
        out = real(request, computed)
        pool(h).evict_blocks(set(victim))
        return out

    h.conn_s.get_num_new_matched_tokens = lookup
    w0 = dict(h.wrk.totals)
    h.add(p + [7, 8, 9], max_tokens=2)
    h.run()
    assert not h.runner.failures
    w = {k: h.wrk.totals.get(k, 0) - w0.get(k, 0) for k in ("loaded_chunks", "hbm_copied_chunks", "load_errors")}
    assert w == {"loaded_chunks": 3, "hbm_copied_chunks": 2, "load_errors": 0}, w
    assert h.sch.hbm.pinned == 0


def test_hbm_chunks_cost_next_to_nothing_in_the_load_decision():
    now = [0.0]
    m = costs.CostModel("auto", clock=lambda: now[0])
    m.tiers[costs.HOST].start("stuck")
    now[0] = 10.0  # a host tier stalled for 10 s: not worth loading from
    d = m.decide([costs.HBM, costs.HBM, costs.HOST], 1 << 20, 16)
    assert d.load == 2 and d.tiers[:2] == [costs.HBM, costs.HBM]
    assert m.load_seconds({costs.HBM: 4}, 1 << 20) < 1e-3


def test_abort_while_the_copy_waits_for_its_budget_releases_the_sources(make):
    """A load spread over steps by the load budget (one chunk a step): the request is aborted after its
    first part; the HBM sources of parts never sent go back to vLLM's pool at once, sent ones when
    reported. Nothing stays pinned, nothing is left in flight."""
    from vllm.v1.request import RequestStatus

    h = make(load_bandwidth_gbps=0.001, load_stall_ms=70)  # 35,000 B per device: one 2-block chunk a step
    assert h.sch.s.step_budget_blocks == BPC
    p = prompt(6 * BPC * BS, 24)
    interleave(h, p)
    rid = h.add(p + [7, 8, 9], max_tokens=2)
    h.step()
    plan = h.sch.loads.plans[rid]
    held = [i for ids in plan.src if ids for i in ids]
    assert held and plan.emitted < len(plan.keys)
    assert all(pool(h).blocks[i].ref_cnt >= 1 for i in held)
    h.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    h.run()
    for _ in range(3):
        h.step()
    assert not h.runner.failures
    assert h.sch.hbm.pinned == 0 and not h.sch.loads.hbm_orders and not h.sch.has_pending_work()
    assert all(pool(h).blocks[i].ref_cnt == 0 for i in held)
