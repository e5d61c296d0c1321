"""Our TPUOffloadConnector inside the real tpu-inference engine, TP 1 and TP 2.

Every test compares the engine's greedy tokens with a no-connector baseline
of the same shape and workload; the connector is loaded from
configs/tpu-inference/offload.json (sizes overridden for the tiny model).
"""

from __future__ import annotations

import pytest

from tpu_offload.testing.engine_run import kv_transfer_config
from tpu_offload.testing.offload_helpers import (OURS, SETUPS, ExternalHits, LookupSpy, delta, hit_tokens, sch,
                                                 settle, totals, valid_slots, wrk, zero_slots)
from tpu_offload.testing.workloads import FAULTS, NEGATIVE, PRESSURE, ROUNDTRIP

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=sorted(SETUPS))
def setup(request, engines):
    shape = SETUPS[request.param]
    for w in (ROUNDTRIP, NEGATIVE, FAULTS, PRESSURE):  # baselines first: one engine at a time
        engines.baseline(shape, w[shape.block_size])
    return shape


@pytest.fixture
def ours(setup, engines):
    return engines.get(("ours", setup), setup, kv_transfer_config("offload.json", **OURS))


def test_store_reset_load_hits_our_tier_with_identical_tokens(setup, engines, ours):
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    t0 = totals(ours)
    assert w.run(ours) == base
    settle(ours)
    t1 = totals(ours)
    stored = delta(t1, t0, "stored_chunks")
    assert stored == sum(len(p) // setup.block_size for p in w.prompts)  # every full block of every prompt

    ours.reset_prefix_cache()
    with LookupSpy(ours) as spy, ExternalHits(ours) as vllm_took:
        assert w.run(ours) == base
    t2 = totals(ours)
    hits = delta(t2, t1, "hit_tokens")
    assert hits == sum(hit_tokens(len(p), setup.block_size) for p in w.prompts)
    assert vllm_took.tokens == hits, "what vLLM took from us is what we counted"
    assert delta(t2, t1, "loaded_chunks") == sum(len(p) // setup.block_size for p in w.prompts)
    assert delta(t2, t1, "load_errors") == 0
    assert all(is_async for n, is_async in spy.answers if n), "the default config loads asynchronously"


def round_trip_every_chunk(run, w, base, setup):
    """Store, reset vLLM's prefix cache, load: identical tokens both passes, every full block hit
    and loaded from our tier, no load errors. Returns the totals around the second pass."""
    assert w.run(run) == base
    settle(run)
    t1 = totals(run)
    run.reset_prefix_cache()
    assert w.run(run) == base
    t2 = totals(run)
    assert delta(t2, t1, "hit_tokens") == sum(hit_tokens(len(p), setup.block_size) for p in w.prompts)
    assert delta(t2, t1, "loaded_chunks") == sum(len(p) // setup.block_size for p in w.prompts)
    assert delta(t2, t1, "load_errors") == 0
    return t1, t2


def test_device_put_path_gives_identical_tokens_and_hits(setup, engines):
    """The other host path (``transfer_path: device_put``, the default on TPU): each stored chunk is
    sent to its own host array by the runtime instead of a compiled program writing the slabs."""
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    run = engines.get(("ours-device_put", setup), setup,
                      kv_transfer_config("offload.json", **OURS, transfer_path="device_put"))
    assert wrk(run).engine.path == "device_put" and wrk(run).engine.slabs is None
    round_trip_every_chunk(run, w, base, setup)


def test_small_load_budget_gives_identical_tokens_and_hits(setup, engines):
    """A load budget of one chunk per step (``load_bandwidth_gbps`` x ``load_stall_ms`` below one chunk's
    bytes): every hit is spread over steps, chunk by chunk, and the tokens and hits stay the same."""
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    run = engines.get(("ours-small-load-budget", setup), setup,
                      kv_transfer_config("offload.json", **OURS, load_bandwidth_gbps=0.001, load_stall_ms=0.001))
    s = sch(run).s
    assert s.step_budget_bytes == 1 and s.step_budget_blocks == s.blocks_per_chunk
    t1, t2 = round_trip_every_chunk(run, w, base, setup)
    assert delta(t2, t1, "deferred_load_blocks") > 0  # the budget held parts back to later steps


def test_dma_kernel_gives_identical_tokens_and_hits(setup, engines):
    """The gather/scatter TPU runs (``transfer_kernel: dma``, a Pallas kernel of DMAs), here in TPU
    interpret mode, inside the real engine: same tokens, every chunk hit, DMAs issued."""
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    run = engines.get(("ours-dma", setup), setup, kv_transfer_config("offload.json", **OURS, transfer_kernel="dma"))
    eng = wrk(run).engine
    assert eng.programs.kernel == "dma"
    compiled = eng.programs.compiles
    assert compiled > 0, "our programs precompiled at start"
    round_trip_every_chunk(run, w, base, setup)
    assert eng.dmas["gather"] > 0 and eng.dmas["scatter"] > 0
    assert eng.programs.compiles == compiled, "none compiled while serving"


def test_device_pressure_revisits_hit_our_tier_without_reset(setup, engines, ours):
    """More prefixes than the KV cache holds: vLLM evicts the first ones from
    HBM, and revisiting them hits our tier, with no reset in between."""
    w = PRESSURE[setup.block_size]
    base = engines.baseline(setup, w)
    first = len(w.rounds) - 2
    t0 = totals(ours)
    assert w.run(ours, rounds=range(first)) == base[:first]
    settle(ours)
    t1 = totals(ours)
    assert w.run(ours, rounds=range(first, len(w.rounds))) == base[first:]
    t2 = totals(ours)
    full = hit_tokens(len(w.rounds[0][0]), setup.block_size)
    assert delta(t2, t1, "hit_tokens") == 2 * full, "both revisited prefixes come back from our tier"
    assert delta(t2, t1, "load_errors") == 0
    assert delta(t1, t0, "hit_tokens") == 0


def test_corrupted_host_chunks_change_the_tokens(setup, engines, ours):
    """Negative control: the restored KV is what attention reads."""
    w = NEGATIVE[setup.block_size]
    base = engines.baseline(setup, w)
    before = valid_slots(ours)
    assert w.run(ours) == base
    settle(ours)
    mine = valid_slots(ours) - before
    assert mine
    zero_slots(ours, mine, keep_checksums=True)
    ours.reset_prefix_cache()
    t0 = totals(ours)
    assert w.run(ours) != base
    assert delta(totals(ours), t0, "loaded_chunks") == len(mine)


def test_checksum_mismatch_is_recomputed_with_identical_tokens(setup, engines, ours):
    w = FAULTS[setup.block_size]
    base = engines.baseline(setup, w)
    before = valid_slots(ours)
    assert w.run(ours) == base
    settle(ours)
    mine = sorted(valid_slots(ours) - before)
    zero_slots(ours, mine[:1], keep_checksums=False)
    ours.reset_prefix_cache()
    t0 = totals(ours)
    assert w.run(ours) == base
    t1 = totals(ours)
    assert delta(t1, t0, "load_errors") == 1
    assert sch(ours).pinned_chunks() == 0


@pytest.mark.parametrize("when", ["dispatch", "completion"])
def test_failed_load_transfer_is_recomputed_with_identical_tokens(setup, engines, ours, monkeypatch, when):
    w = FAULTS[setup.block_size]
    base = engines.baseline(setup, w)
    ours.reset_prefix_cache(reset_connector=True)  # forget what earlier tests stored for these prompts
    assert w.run(ours) == base
    settle(ours)
    engine = wrk(ours).engine
    real = engine.load
    calls = []

    def broken(caches, chunks, **kw):
        calls.append(len(chunks))
        if when == "dispatch":
            raise RuntimeError("injected: host-to-device transfer failed")
        caches, _ = real(caches, chunks, **kw)
        return caches, _FailingDone()

    monkeypatch.setattr(engine, "load", broken)
    ours.reset_prefix_cache()
    t0 = totals(ours)
    assert w.run(ours) == base
    t1 = totals(ours)
    assert calls
    assert delta(t1, t0, "load_errors") == sum(calls)
    assert sch(ours).pinned_chunks() == 0


def test_failed_store_is_never_served(setup, engines, ours, monkeypatch):
    w = NEGATIVE[setup.block_size]
    base = engines.baseline(setup, w)
    engine = wrk(ours).engine

    def broken(*a, **k):
        raise RuntimeError("injected: device-to-host transfer failed")

    monkeypatch.setattr(engine, "store", broken)
    ours.reset_prefix_cache(reset_connector=True)
    t0 = totals(ours)
    assert w.run(ours) == base
    settle(ours)
    monkeypatch.undo()
    ours.reset_prefix_cache()
    assert w.run(ours) == base
    t1 = totals(ours)
    assert delta(t1, t0, "store_errors") > 0
    assert delta(t1, t0, "load_errors") == 0


def test_sync_load(setup, engines):
    """``sync_load``: loads complete inside the step that needs them."""
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    eng = engines.get(("ours-sync", setup), setup, kv_transfer_config("offload.json", **OURS, sync_load=True))
    assert w.run(eng) == base
    settle(eng)
    eng.reset_prefix_cache()
    t0 = totals(eng)
    with LookupSpy(eng) as spy:
        assert w.run(eng) == base
    assert delta(totals(eng), t0, "hit_tokens") > 0
    hits = [(n, a) for n, a in spy.answers if n]
    assert hits and not any(a for _, a in hits)


class _FailingDone:
    def is_ready(self):
        return True

    def block_until_ready(self):
        raise RuntimeError("injected: asynchronous transfer error")
