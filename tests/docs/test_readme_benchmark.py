"""The README's serving table says what its result files say, noise included.

The table is a contended run (three test suites shared the 2-core machine): a "vs none" figure is
marked within noise exactly when the repeats of the two configurations overlap, i.e. when some
repeat of one beat some repeat of the other. With 3 repeats a side only ranges that do not
overlap are a difference at p <= 0.1 (Mann-Whitney U = 0). The figures and the marks are recomputed
here from benchmarks/results/*.json, so a rerun that changes them fails until the README follows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = {"vLLM": "serving_vllm_conversations.json", "tpu-inference": "serving_tpu_conversations.json"}
CONNECTOR = {("vLLM", "ours"): "host", ("tpu-inference", "ours"): "ours",
             ("tpu-inference", "tpu-inference's own"): "theirs"}
METRICS = (("ttft_p50", "TTFT p50 vs none %"), ("total_tps", "total tok/s vs none %"))


def _rows() -> list[dict]:
    """The README table's rows that compare a connector with none."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Serving benchmark"):].split("\n\n")[2]
    rows, engine = [], None
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        engine = cells[0].split()[0] if cells[0] else engine
        if cells[6]:
            connector = cells[2].split(" / ")[-1]
            rows.append(dict(engine=engine, scenario=cells[1].lower(), connector=connector, cell=cells[6]))
    return rows


def _repeats(engine: str, scenario: str, config: str, figure: str) -> list[float]:
    data = json.loads((REPO / "benchmarks/results" / RESULTS[engine]).read_text())
    return [r["figures"][figure] for r in data["records"] if (r["scenario"], r["config"]) == (scenario, config)]


def _table(engine: str, scenario: str, config: str) -> dict:
    data = json.loads((REPO / "benchmarks/results" / RESULTS[engine]).read_text())
    (row,) = [r for r in data["table"] if (r["scenario"], r["config"]) == (scenario, config)]
    return row


def _overlap(a: list[float], b: list[float]) -> bool:
    return max(a) >= min(b) and max(b) >= min(a)


def _figures(cell: str) -> list[tuple[str, bool]]:
    """(percent as written, marked within noise) for each figure of a 'vs none' cell."""
    whole = cell.startswith("within noise")
    return [(m.group(1).replace("−", "-"), whole or bool(m.group(2)))
            for m in re.finditer(r"([+−-]\d+(?:\.\d+)?)%( \(noise\))?", cell)]


def test_table_has_the_rows():
    rows = _rows()
    assert {(r["engine"], r["scenario"], r["connector"]) for r in rows} == {
        ("vLLM", "high", "ours"), ("vLLM", "low", "ours"), ("tpu-inference", "high", "ours"),
        ("tpu-inference", "high", "tpu-inference's own"), ("tpu-inference", "low", "ours")}


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{r['engine']}-{r['scenario']}-{r['connector']}")
def test_figures_and_noise_marks_match_the_results(row):
    engine, scenario = row["engine"], row["scenario"]
    config = CONNECTOR[(engine, row["connector"])]
    figures = _figures(row["cell"])
    assert len(figures) == len(METRICS), row["cell"]
    for (shown, marked), (figure, column) in zip(figures, METRICS):
        want = _table(engine, scenario, config)[column]
        decimals = len(shown.partition(".")[2])
        assert float(shown) == round(want, decimals), f"{row['cell']}: {column} is {want:.2f}%"
        noise = _overlap(_repeats(engine, scenario, config, figure), _repeats(engine, scenario, "none", figure))
        assert marked == noise, f"{row['cell']}: {column} {'is' if noise else 'is not'} within noise"
