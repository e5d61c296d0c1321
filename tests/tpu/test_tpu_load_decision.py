"""The load decision under vLLM's real scheduler (stand-in runner verifying every step's KV).

A request whose hit includes chunks another request is loading normally waits for that load, then
hits vLLM's prefix cache. With ``load_decision: auto`` it waits only while that pays: waiting for those
chunks costs the host tier's stall (the age of its oldest outstanding load past what that load should take),
so when that exceeds recomputing them, the lookup offers none of them and the request recomputes them
instead of waiting.
"""

import time

import pytest

from tpu_standin import prompt
from tpu_offload.core.costs import HOST, PrefillCost, TransferCost

pytestmark = pytest.mark.engine

BS = 16
N = 2  # the stand-in checks KV as it was before the step: two requests recomputing one prefix in one step would share blocks
CHUNKS = 6


@pytest.fixture
def make(harnesses):
    def _make(**extra):
        return harnesses({"num_cpu_chunks": 64, "staging_blocks": 64, "blocks_per_chunk": 1, **extra},
                         num_blocks=128, max_num_batched_tokens=512)

    return _make


def _run_shared(h, stall_s: float):
    """Store a prefix, drop it from HBM, then send N requests sharing it at once. The first decides to load
    it; by the others' lookups a host load has been outstanding ``stall_s`` past its expected time (a stalled
    tier), so they weigh waiting for the first's load against recomputing."""
    p = prompt(CHUNKS * h.sch.chunk_tokens, 1)
    h.add(p, max_tokens=1)
    h.run()
    assert h.sched.reset_prefix_cache()
    sch = h.sch
    sch.costs.prefill = PrefillCost(1e-3)  # 16 ms per chunk to recompute
    lookups = []
    orig_lookup = h.conn_s.get_num_new_matched_tokens

    def lookup(request, computed):
        r = orig_lookup(request, computed)
        lookups.append(r)
        if len(lookups) == 1:
            ahead = [0.0]
            host = TransferCost(1e9, 1e-4, clock=lambda: time.monotonic() + ahead[0])
            host.start("stalled")
            ahead[0] = stall_s
            sch.costs.tiers[HOST] = host
        return r

    h.conn_s.get_num_new_matched_tokens = lookup
    ids = [h.add(p + prompt(BS + 3, 100 + i), max_tokens=3) for i in range(N)]
    h.run()
    assert set(ids) <= set(h.finished)
    return lookups


def test_an_in_flight_load_is_not_waited_for_when_recomputing_costs_less(make):
    h = make(load_decision="auto")
    lookups = _run_shared(h, stall_s=30.0)
    assert (None, False) not in lookups  # nobody held back behind the stalled load
    assert h.wrk.totals["loaded_chunks"] == CHUNKS  # the first request's load only
    assert h.sch.totals["recomputed_hit_tokens"] >= (N - 1) * CHUNKS * BS


def test_an_in_flight_load_is_waited_for_when_that_pays(make):
    h = make(load_decision="auto")
    lookups = _run_shared(h, stall_s=0.0)
    assert (None, False) in lookups  # held back, then vLLM's prefix cache had it
    assert h.wrk.totals["loaded_chunks"] == CHUNKS
    assert h.sch.totals.get("recomputed_hit_tokens", 0) == 0


def test_steps_are_timed_to_their_echoed_outputs_under_async_scheduling(harnesses):
    """With async scheduling step k+1 is scheduled once step k is dispatched, and k's output comes back
    while k+1 computes. Every step's report echoes its id, so the prefill time per token is learned from
    scheduling to output (here 1 ms per token, on a clock that advances only while the device computes),
    not from the near-zero intervals between schedules."""
    h = harnesses({"num_cpu_chunks": 64, "staging_blocks": 64, "blocks_per_chunk": 1, "load_decision": "auto"},
                  num_blocks=128, max_num_batched_tokens=64, async_scheduling=True)
    now = [0.0]
    prefill = h.sch.costs.prefill
    prefill._clock = lambda: now[0]
    echoed = []
    update = h.sched.update_from_output

    def output_back(so, mro):
        now[0] += 1e-3 * so.total_num_scheduled_tokens  # the device computed the step meanwhile
        echoed.append((so.kv_connector_metadata.step, mro.kv_connector_output.kv_connector_worker_meta.steps))
        return update(so, mro)

    h.sched.update_from_output = output_back
    for i in range(4):
        h.add(prompt(6 * BS, 10 + i), max_tokens=3)
        h.run()
    assert echoed and all(steps == [sid] for sid, steps in echoed)  # every step reports, with its own id
    assert [sid for sid, _ in echoed] == list(range(len(echoed)))
    assert prefill.echoed and prefill.samples >= 4  # the first step of each size is not timed
    assert prefill.s_per_token == pytest.approx(1e-3)


def test_a_report_carries_its_step_ids_once_across_processes():
    from tpu_offload.connector.metadata import OffloadReport

    merged = OffloadReport(process_count=2, steps=[7]).aggregate(OffloadReport(process_count=2, steps=[7]))
    assert merged.steps == [7] and not merged.is_empty()  # a step id alone is content: the report is sent
    assert OffloadReport.coerce(merged.to_dict()).steps == [7]  # old vLLM: the report rides in the stats
