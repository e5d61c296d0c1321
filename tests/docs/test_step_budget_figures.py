"""The per-step budget the TPU pages quote is the one the code computes from its defaults.

One figure bounds what a step moves each way (core/step_budget.py): the scheduler admits it and the
worker's pacer sends it. docs/tpu/sizing.md works it out for Qwen3-32B at TP 8 (4 MiB per device and
block) and the pages around it quote the result, so each quoted number is recomputed here.
"""

from __future__ import annotations

import re
from pathlib import Path

from tpu_offload.core import step_budget
from tpu_offload.core.config import OffloadConfig

REPO = Path(__file__).resolve().parents[2]
DEVICE_BLOCK = 4 << 20  # Qwen3-32B at TP 8: 64 layers x 2 x 1 KV head x 128 x 2 bytes x 128 tokens
HIT = 1000
STAGING = 1000  # the shipped configs/tpu-inference/offload.json


def _figures():
    cfg = OffloadConfig()
    budget = cfg.step_budget_bytes
    blocks = step_budget.blocks(budget, DEVICE_BLOCK, 1, STAGING)
    return cfg, budget, blocks, step_budget.steps_to_move(HIT, blocks)


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", (REPO / page).read_text())


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def test_sizing_works_out_the_codes_budget():
    cfg, budget, blocks, steps = _figures()
    text = _text("docs/tpu/sizing.md")
    m = re.search(r"per-step budget, each direction = .*? = ([\d.]+) GB/s × ([\d.]+) ms ÷ (\d+) = ([\d,]+) MB "
                  r"\((\d+) MiB\) per device = \*\*(\d+) blocks\*\* of 4 MiB per step \(a 1,000-block hit loads over "
                  r"(\d+) steps", text)
    assert m, "docs/tpu/sizing.md no longer works out the per-step budget in its summary"
    gbps, ms, per_chip, mb, mib, n, n_steps = m.groups()
    assert (_num(gbps), _num(ms), int(per_chip)) == (cfg.transfer_bandwidth_gbps, cfg.transfer_stall_ms,
                                                     cfg.devices_per_chip)
    assert (_num(mb) * 1e6, int(mib), int(n), int(n_steps)) == (budget, round(budget / 2**20), blocks, steps)
    m = re.search(r"Defaults: ([\d.]+) GB/s × ([\d.]+) ms ÷ (\d+) = ([\d,]+) MB per device = (\d+) blocks", text)
    assert m and (_num(m[1]), _num(m[2]), int(m[3]), _num(m[4]) * 1e6, int(m[5])) == (
        cfg.transfer_bandwidth_gbps, cfg.transfer_stall_ms, cfg.devices_per_chip, budget, blocks), m


def test_enable_and_host_paths_quote_the_same_figure():
    _, budget, blocks, _ = _figures()
    m = re.search(r"([\d,]+) MB \((\d+) MiB\) per device and direction for a ([\d.]+) ms stall: (\d+) blocks",
                  _text("docs/tpu/enable.md"))
    assert m, "docs/tpu/enable.md no longer quotes the per-step budget"
    assert (_num(m[1]) * 1e6, int(m[2]), int(m[4])) == (budget, round(budget / 2**20), blocks)
    assert _num(m[3]) == OffloadConfig().transfer_stall_ms
    m = re.search(r"budgets pass: per step and direction ([\d,]+) MB per device = (\d+) blocks",
                  _text("docs/tpu/enable.md"))  # the self-check's sample output
    assert m and (_num(m[1]) * 1e6, int(m[2])) == (budget, blocks), m
    m = re.search(r"× ([\d.]+) ms = ([\d,]+) MB per device", _text("docs/tpu/host-paths.md"))
    assert m and _num(m[2]) * 1e6 == budget, m


def test_the_shipped_config_keeps_the_staging_the_pages_assume():
    import json

    cfg = json.loads((REPO / "configs/tpu-inference/offload.json").read_text())
    extra = cfg.get("kv_connector_extra_config", cfg)
    assert extra.get("staging_blocks") == STAGING, extra
    for key in ("transfer_bandwidth_gbps", "transfer_stall_ms", "devices_per_chip", "load_bandwidth_gbps",
                "load_stall_ms"):
        assert key not in extra, key  # the pages quote the code's defaults
