"""The load-or-recompute cost model (core/costs.py): learning and the prefix it picks."""

import pytest
from prometheus_client import CollectorRegistry

from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core import costs
from tpu_offload.core.costs import FILE, HOST, PENDING, CostModel, PrefillCost, TransferCost
from tpu_offload.core.metrics import OffloadMetrics

MB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_transfer_cost_starts_at_its_prior_and_learns_latency_and_bandwidth():
    c = TransferCost(1e9, 5e-3)
    assert c.seconds(100 * MB) == pytest.approx(5e-3 + 100 * MB / 1e9)
    for n in (1, 2, 4, 8) * 8:  # a mount at 200 MB/s with 20 ms per transfer
        c.observe(n * MB, 0.02 + n * MB / 200e6)
    assert c.bytes_per_s == pytest.approx(200e6, rel=0.1)
    assert c.latency_s == pytest.approx(0.02, rel=0.15)


def test_transfer_cost_of_one_size_scales_the_prior_and_forgets_old_samples():
    c = TransferCost(1e9, 1e-3, window=8)
    for _ in range(8):
        c.observe(4 * MB, 0.004)  # healthy
    fast = c.seconds(4 * MB)
    for _ in range(8):
        c.observe(4 * MB, 0.4)  # the same mount, 100x slower now
    assert fast < 0.01 and c.seconds(4 * MB) > 0.3


def test_an_outstanding_transfer_counts_as_at_least_its_age():
    clock = Clock()
    c = TransferCost(1e9, 1e-3, clock=clock)
    c.start("op1")
    clock.t = 3.0  # a hung read
    assert c.seconds(MB) >= 3.0
    c.finish("op1", MB)
    assert c.samples == 1 and c.oldest_age() == 0.0
    c.start("op2")
    c.drop("op2")
    assert c.oldest_age() == 0.0


def test_prefill_cost_replaces_its_prior_and_skips_tiny_steps():
    p = PrefillCost(1e-3)
    p.observe(4, 100.0)  # too few tokens to say anything
    assert p.s_per_token == 1e-3
    p.observe(1000, 0.1)
    assert p.s_per_token == pytest.approx(1e-4)
    assert p.seconds(500) == pytest.approx(0.05)


def _model(mode="auto", bias=1.0, fs_s_per_mb=None):
    m = CostModel(mode, bias)
    m.prefill = PrefillCost(1e-4)  # 10k tokens/s
    for _ in range(8):
        m.tiers[HOST].observe(MB, 1e-4)
    if fs_s_per_mb is not None:
        for _ in range(8):
            m.tiers[FILE].observe(MB, fs_s_per_mb)
    return m


def test_decision_moves_from_load_to_recompute_as_the_file_tier_slows():
    tiers = [HOST] * 2 + [FILE] * 6  # 1 MiB, 256-token chunks: recompute 25.6 ms each
    loads = [_model(fs_s_per_mb=s).decide(tiers, MB, 256).load for s in (0.001, 0.02, 0.05, 1.0)]
    assert loads[0] == 8 and loads[-1] == 2
    assert loads == sorted(loads, reverse=True)


def test_decision_keeps_a_long_prefix_when_a_tier_latency_pays_off_later():
    m = _model()
    m.tiers[FILE] = TransferCost(1e9, 0.05)  # 50 ms to start, fast after
    d = m.decide([FILE] * 8, MB, 256)  # one chunk: 51 ms > 25.6; eight: 58 ms < 205 ms
    assert d.load == 8 and d.reason == "auto" and d.saved_s > 0.1


def test_decision_waits_for_a_pending_store_only_when_that_pays():
    m = _model()
    m.tiers[PENDING] = TransferCost(1e9, 0.5)  # stores finishing in half a second
    assert m.decide([HOST, PENDING], MB, 256).load == 1
    m.tiers[PENDING] = TransferCost(1e9, 0.001)
    assert m.decide([HOST, PENDING], MB, 256).load == 2


def test_modes_and_bias():
    tiers = [HOST, FILE, FILE]
    assert _model("always", fs_s_per_mb=10).decide(tiers, MB, 256).load == 3
    d = _model("never").decide(tiers, MB, 256)
    assert d.load == 0 and d.reason == "never"
    assert _model(bias=1000.0).decide(tiers, MB, 256).load == 1  # file loads must be 1000x cheaper; host is not bet
    assert _model(bias=0.0, fs_s_per_mb=10).decide(tiers, MB, 256).load == 3
    with pytest.raises(ValueError, match="allowed"):
        CostModel("sometimes")


def test_a_host_hit_is_loaded_however_long_its_step_takes_but_not_behind_a_stall():
    """The host tier is timed from the step that issues a load to the step that reports it: a step's time,
    here 50 ms, against 1.6 ms to recompute one 16-token chunk. ``auto`` still loads it (the step is
    latency, not compute); only a host load outstanding past its expected time makes it recompute."""
    clock = Clock()
    m = CostModel("auto", clock=clock)
    m.prefill = PrefillCost(1e-4)
    for _ in range(8):
        m.tiers[HOST].observe(MB, 0.05)
    assert m.decide([HOST], MB, 16).load == 1
    m.tiers[FILE].observe(MB, 1.0)
    assert m.decide([HOST] * 4 + [FILE], MB, 16).load == 4  # a slow file chunk is still bet against
    m.tiers[HOST].start("stuck")
    clock.t += 0.5  # a host load 0.45 s past its expected time: the next ones would queue behind it
    assert m.decide([HOST], MB, 16).load == 0
    assert m.decide([HOST] * 400, MB, 16).load == 400  # a hit whose recompute outweighs the stall still loads
    m.tiers[HOST].finish("stuck", MB)
    assert m.decide([HOST], MB, 16).load == 1


def test_decision_metrics_count_tokens_by_action_reason_and_tier():
    reg = CollectorRegistry()
    m = OffloadMetrics(registry=reg)
    d = _model(fs_s_per_mb=1.0).decide([HOST, HOST, FILE], MB, 256)
    m.record_decision(d, 256)
    get = reg.get_sample_value
    assert get("tpu_offload_decision_tokens_total", {"action": "load", "reason": "auto", "tier": "cpu"}) == 512
    assert get("tpu_offload_decision_tokens_total", {"action": "recompute", "reason": "auto", "tier": "fs"}) == 256
    assert get("tpu_offload_decision_saved_seconds_total") > 0.5  # a ~1 s file read not waited for


def test_config_settings():
    c = OffloadConfig.from_sources({"load_decision": "auto", "load_decision_bias": 2}, env={})
    assert (c.load_decision, c.load_decision_bias) == ("auto", 2.0)
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_LOAD_DECISION": "never"}).load_decision == "never"
    with pytest.raises(ConfigError, match="load_decision.*'sometimes'.*allowed: one of 'auto'"):
        OffloadConfig.from_sources({"load_decision": "sometimes"}, env={})
    with pytest.raises(ConfigError, match="load_decision_bias"):
        OffloadConfig.from_sources({"load_decision_bias": -1}, env={})


def test_prefill_steps_are_timed_between_schedules_and_idle_gaps_are_clipped():
    clock = Clock()
    p = PrefillCost(1e-3, clock=clock)
    p.step(1000)
    clock.t = 0.5  # 1000 tokens in 0.5 s
    p.step(4)  # a decode step: too small to time
    assert p.s_per_token == pytest.approx(5e-4)
    clock.t = 0.6
    p.step(1000)
    clock.t = 100.6  # the engine went idle after that step: at most CLIP times the estimate
    p.step(0)
    assert p.s_per_token <= 5e-4 * PrefillCost.CLIP


def test_pipelined_steps_are_timed_to_their_outputs_and_do_not_sink():
    """Async scheduling: step k+1 is scheduled as k is dispatched; each output comes back 100 ms apart."""
    clock = Clock()
    p = PrefillCost(1e-3, clock=clock)
    for k in range(0, 200, 2):
        t = clock.t
        p.scheduled(k, 1000)
        clock.t = t + 0.002  # dispatched: the next step is scheduled at once
        p.scheduled(k + 1, 1000)
        clock.t = t + 0.100
        p.completed([k])
        clock.t = t + 0.200
        p.completed([k + 1])
        clock.t = t + 0.250  # idle before the next pair
    assert p.echoed
    assert p.s_per_token == pytest.approx(1e-4, rel=0.05)


def test_echoed_steps_skip_duplicates_idle_time_and_outliers():
    clock = Clock()
    p = PrefillCost(1e-4, clock=clock)
    p.scheduled(0, 1000)
    clock.t = 5.0  # the engine's first step of a size (1024 padded) compiles: not timed
    p.completed([0])
    assert p.samples == 0 and p.s_per_token == 1e-4
    p.scheduled(1, 1000)
    clock.t += 0.1
    p.completed([1, 1])  # two processes echo the same step: counted once
    p.completed([1])
    assert p.samples == 1 and p.s_per_token == pytest.approx(1e-4)
    p.scheduled(2, 300)  # a new size: compiles again
    clock.t += 3.0
    p.completed([2])
    p.scheduled(3, 1000)  # a slow step (a hiccup): at most CLIP times the estimate
    clock.t += 5.0
    p.completed([3])
    assert p.s_per_token == pytest.approx(1e-4 * (1 + PrefillCost.CLIP) / 2)
    p.scheduled(4, 1000)
    clock.t += 0.1
    p.completed([4])
    assert p.s_per_token == pytest.approx(1e-4)  # the median of three: the hiccup is gone
    clock.t = 50.0  # idle: the next step is timed from its scheduling
    p.scheduled(102, 1000)
    clock.t = 50.1
    p.completed([102])
    assert p.s_per_token == pytest.approx(1e-4)
    for k in range(104, 104 + PrefillCost.WINDOW):  # the engine got slower for good: followed within half a window
        p.scheduled(k, 1000)
        clock.t += 0.3
        p.completed([k])
    assert p.s_per_token == pytest.approx(3e-4)


def test_a_lost_report_or_an_unknown_id_does_not_skew_the_timing():
    clock = Clock()
    p = PrefillCost(1e-3, clock=clock)
    p.scheduled(0, 1000)
    p.completed([0])  # a size's first step: not timed
    p.scheduled(1, 1000)
    p.scheduled(2, 1000)  # queued behind step 1, whose report never comes
    clock.t = 0.5
    p.completed([2, 99])  # 99: not ours
    assert p.s_per_token == pytest.approx(5e-4)
    assert not p._scheduled
    for k in range(3, 3 + 2 * PrefillCost.MAX_OPEN):  # a worker that echoes nothing: bounded
        p.scheduled(k, 0)
    assert len(p._scheduled) == PrefillCost.MAX_OPEN


def test_two_reads_of_different_sizes_separate_latency_and_bandwidth():
    """A 10 MB/s mount with 2 ms per read: a header read and a 22 MB read are enough to price any size."""
    c = TransferCost(1e9, 5e-3)
    c.observe(4096, 0.002 + 4096 / 10e6)
    c.observe(22 * MB, 0.002 + 22 * MB / 10e6)
    assert c.bytes_per_s == pytest.approx(10e6, rel=0.05)
    assert c.latency_s == pytest.approx(0.002, rel=0.2)
    assert c.seconds(4 * MB) == pytest.approx(0.002 + 4 * MB / 10e6, rel=0.05)


@pytest.mark.parametrize("slower", [7.0, 300.0])
def test_the_prior_does_not_pull_a_measured_tier_back_after_two_loads(slower):
    """Two loads of one size that took ``slower`` times the prior: the estimate is what they took."""
    c = TransferCost(1e9, 5e-3)
    took = slower * (5e-3 + 22 * MB / 1e9)
    c.observe(22 * MB, took)
    c.observe(22 * MB, took)
    assert c.seconds(22 * MB) == pytest.approx(took, rel=0.01)


def test_one_measurement_replaces_the_prior():
    c = TransferCost(1e9, 5e-3)
    c.observe(MB, 0.5)
    assert c.seconds(MB) == pytest.approx(0.5, rel=0.01)


def test_recent_transfers_weigh_most_and_a_line_sloping_down_falls_back_to_the_scale():
    c = TransferCost(1e9, 1e-3, window=16)
    for _ in range(16):
        c.observe(MB, 0.01)
    for _ in range(4):  # the mount slowed 10x: four transfers move the estimate most of the way (in log)
        c.observe(MB, 0.1)
    assert c.seconds(MB) > 0.01 * 10 ** 0.55
    d = TransferCost(1e9, 1e-3)
    d.observe(MB, 0.2)  # noise: the big read was the fast one
    d.observe(8 * MB, 0.1)
    assert 0.1 <= d.seconds(4 * MB) <= 0.2


def test_an_abandoned_transfer_counts_as_more_than_its_age():
    clock = Clock()
    c = TransferCost(1e9, 1e-3, clock=clock)
    c.start("op")
    clock.t = 1.0  # abandoned by its hedge after 1 s
    c.finish("op", MB, censored=True)
    assert c.seconds(MB) >= 1.5
    assert c.last_sample_at == 1.0


def test_a_guessed_prefill_time_gets_a_wider_hedge():
    """The hedge bets a load against the engine's recompute time. Until that is measured (or given) it is
    the prior's guess (0.2 ms a token); tpu-inference on JAX CPU prefills at 0.7-1.3 ms, and a hedge at a
    few times the guess gave up loads from a fast file tier. The first request keeps a bound, wider."""
    clock = Clock()
    m = CostModel("auto", clock=clock)
    guess = costs.PRIOR_PREFILL_S_PER_TOKEN
    assert not m.prefill.measured
    assert m.hedge_s(2048) == pytest.approx(costs.HEDGE_FACTOR * costs.GUESS_MARGIN * 2048 * guess)
    assert costs.HEDGE_FACTOR * costs.GUESS_MARGIN * guess >= 2 * 1.3e-3  # past twice the slowest seen
    m.prefill.observe(1000, 1.3)  # one timed step
    assert m.prefill.measured and m.hedge_s(95) == pytest.approx(costs.HEDGE_FACTOR * 95 * 1.3e-3)
    given = CostModel("auto")
    given.prefill = PrefillCost(1e-3)  # a figure given, not guessed
    assert given.prefill.measured and given.hedge_s(100) == pytest.approx(costs.HEDGE_FACTOR * 0.1)


def test_the_first_timed_step_replaces_the_guess_whole():
    """A step timed to its output holds no idle gap: the first replaces the prior's guess unclipped (an
    engine at 6.5x the guess is not read as 4x), later ones are clipped to CLIP times the estimate."""
    clock = Clock()
    p = CostModel("auto", clock=clock).prefill
    for sid in (0, 1):  # the first step of the size is not timed (it may have compiled), the second is
        p.scheduled(sid, 96)
        clock.t += 0.125
        p.completed([sid])
    assert p.samples == 1 and p.measured and p.s_per_token == pytest.approx(0.125 / 96)
    p.scheduled(2, 96)
    clock.t += 100.0
    p.completed([2])
    assert p.s_per_token == pytest.approx((0.125 / 96) * (1 + PrefillCost.CLIP) / 2)  # clipped, then the median


def test_the_hedge_is_a_multiple_of_the_recompute_time_of_the_loaded_tokens_in_auto_only():
    m = _model()  # 1e-4 s per token
    assert m.hedge_s(2048) == pytest.approx(costs.HEDGE_FACTOR * 0.2048) and costs.HEDGE_FACTOR >= 1
    assert m.hedge_s(16) == pytest.approx(0.05)  # the floor: a tiny hit is not abandoned at once
    assert m.hedge_s(0) == 0.0
    assert _model("always").hedge_s(2048) == 0.0
    assert _model("never").hedge_s(2048) == 0.0


def test_old_samples_lose_weight_by_age_so_a_recovered_mount_is_followed_after_two_probe_rounds():
    """A window of slow loads (a third of them hedged: censored), then the mount is 10x faster and only
    the probe teaches it: two rounds (30 s idle, then the quick recheck) bring the estimate within 2x."""
    clock = Clock()
    c = TransferCost(1e9, 5e-3, clock=clock)
    slow, fast, lat, size = 0.35e6, 3.5e6, 0.002, 22 * MB
    for i in range(16):
        clock.t = i * 0.5
        n = 4 * MB if i % 3 else size
        c.observe(n, (lat + n / slow) * (costs.CENSORED if i % 4 == 0 else 1.0))
    new = lat + size / fast
    assert c.seconds(size) > 5 * new
    for t in (clock.t + 30.0, clock.t + 37.5):  # a probe round: its header and its whole file
        clock.t = t
        c.observe(4096, lat + 4096 / fast)
        c.observe(size, new)
    assert new <= c.seconds(size) <= 2 * new


def test_a_lone_fast_sample_among_busy_slow_ones_does_not_flip_and_a_slow_one_after_idle_rules():
    clock = Clock()
    c = TransferCost(1e9, 1e-3, clock=clock)
    for i in range(16):  # a busy slow tier: a load a second
        clock.t = float(i)
        c.observe(4 * MB, 0.4)
    clock.t += 1.0
    c.observe(4 * MB, 0.04)  # one fast outlier among them: still priced near the slow loads
    assert c.seconds(4 * MB) > 0.4 / 10 ** 0.5
    d = TransferCost(1e9, 1e-3, clock=clock)
    for _ in range(16):
        d.observe(4 * MB, 0.04)
    clock.t += 60.0
    d.observe(4 * MB, 0.4)  # the mount slowed while idle: the fresh slow sample rules at once
    assert d.seconds(4 * MB) > 0.3
