"""Concurrent requests sharing a stored prefix, with asynchronous loads.

vLLM caches a request's loaded blocks only once its asynchronous load is
reported finished; until then every other request sharing the prefix would
be told the full hit and load the same chunks again (4 requests: 4x the
bytes). The connector holds those requests back (lookup returns ``None``)
until the first load is over, so they hit vLLM's prefix cache instead. No
path may leave a request held back forever: a failed or aborted load ends
the wait too.
"""

import pytest

from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16
N = 4


@pytest.fixture
def make(harnesses):
    def _make(max_num_batched_tokens=512, **extra):
        return harnesses({"num_cpu_chunks": 64, "staging_blocks": 64, **extra}, num_blocks=128,
                         max_num_batched_tokens=max_num_batched_tokens)

    return _make


def _stored_prefix(h, chunks):
    """Store a prefix of ``chunks`` chunks in the host tier, then drop it from HBM."""
    p = prompt(chunks * h.sch.chunk_tokens, 1)
    h.add(p, max_tokens=1)
    h.run()
    assert h.wrk.totals["stored_chunks"] == chunks
    assert h.sched.reset_prefix_cache()  # HBM forgets; the host tier keeps it
    return p


def _lookups(h):
    calls = []
    orig = h.conn_s.get_num_new_matched_tokens

    def wrapper(request, computed):
        r = orig(request, computed)
        calls.append((request.request_id, r))
        return r

    h.conn_s.get_num_new_matched_tokens = wrapper
    return calls


def _shared(h, p):
    ids = [h.add(p + prompt(BS + 3, 100 + i), max_tokens=3) for i in range(N)]
    h.run()
    assert set(ids) <= set(h.finished)
    assert not len(h.sch.loading)  # nothing left for a later request to wait on
    return ids


@pytest.mark.parametrize("bpc", [1, 2])
def test_shared_prefix_is_loaded_once(make, bpc):
    h = make(blocks_per_chunk=bpc)
    chunks = 6
    p = _stored_prefix(h, chunks)
    lookups = _lookups(h)
    _shared(h, p)
    assert h.wrk.totals["loaded_chunks"] == chunks  # once, not once per request
    held = {rid for rid, r in lookups if r == (None, False)}
    assert len(held) == N - 1  # held back while the first load ran ...
    last = {rid: r for rid, r in lookups}
    assert all(last[rid] == (0, False) for rid in held)  # ... then vLLM's prefix cache had it all


def test_failed_load_does_not_hold_others_forever(make, monkeypatch):
    # The stand-in checks KV as it was before the step, so the request that recomputes the
    # failed prefix must fill the step: a request sharing blocks computed in the same step
    # (fine in a real engine, which writes KV before attention) would be flagged.
    h = make(blocks_per_chunk=2, max_num_batched_tokens=64)
    p = _stored_prefix(h, 4)
    engine = h.wrk.engine
    real, calls = engine.load, []

    def broken(caches, chunks, **kw):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise RuntimeError("injected: host-to-device transfer failed")
        return real(caches, chunks, **kw)

    monkeypatch.setattr(engine, "load", broken)
    lookups = _lookups(h)
    _shared(h, p)
    assert calls and h.wrk.totals["load_errors"] > 0
    assert any(r == (None, False) for _, r in lookups)  # others did wait, and were let go


def test_aborted_load_does_not_hold_others_forever(make):
    from vllm.v1.request import RequestStatus

    h = make(blocks_per_chunk=2)
    p = _stored_prefix(h, 4)
    first = h.add(p + prompt(BS + 3, 99), max_tokens=3)
    so = h.sched.schedule()  # its load is planned
    assert len(h.sch.loading) == 1
    h.sched.finish_requests(first, RequestStatus.FINISHED_ABORTED)
    assert not len(h.sch.loading)  # its blocks will never be cached: no one waits for them
    h.sched.update_from_output(so, h.runner.execute(so, h.vc, h.sched))
    lookups = _lookups(h)
    _shared(h, p)
    assert lookups[0][1] == (4 * h.sch.chunk_tokens, True)  # not held back by the aborted load


def test_waiting_requests_load_their_own_rest_inside_the_step(make):
    """A held-back request already waited; its own stored tail loads synchronously
    (an asynchronous load would add two more steps before its first token)."""
    h = make(blocks_per_chunk=1)
    p = prompt(4 * h.sch.chunk_tokens, 1)
    prompts = [p + prompt(BS + 3, 100 + i) for i in range(N)]
    for q in prompts:  # store the shared prefix and every unique tail block (one at a time:
        h.add(q, max_tokens=1)  # the stand-in checks KV as it was before the step)
        h.run()
    assert h.sched.reset_prefix_cache()
    before = h.wrk.totals.get("loaded_chunks", 0)
    lookups = _lookups(h)
    ids = [h.add(q, max_tokens=3) for q in prompts]
    h.run()
    assert set(ids) <= set(h.finished) and not len(h.sch.loading)
    held = {rid for rid, r in lookups if r == (None, False)}
    assert len(held) == N - 1
    last = {rid: r for rid, r in lookups}
    assert all(last[rid] == (BS, False) for rid in held)  # its tail block, inside the step
    assert h.wrk.totals["loaded_chunks"] - before == 4 + N  # the prefix once, each tail once
