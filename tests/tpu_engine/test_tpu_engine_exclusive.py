"""store_policy=exclusive in the real tpu-inference engine (JAX CPU).

Device cache and host tier of the same size (40 blocks, 40 one-block
chunks); a working set of 63 blocks, visited twice in the same order. A
write-through host tier holds the same recent prompts HBM holds, so the
second pass finds almost nothing; an exclusive one holds what HBM evicted.
Tokens must equal the no-connector baseline's in both.
"""

from __future__ import annotations

import pytest

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import delta, settle, sch, totals, wrk
from tpu_offload.testing.workloads import Workload, prompt

pytestmark = pytest.mark.engine

SHAPE = Shape("kv4", "bfloat16", tp=1, block_size=16, num_blocks=40)
HOST = {"num_cpu_chunks": 40, "staging_blocks": 32, "verify_checksums": True}
# 9 prompts of 7 blocks (63 blocks), twice in the same order (LRU's worst case). Kept out of the
# registry that every bs-16 baseline session runs: only this file needs it.
W = Workload.of("cyclic16", [[prompt(61 + i, 112)] for i in range(9)] * 2, block_size=16)
# 4 prompts of 120 tokens decoding 64 each: 48 blocks wanted at once, 39 usable: vLLM preempts.
PREEMPT = Workload.of("exclusive-preempt16", [[prompt(81 + i, 120) for i in range(4)]], max_tokens=64, block_size=16)
# Preempted requests are compared on vLLM's synchronous scheduler, baseline and connector alike. Under
# the default asynchronous scheduler a request that vLLM preempts decodes other tokens after it resumes
# in this CPU test bed even with no connector, so a baseline run that way carries the same defect as
# the run it checks and proves nothing. On the synchronous scheduler a preempted request's tokens equal
# an unpreempted run's: test_tpu_engine_preemption_baseline.py checks both facts.
SYNC = {"async_scheduling": False}
for _w in (W, PREEMPT):
    del Workload.registry[_w.name]


class Hits:
    """Per request, what the last lookup saw: HBM's hit (vLLM's) and ours beyond it."""

    def __init__(self, eng):
        self.conn = eng.scheduler_connector
        self.seen: dict[str, tuple[int, int]] = {}

    def __enter__(self):
        real = self.conn.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            n, is_async = real(request, num_computed_tokens)
            self.seen[request.request_id] = (num_computed_tokens, n or 0)
            return n, is_async

        self.conn.get_num_new_matched_tokens = spy
        return self

    def __exit__(self, *exc):
        del self.conn.get_num_new_matched_tokens

    def tokens(self) -> tuple[int, int]:
        return sum(h for h, _ in self.seen.values()), sum(e for _, e in self.seen.values())


def config(policy: str) -> dict:
    cfg = kv_transfer_config("offload.json", **HOST, store_policy=policy)
    del cfg["kv_connector_extra_config"]["cpu_bytes"]  # sized in chunks here
    return cfg


def run(engines, policy: str):
    eng = engines.get(("exclusive-test", policy), SHAPE, config(policy))
    t0 = totals(eng)
    with Hits(eng) as hits:
        out = W.run(eng)
    settle(eng)
    t1 = totals(eng)
    return eng, out, hits.tokens(), {k: delta(t1, t0, k) for k in (
        "hit_tokens", "stored_chunks", "loaded_chunks", "load_errors", "store_errors", "exclusive_lost_chunks",
        "exclusive_stored_chunks", "evict_copy_steps")}


@pytest.fixture(scope="module")
def both(engines):
    base = engines.baseline(SHAPE, W, only=True)
    wt = run(engines, "write_through")
    ex = run(engines, "exclusive")
    return base, wt, ex


def test_exclusive_identical_tokens_and_more_hits_than_write_through(both):
    base, (_, wt_out, wt_hits, wt), (eng, ex_out, ex_hits, ex) = both
    assert wt_out == base
    assert ex_out == base
    prompt_tokens = sum(len(p) for p in W.prompts)
    print(f"\nwrite_through: HBM {wt_hits[0]} + host {wt_hits[1]} of {prompt_tokens} tokens {wt}"
          f"\nexclusive:     HBM {ex_hits[0]} + host {ex_hits[1]} of {prompt_tokens} tokens {ex}")
    assert ex["load_errors"] == 0 and ex["store_errors"] == 0
    assert ex["exclusive_stored_chunks"] > 0 and ex["evict_copy_steps"] > 0  # copies made at eviction only
    assert ex["stored_chunks"] == ex["exclusive_stored_chunks"]  # nothing written through
    assert ex["stored_chunks"] < wt["stored_chunks"]
    assert ex_hits[1] > wt_hits[1] and sum(ex_hits) > sum(wt_hits) + 2 * 112


def test_exclusive_aborted_request_leaves_right_bytes(both):
    """A request aborted mid-decode frees its blocks like a finished one: its watched chunks are copied
    when reused, and every later hit still gives the baseline's tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = both[2][0]
    engine = eng.llm.llm_engine
    engine.add_request("exclusive-abort", TokensPrompt(prompt_token_ids=prompt(71, 150)),
                       SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill and a few decode steps
        engine.step()
    engine.abort_request(["exclusive-abort"])
    while engine.has_unfinished_requests():
        engine.step()
    t0 = totals(eng)
    assert W.run(eng) == both[0]  # both passes again, after the abort
    settle(eng)
    t1 = totals(eng)
    assert delta(t1, t0, "load_errors") == 0 and delta(t1, t0, "store_errors") == 0
    assert delta(t1, t0, "hit_tokens") > 0


def test_interleaved_prefix_is_served_whole_from_hbm_and_host(both):
    """A prefix whose chunks alternate between HBM and the host tier (exclusive: each chunk is in one
    place) is reused whole: vLLM's own hit ends at the first chunk HBM lacks; the rest comes from HBM
    (copied on the device) and the host, chunk by chunk. Tokens equal the no-connector engine's."""
    eng = both[2][0]
    s = sch(eng)
    settle(eng)
    eng.reset_prefix_cache(reset_connector=True)  # a known start: HBM and host tier empty
    p, want = W.prompts[0], both[0][0]  # 7 one-block chunks
    seen: list = []
    real = eng.scheduler_connector.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        n, is_async = real(request, num_computed_tokens)
        if list(request.prompt_token_ids) == p:
            seen.append((list(request.block_hashes), num_computed_tokens, n))
        return n, is_async

    eng.scheduler_connector.get_num_new_matched_tokens = spy
    try:
        assert eng.generate([p]) == [want]
        hashes = seen[0][0]
        pool = eng.core.scheduler.kv_cache_manager.block_pool

        def in_hbm(c):
            got = pool.get_cached_block(hashes[c], [0])
            return got[0].block_id if got else None

        # HBM lets go of chunks 1, 3, 5 first (their blocks head vLLM's free queue); the next prompt's
        # allocation takes exactly them, and exclusive copies those chunks to the host before its forward.
        gone = [pool.blocks[in_hbm(c)] for c in (1, 3, 5)]
        pool.evict_blocks({b.block_id for b in gone})
        pool.touch(gone)
        pool.free_blocks(gone)
        eng.generate([prompt(99, 40)])  # three blocks
        settle(eng)
        keys = s._keys(type("R", (), {"block_hashes": hashes})())
        layout = [(in_hbm(c) is not None, s.manager.lookup(keys[c]).name == "HIT") for c in range(7)]
        assert layout == [(True, False), (False, True)] * 3 + [(True, False)], layout
        t0 = totals(eng)
        assert eng.generate([p]) == [want]
        settle(eng)
        t1 = totals(eng)
    finally:
        del eng.scheduler_connector.get_num_new_matched_tokens
    d = {k: delta(t1, t0, k) for k in ("hit_tokens", "hbm_hit_chunks", "hbm_copied_chunks", "loaded_chunks",
                                       "load_errors")}
    print(f"\ninterleaved: vLLM's own hit {seen[-1][1]} tokens, ours {seen[-1][2]}: {d}")
    assert seen[-1][1:] == (16, 111 - 16)  # HBM's hit is chunk 0; ours is every other chunk (less one token)
    # every chunk reused: 1 by vLLM, 3 copied from HBM (2, 4, 6), 3 loaded from the host (1, 3, 5)
    assert d == {"hit_tokens": 95, "hbm_hit_chunks": 3, "hbm_copied_chunks": 3, "loaded_chunks": 3,
                 "load_errors": 0}, d
    assert s.hbm.pinned == 0


def test_exclusive_reset_forgets_watched_chunks(both):
    """reset_prefix_cache(reset_connector=True): nothing HBM held may reach the host tier afterwards."""
    eng = both[2][0]
    s = sch(eng)
    assert len(s.exclusive.watch) > 0
    eng.reset_prefix_cache(reset_connector=True)
    assert len(s.exclusive.watch) == 0 and s.manager.stats().used_chunks == 0
    t0 = totals(eng)
    assert W.run(eng, rounds=range(9)) == both[0][:9]  # first pass again: tokens as the baseline's
    settle(eng)
    assert delta(totals(eng), t0, "hit_tokens") == 0  # nothing from before the reset
    assert wrk(eng).engine is not None


def test_exclusive_copies_past_the_staging_budget_are_lost_not_wrong(both, engines):
    """One block of staging per step: a prompt that evicts seven chunks copies one, loses six
    (counted). The host tier then has gaps; what it serves is right: tokens equal the baseline's."""
    from prometheus_client import REGISTRY

    cfg = config("exclusive")
    cfg["kv_connector_extra_config"]["staging_blocks"] = 1
    eng = engines.get(("exclusive-test", "tiny-staging"), SHAPE, cfg)
    lost0 = REGISTRY.get_sample_value("tpu_offload_exclusive_chunks_total", {"outcome": "lost"}) or 0
    t0 = totals(eng)
    assert W.run(eng) == both[0]
    settle(eng)
    t1 = totals(eng)
    assert delta(t1, t0, "exclusive_lost_chunks") > 0 and delta(t1, t0, "exclusive_stored_chunks") > 0
    lost = REGISTRY.get_sample_value("tpu_offload_exclusive_chunks_total", {"outcome": "lost"}) - lost0
    assert lost == delta(t1, t0, "exclusive_lost_chunks")  # the Prometheus counter says the same
    assert delta(t1, t0, "load_errors") == 0 and delta(t1, t0, "store_errors") == 0


def test_exclusive_with_the_file_tier_below(both, engines, tmp_path):
    """A host tier smaller than HBM over a file tier written through: an eviction copy lands on the
    host and goes on to its file; the second pass promotes what only the files still hold."""
    cfg = config("exclusive")
    from tpu_offload.core.fs.auth import make_secret_file

    make_secret_file(str(tmp_path / "fs-secret"))
    (tmp_path / "fs").mkdir()
    cfg["kv_connector_extra_config"].update(num_cpu_chunks=16, shared_storage_path=str(tmp_path / "fs"),
                                            fs_secret_file=str(tmp_path / "fs-secret"),
                                            fs_capacity_bytes="256MiB", fs_write_mode="write_through")
    eng = engines.get(("exclusive-test", "fs", str(tmp_path)), SHAPE, cfg)
    loads = sch(eng).loads
    real = loads.promoted
    promoted = []

    def spy(order, failed):
        promoted.extend(k for k, s in zip(order.keys, order.slots) if s not in failed)
        return real(order, failed)

    loads.promoted = spy
    try:
        t0 = totals(eng)
        assert W.run(eng) == both[0]
        settle(eng)
        t1 = totals(eng)
    finally:
        engines.close()  # its file-tier threads end with it
    assert promoted, "the second pass found chunks only the file tier held"
    assert delta(t1, t0, "exclusive_stored_chunks") > 0
    assert delta(t1, t0, "load_errors") == 0 and delta(t1, t0, "store_errors") == 0


# gpt-oss on tpu-inference's vLLM-model path: vLLM's hybrid KV-cache manager gives its sliding-window
# layers a KV-cache group of their own (several groups, one block pool), with prefix caching on.
HYBRID = Shape("gpt-oss", "bfloat16", tp=1, block_size=16, num_blocks=48, max_model_len=256)
HW = Workload.of("exclusive-hybrid16", [[prompt(91 + i, 112)] for i in range(6)] * 2, block_size=16)
del Workload.registry[HW.name]


def test_exclusive_with_sliding_window_groups_gives_identical_tokens(engines):
    """Several KV-cache groups: a watched chunk spans the full group's blocks and, in a tail, the
    sliding group's; vLLM frees sliding blocks behind the window while a request runs, and their
    reuse copies the chunk then. Tokens equal the no-connector engine's; nothing lost or failed."""
    import os

    from tpu_offload.testing.tiny_families import FAMILIES

    saved = dict(os.environ)
    os.environ.update(dict(FAMILIES["gpt-oss"].engine_env))
    try:
        base = engines.baseline(HYBRID, HW, only=True)
        cfg = kv_transfer_config("offload.json", num_cpu_chunks=24, staging_blocks=32, verify_checksums=True,
                                 store_policy="exclusive")
        del cfg["kv_connector_extra_config"]["cpu_bytes"]
        eng = engines.get(("exclusive-hybrid",), HYBRID, cfg)
        assert wrk(eng).s.hybrid
        t0 = totals(eng)
        assert HW.run(eng) == base
        settle(eng)
        t1 = totals(eng)
        assert delta(t1, t0, "exclusive_stored_chunks") > 0 and delta(t1, t0, "hit_tokens") > 0
        assert delta(t1, t0, "load_errors") == 0 and delta(t1, t0, "store_errors") == 0
        assert delta(t1, t0, "exclusive_lost_chunks") == 0
    finally:
        engines.close()
        os.environ.clear()
        os.environ.update(saved)


def test_exclusive_under_preemption_gives_identical_tokens(engines):
    """Preempted requests free their blocks (cached ones keep their hashes); reusing them copies the
    watched chunks first; the resumed requests hit HBM or the host and decode the same tokens as an
    engine without the connector (both on the synchronous scheduler: see SYNC)."""
    baseline = PREEMPT.run(engines.get(("baseline-sync", SHAPE), SHAPE, **SYNC))
    eng = engines.get(("exclusive-test-sync", "exclusive"), SHAPE, config("exclusive"), **SYNC)
    sched = eng.core.scheduler
    preempted = []
    real = sched._preempt_request

    def spy(request, *a, **k):
        preempted.append(request.request_id)
        return real(request, *a, **k)

    sched._preempt_request = spy
    try:
        t0 = totals(eng)
        assert PREEMPT.run(eng) == baseline
        settle(eng)
    finally:
        del sched._preempt_request
    t1 = totals(eng)
    assert preempted, "the workload must make vLLM preempt"
    assert delta(t1, t0, "load_errors") == 0 and delta(t1, t0, "store_errors") == 0
