"""The connector under vLLM's real ``Scheduler``, with real JAX transfers.

Each harness runs vLLM 0.32's scheduler (scheduler-side connector created by
vLLM's factory from our module path) and a stand-in tpu-inference runner
whose toy forward verifies, every step, that all KV it would attend to is
exactly what the prefix implies. A wrong, stale or truncated load, or a store
that captured an overwritten block, fails the run.
"""

import numpy as np
import pytest
from prometheus_client import REGISTRY

from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture(params=["program", "device_put"])
def make(harnesses, request):
    """Both host paths: slabs written by compiled programs, and runtime device_put per slot (the TPU default)."""
    def _make(**extra):
        kw = {k: extra.pop(k) for k in ("num_blocks", "max_num_batched_tokens", "dtype", "async_scheduling")
              if k in extra}
        return harnesses({"num_cpu_chunks": 64, "staging_blocks": 16, "transfer_path": request.param, **extra}, **kw)

    return _make


def spy(h, name):
    """Record (args, result) of a scheduler-connector method."""
    calls = []
    orig = getattr(h.conn_s, name)

    def wrapper(*a, **k):
        r = orig(*a, **k)
        calls.append((a, r))
        return r

    setattr(h.conn_s, name, wrapper)
    return calls


def assert_idle(h):
    s = h.sch.manager.stats()
    assert s.pinned_chunks == 0 and s.pending_chunks == 0, s
    assert not h.sch.has_pending_work()
    assert h.wrk.pending() == 0


def test_lookup_has_no_side_effects(make):
    h = make(blocks_per_chunk=1)
    p = prompt(5 * BS, 2)
    h.add(p, max_tokens=1)
    h.run()
    from vllm import SamplingParams
    from vllm.v1.request import Request

    probe = Request("probe", p, SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    before = (h.sch.manager.keys_lru_order(), h.sch.manager.stats(), dict(h.sch.totals))
    for computed in (0, BS, 0, 3 * BS):
        h.conn_s.get_num_new_matched_tokens(probe, computed)
    after = (h.sch.manager.keys_lru_order(), h.sch.manager.stats(), dict(h.sch.totals))
    assert before == after
    assert h.conn_s.get_num_new_matched_tokens(probe, 0) == (5 * BS - 1, True)
    assert h.conn_s.get_num_new_matched_tokens(probe, 2 * BS) == (3 * BS - 1, True)


@pytest.mark.parametrize("decode_save", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_decode_save(make, decode_save, async_scheduling):
    h = make(blocks_per_chunk=1, decode_save=decode_save, async_scheduling=async_scheduling)
    p = prompt(40, 5)  # 2 full prompt blocks
    h.add(p, max_tokens=60)  # 100 tokens -> block 5 holds tokens 80..95, all computed
    h.run()
    want = 6 if decode_save else 2
    assert h.wrk.totals["stored_chunks"] == want
    assert h.check_tier() == want
    assert_idle(h)


def test_staging_smaller_than_request_defers_and_never_truncates(make):
    h = make(blocks_per_chunk=1, staging_blocks=2)
    p = prompt(10 * BS, 6)
    h.add(p, max_tokens=1)  # finishes right after prefill: most stores still deferred
    finished = spy(h, "request_finished_all_groups")
    h.run()
    assert finished[0][1] == (True, None)  # blocks kept for the final stores
    assert h.wrk.totals["stored_chunks"] == 10
    assert h.sch.totals["deferred_store_blocks"] > 0
    assert h.check_tier() == 10
    assert h.sched.reset_prefix_cache()
    h.add(p, max_tokens=2)
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 10  # in several staging-sized steps
    assert h.sch.totals["deferred_load_blocks"] > 0
    assert_idle(h)
    assert REGISTRY.get_sample_value("tpu_offload_deferred_blocks_total", {"direction": "store"}) > 0


def test_load_budget_spreads_a_large_hit_over_steps(make):
    """A hit of 10 blocks under a step budget of 3 blocks' bytes per device: sent over 4+ steps, no step's
    loads (nor stores) above the budget, every restored block checked by the stand-in's forward (wrong KV
    raises)."""
    h = make(blocks_per_chunk=1, transfer_bandwidth_gbps=0.001, transfer_stall_ms=400)  # 400,000 B per chip
    s = h.sch.s
    assert s.device_block_bytes == 2 * 16 * 8 * 64 * 4  # 2 layers of 16 tokens x 8 K/V heads x 64 x f32
    assert s.step_budget_bytes == 200_000 and s.step_budget_blocks == 3 and s.staging_blocks == 16
    stored = spy(h, "build_connector_meta")
    p = prompt(10 * BS, 11)
    h.add(p, max_tokens=1)
    h.run()
    assert h.check_tier() == 10
    assert h.sched.reset_prefix_cache()
    metas = spy(h, "build_connector_meta")
    before = REGISTRY.get_sample_value("tpu_offload_load_ready_seconds_count") or 0
    h.add(p, max_tokens=2)
    h.run()
    per_step = [sum(len(op.blocks) for op in m.loads) for _, m in metas]
    sent = [b for b in per_step if b]
    assert sum(sent) == 10 and len(sent) >= 4, per_step
    assert max(b * s.device_block_bytes for b in sent) <= s.step_budget_bytes, per_step
    assert max(sum(len(op.blocks) for op in m.stores) for _, m in stored) <= 3
    assert h.wrk.totals["loaded_chunks"] == 10 and h.wrk.totals.get("load_errors", 0) == 0
    assert h.sch.totals["deferred_load_blocks"] > 0
    assert h.runner.checked_positions > 0 and not h.runner.failures
    assert "r1" in h.finished
    # one dispatch-to-ready observation per load flight (a step's parts are one flight)
    assert REGISTRY.get_sample_value("tpu_offload_load_ready_seconds_count") - before == len(sent)
    assert_idle(h)


def _final_save_scenario(h):
    a = prompt(16 * BS, 7)
    h.add(a, max_tokens=1)
    for _ in range(3):  # prefill, then the request finishes with most stores deferred
        h.step()
    h.add(prompt(16 * BS, 8), max_tokens=2)  # needs blocks: reuses A's freed ones if any
    h.run()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_no_store_reads_a_freed_block(make, async_scheduling):
    h = make(blocks_per_chunk=1, staging_blocks=2, num_blocks=24, async_scheduling=async_scheduling)
    _final_save_scenario(h)
    assert h.wrk.totals["stored_chunks"] == 32
    assert h.check_tier() == 32
    assert_idle(h)


def test_freed_block_control_detects_use_after_free(make):
    """Control for the test above: if blocks were freed while final stores
    are pending (upstream's behaviour), the tier check must catch it."""
    h = make(blocks_per_chunk=1, staging_blocks=2, num_blocks=24)
    orig = h.sch.request_finished

    def free_at_once(request, block_ids):
        orig(request, block_ids)
        return False, None

    h.conn_s.request_finished_all_groups = free_at_once  # what vLLM calls on a SupportsHMA connector
    # vLLM asserts that a request reported finished_sending still exists; the
    # contract broken above makes that report arrive for a freed request, and
    # whichever of the two failures comes first would depend on timing.
    orig_update = h.conn_s.update_connector_output

    def forget_freed(out):
        orig_update(out)
        if out.finished_sending:
            out.finished_sending = {r for r in out.finished_sending if r in h.sched.requests}

    h.conn_s.update_connector_output = forget_freed
    with pytest.raises(AssertionError, match="wrong KV"):
        _final_save_scenario(h)
        h.check_tier()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_preemption_and_resume(make, async_scheduling):
    h = make(blocks_per_chunk=1, num_blocks=16, decode_save=True, async_scheduling=async_scheduling)
    ids = [h.add(prompt(6 * BS, 10 + i), max_tokens=70) for i in range(2)]
    reqs = [h.sched.requests[i] for i in ids]
    h.run(max_steps=600)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert h.wrk.totals["loaded_chunks"] > 0  # a resumed request got its prefix from the host tier
    h.check_tier()
    assert_idle(h)


def test_hbm_hit_missing_from_host_is_offloaded_again(make):
    h = make(blocks_per_chunk=2)
    p = prompt(4 * 2 * BS, 11)
    h.add(p, max_tokens=1)
    h.run()
    assert h.conn_s.reset_cache()  # the host tier forgets; HBM still has the prefix
    assert h.sch.manager.stats().used_chunks == 0
    h.add(p + [5, 6, 7], max_tokens=1)
    h.run()
    assert h.wrk.totals.get("loaded_chunks", 0) == 0  # served from HBM
    assert h.wrk.totals["stored_chunks"] == 8  # ... and written to the host tier again
    assert h.check_tier() == 4


def test_kv_events_and_gauges(make):
    h = make(blocks_per_chunk=2, num_cpu_chunks=3)
    events = []
    orig = h.conn_s.take_events

    def capture():
        out = list(orig())
        events.extend(out)
        return out

    h.conn_s.take_events = capture
    p = prompt(4 * 2 * BS, 12)
    h.add(p, max_tokens=1)
    h.run()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert stored and all(e.medium == "CPU" and len(e.block_hashes) == 2 and e.block_size == BS for e in stored)
    assert len(stored[0].token_ids) == 2 * BS and stored[0].parent_block_hash is None
    assert removed and all(e.medium == "CPU" for e in removed)  # capacity 3 < 4 chunks: one eviction
    assert sum(len(e.block_hashes) for e in removed) == 2
    used = REGISTRY.get_sample_value("tpu_inference:prefix_cache_host_memory_usage")
    assert used == pytest.approx(3 * h.sch.s.chunk_bytes / (1 << 30))
    for _ in range(3):
        h.step()  # idle steps: the gauge holds its value
    assert REGISTRY.get_sample_value("tpu_inference:prefix_cache_host_memory_usage") == used
    assert REGISTRY.get_sample_value("tpu_inference:prefix_cache_d2h_operations_total") > 0


def test_completions_ride_in_stats_without_worker_metadata(make, monkeypatch):
    """vLLM versions without KVConnectorWorkerMetadata: the report travels in the stats."""
    from tpu_offload.connector import compat

    monkeypatch.setattr(compat, "HAS_WORKER_META", False)
    h = make(blocks_per_chunk=1)
    p = prompt(4 * BS, 13)
    h.add(p, max_tokens=1)
    h.run()
    assert h.sch.manager.stats().used_chunks == 4  # stores completed through the stats channel
    assert h.sched.reset_prefix_cache()
    h.add(p, max_tokens=2)
    h.run()
    assert h.wrk.totals["loaded_chunks"] == 4
    assert_idle(h)


def test_registration_fails_when_staging_does_not_fit(mesh, tiny_model_dir):
    from tpu_offload.connector.settings import resolve
    from tpu_offload.connector.worker import OffloadWorker
    from tpu_offload.core.config import ConfigError
    from tpu_standin import StandInRunner, make_vllm_config

    vc = make_vllm_config(tiny_model_dir, block_size=BS, num_blocks=32,
                          extra={"num_cpu_chunks": 4, "staging_blocks": 64})
    settings = resolve(vc, None)
    runner = StandInRunner(mesh, num_blocks=32, block_size=BS)
    seen = {}
    probe = OffloadWorker(settings, free_hbm_bytes=1 << 40)
    import tpu_offload.jax_backend.memory as memory

    real = memory.check_staging_fits
    memory.check_staging_fits = lambda staging, scratch, *a, **k: seen.update(need=staging + scratch)
    try:
        probe.register_runner(runner)
    finally:
        memory.check_staging_fits = real
    probe.shutdown()
    per_block = 2 * BS * 8 * 64 * 4 // 8  # one block, both layers, one device's head shard
    assert seen["need"] >= 64 * per_block
    worker = OffloadWorker(settings, free_hbm_bytes=seen["need"] - 1)
    with pytest.raises(ConfigError, match=r"missing .* [GM]iB.*staging_blocks \(TPU_OFFLOAD_NUM_STAGING_BLOCKS\) from 64"):
        worker.register_runner(runner)
    ok = OffloadWorker(settings, free_hbm_bytes=seen["need"])
    ok.register_runner(runner)  # exactly fits
    ok.shutdown()


@pytest.mark.parametrize("preempt", [True, False], ids=["preempted", "kept-running"])
def test_reset_never_stores_kv_computed_before_it(make, preempt):
    """A request running across the reset: if vLLM preempts it, it recomputes from zero with
    the new weights and stores again; if it keeps running on KV computed before the reset,
    none of its chunks (decode ones included) may be stored afterwards."""
    h = make(decode_save=True)
    p = [int(x) for x in np.random.default_rng(9).integers(10, 500, size=4 * BS)]
    rid = h.add(p, max_tokens=3 * BS)
    for _ in range(3):
        h.step()
    stored = h.wrk.totals.get("stored_chunks", 0)
    assert stored >= 2
    h.sched.reset_prefix_cache(reset_running_requests=preempt, reset_connector=True)
    h.run()
    assert rid in h.finished
    after = h.wrk.totals.get("stored_chunks", 0) - stored
    if preempt:
        assert after >= 4  # the recomputed prompt and decode chunks
    else:
        assert after == 0
