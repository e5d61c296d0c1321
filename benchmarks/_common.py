"""Shared benchmark helpers: a text table, a JSON result file, a PNG plot.

Kept tiny and stable on purpose: every benchmark script imports it with
``from _common import ...`` (scripts run as ``python benchmarks/<name>.py``).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def commit() -> str | None:
    """The commit measured: ``BENCH_COMMIT`` (a copy of the tree without .git), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on, stored next to them."""
    return {
        "commit": commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e6:
            return f"{v:,.2f}"
        return f"{v:.3g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Print rows (dicts) as an aligned table and return the text."""
    if not rows:
        return ""
    cols = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, payload: Mapping[str, Any], path: str | Path | None = None) -> Path:
    """Write ``results/<name>.json`` (or ``path``, e.g. a test's own) with the machine description added."""
    if path is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(path) if path is not None else RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, sort_keys=False) + "\n")
    return path


def save_figure(fig: Any, name: str) -> Path:
    """Save a matplotlib figure as ``results/<name>.png`` and close it."""
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot with a headless backend, or None if not installed (or ``BENCH_NO_PLOT`` is set)."""
    if os.environ.get("BENCH_NO_PLOT"):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def store_prompts(eng, prompts: Sequence[list[int]]) -> None:
    """One pass that stores ``prompts``, then a few small steps so their stores complete."""
    eng.generate(prompts, max_tokens=1)
    for _ in range(3):
        eng.generate([[5, 6, 7, 8]], 1)


def restore_ttfts_ms(eng, prompts: Sequence[list[int]]) -> list[float]:
    """vLLM's ``first_token_latency`` (ms) of each prompt sent alone, so each TTFT is one restore."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for p in prompts:
        (o,) = eng.llm.generate([TokensPrompt(prompt_token_ids=list(p))], sp, use_tqdm=False)
        out.append(o.metrics.first_token_latency * 1e3)
    return out


class MethodClock:
    """Time spent inside wrapped methods, by label (nested calls counted once, at the outermost):
    what a connector's methods cost the engine thread that calls them."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._depth = 0

    def wrap(self, obj, name: str, label: str | None = None) -> None:
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn):
            return
        label = label or name

        def timed(*a, **kw):
            if self._depth:
                return fn(*a, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
                self._depth -= 1

        setattr(obj, name, timed)

    def take(self) -> tuple[float, dict]:
        """(ms, calls by label) since the last ``take``."""
        out = (sum(self.seconds.values()) * 1e3, dict(self.calls))
        self.seconds.clear()
        self.calls.clear()
        return out
