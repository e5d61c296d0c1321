"""The reference pages are generated from the code; this fails when one drifts from it.

Fix a failure with `make docs` (tools/gen_reference.py) and commit the pages it writes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_reference", REPO / "tools" / "gen_reference.py")
gen = importlib.util.module_from_spec(spec)
sys.modules["gen_reference"] = gen
spec.loader.exec_module(gen)


@pytest.mark.parametrize("rel", sorted(gen.PAGES))
def test_page_matches_the_code(rel):
    path = REPO / rel
    assert path.exists(), f"{rel} is missing: run `make docs`"
    assert path.read_text() == gen.PAGES[rel](), f"{rel} differs from the code: run `make docs` and commit it"


def test_every_setting_and_series_is_on_its_page():
    from tpu_offload.core import config as C

    settings = (REPO / "docs/reference/settings.md").read_text()
    for s in C.SETTINGS:
        assert f"`{s.env or s.keys[0]}`" in settings, s.field
    metrics = (REPO / "docs/reference/metrics.md").read_text()
    for name in ("tpu_offload_tier_capacity_bytes", "tpu_offload_fs_ops", "vllm:kv_offload_cpu_cache_usage_perc",
                 "tpu_inference:prefix_cache_hits"):
        assert f"`{name}`" in metrics


def test_results_page_never_invents_a_date_or_commit(tmp_path):
    (tmp_path / "bare.json").write_text('{"rows": [{"x": 1.23456, "y": "a|b"}]}')
    (tmp_path / "full.json").write_text('{"machine": {"when": "2026-01-02T03:04:05+00:00", "platform": "Linux", '
                                        '"cpus": 2, "commit": "abc1234"}, "rows": []}')
    page = gen.render_results(tmp_path)
    bare = page[page.index("## bare"):page.index("## full")]
    assert "date not recorded" in bare and "commit not recorded" in bare and "1.235" in bare and "a\\|b" in bare
    full = page[page.index("## full"):]
    assert "2026-01-02T03:04:05+00:00" in full and "abc1234" in full and "2 CPUs" in full
