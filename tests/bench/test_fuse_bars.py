"""The throttled-mount bars (``tpu_offload/testing/fuse_bars.py``) that both engines' timing tests hold:
the tables the docs show pass them, and a run that breaks either bar or a premise does not."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tpu_offload.testing import fuse_bars

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_the_documented_tables_pass_the_bars():
    fuse_bars.check(stored("load_decision_fuse"))  # vLLM
    fuse_bars.check(stored("load_decision_tpu_fuse"), loading_wins_unthrottled=False)  # tpu-inference


def test_a_bet_past_twice_a_recompute_fails():
    res = copy.deepcopy(stored("load_decision_fuse"))
    s = fuse_bars.by_speed(res)["1x recompute"]
    never = sorted(s["ttft_s"]["never"])[len(s["ttft_s"]["never"]) // 2]
    s["ttft_s"]["auto"][0], s["chunks_loaded"]["auto"][0] = 2.5 * never, 1  # one request bet on files and waited
    with pytest.raises(AssertionError, match="twice a recompute"):
        fuse_bars.check(res)


def test_a_default_slower_than_the_better_mode_fails():
    res = copy.deepcopy(stored("load_decision_tpu_fuse"))
    s = fuse_bars.by_speed(res)["7x recompute"]
    s["ttft_s"]["auto"] = [1.3 * t for t in s["ttft_s"]["never"]]  # recomputes, but 30% slower than never
    with pytest.raises(AssertionError, match="better mode"):
        fuse_bars.check(res, loading_wins_unthrottled=False)


def test_a_mount_the_probe_never_priced_fails():
    res = copy.deepcopy(stored("load_decision_fuse"))
    res["speeds"]["fast"]["probed"] = False
    with pytest.raises(AssertionError, match="probe"):
        fuse_bars.check(res)
