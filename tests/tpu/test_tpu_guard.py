"""Injected failures in every save, load and completion path, under vLLM's real scheduler.

The stand-in runner's forward checks, every step, that the KV it attends to
is exactly what the prefix implies; each case injects an exception into one
path of one half while a small tier wraps around, and the run must finish
with no exception reaching the step, every attended KV right, every chunk
left in the tier right, nothing left pinned or in flight, and the error
caught and counted. A clean pass afterwards hits the tier again.
"""

import pytest

from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16


def _boom(*a, **k):
    raise RuntimeError("injected")


def _index_error(*a, **k):
    raise IndexError("index 29 is out of bounds for axis 0 with size 29")


INJECT = {  # guard path -> (half, attribute holder, attribute, replacement)
    "complete_store": ("worker", "engine", "complete_store", _index_error),
    "wait_for_save": ("worker", None, "_check_snapshot", _boom),
    "start_load_kv": ("worker", "engine", "check_loadable", _boom),
    "get_finished": ("worker", None, "_maybe_release", _boom),
    "get_block_ids_with_load_errors": ("worker", None, "get_block_ids_with_load_errors", _boom),
    "take_report": ("worker", None, "take_report", _boom),
    "get_num_new_matched_tokens": ("scheduler", None, "_decide", _boom),  # both lookup walks end in it
    "update_state_after_alloc": ("scheduler", "manager", "prepare_load", _boom),
    "build_connector_meta": ("scheduler", "stores", "plan", _boom),
    "request_finished": ("scheduler", "stores", "storable", _boom),
}
PROMPTS = [prompt(3 * BS + 5, 100 + i) for i in range(6)]


def _pass(h, prompts):
    assert h.sched.reset_prefix_cache(), "vLLM's prefix cache is reset: repeats come from our tier"
    for p in prompts:
        h.add(p, max_tokens=2)
    h.run()


def assert_idle(h):
    s = h.sch.manager.stats()
    assert s.pinned_chunks == 0 and s.pending_chunks == 0, s
    assert not h.sch.has_pending_work()
    assert h.wrk.pending() == 0


@pytest.mark.parametrize("path", list(INJECT))
def test_an_injected_failure_never_reaches_the_step(harnesses, path, monkeypatch):
    h = harnesses({"num_cpu_chunks": 4, "staging_blocks": 8, "blocks_per_chunk": 1, "verify_checksums": True})
    half, holder, attr, fn = INJECT[path]
    owner = h.wrk if half == "worker" else h.sch
    monkeypatch.setattr(getattr(owner, holder) if holder else owner, attr, fn)
    _pass(h, PROMPTS[:3])  # stores (6 prompts x 3 chunks through 4 slots) ...
    _pass(h, PROMPTS[2:3] + PROMPTS[:1])  # ... and loads of what is left
    monkeypatch.undo()
    assert h.conn_s.guard.counts[path] + h.conn_w.guard.counts[path] > 0, "the failure was caught"
    h.run()  # completions still in flight land
    assert_idle(h)
    h.check_tier()
    # the engine goes on: a clean pass stores, the next one hits
    _pass(h, PROMPTS[4:5])
    before = h.sch.totals.get("hit_tokens", 0)
    _pass(h, PROMPTS[4:5])
    assert h.sch.totals.get("hit_tokens", 0) > before
    assert_idle(h)
    assert h.check_tier() > 0


def test_an_injected_eviction_copy_failure_never_reaches_the_step(harnesses, monkeypatch):
    """exclusive's copies run in ``bind_connector_metadata``, outside the step's other hooks:
    a failure there drops those copies (the chunks are lost, as an uncopied eviction) and the
    engine goes on."""
    h = harnesses({"num_cpu_chunks": 8, "staging_blocks": 8, "blocks_per_chunk": 1, "verify_checksums": True,
                   "store_policy": "exclusive"}, num_blocks=12)
    real = h.wrk._dispatch_stores
    failed = []

    def dispatch(stores):
        early = h.wrk._early_meta
        if stores and early is not None and stores is early.early_stores:
            failed.append(len(stores))
            raise RuntimeError("injected")
        return real(stores)

    monkeypatch.setattr(h.wrk, "_dispatch_stores", dispatch)
    _pass(h, PROMPTS[:4])  # 4 prompts x 3 chunks through 11 usable device blocks: evictions copy
    monkeypatch.undo()
    assert failed, "the workload made eviction copies"
    assert h.conn_w.guard.counts["early_stores"] > 0, "the failure was caught"
    h.run()
    assert_idle(h)
    h.check_tier()
    # clean: prompt 4's blocks are evicted by the others' (no reset: exclusive drops its watch on one),
    # copied to the host on their way out, and come back from there
    before = h.sch.totals.get("hit_tokens", 0)
    for p in PROMPTS[4:5] + PROMPTS[:4] + PROMPTS[4:5]:
        h.add(p, max_tokens=2)
        h.run()
    assert h.sch.totals.get("hit_tokens", 0) > before
    assert_idle(h)
