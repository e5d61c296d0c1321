"""The load decision in the real tpu-inference engine (JAX CPU) on a mount throttled at the OS level:
at three speeds the default's median TTFT is within 1.15x of the better of ``always`` and ``never``,
and no request that bet on the files, the first after start included, takes more than twice its
recompute time.

The run is ``benchmarks/bench_load_decision_tpu.py --mount fuse`` (the benchmark that writes the
table in docs/load-decision.md) in a child process: one engine, its file tier's directory on a FUSE
passthrough (``tpu_offload/testing/throttled_mount.py``), the throttle changed at runtime to three
speeds (unthrottled, the hit read in about one recompute time, in seven), each speed started as on an
engine just started there, then per repetition a fresh prompt sent once per mode, its hit only in
files, in rotated order. The bars and their check are vLLM's test's (``tpu_offload/testing/
fuse_bars.py``), but for one premise: on this tiny model a load and a recompute take about the same
time unthrottled, so that loading wins there is not asserted (the bars are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_offload.testing import fuse_bars
from tpu_offload.testing.throttled_mount import skip_reason

# Wall-time bars: on a shared 2-core machine one mode's samples spread more than the bars' margins, so
# make test-tpu-engine deselects `timing` and `make test` runs this last, alone (about 1.7 minutes).
pytestmark = [pytest.mark.engine, pytest.mark.timing]

REPO = Path(__file__).resolve().parents[2]
REPS = 5  # prompts per speed, each sent once per mode


def test_auto_is_near_the_better_mode_and_never_waits_past_twice_a_recompute_on_a_throttled_mount(tmp_path):
    why = skip_reason()
    if why:
        pytest.skip(f"no throttled mount: {why}")
    out = tmp_path / "fuse.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_OFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(REPO / "benchmarks/bench_load_decision_tpu.py"), "--mount", "fuse", "--tokens", "256",
           "--reps", str(REPS), "--speeds", "7", "1", "0", "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["load_errors"] == 0, res["load_errors"]
    # the tiny model's load and recompute take about the same time unthrottled (0.22 against 0.24 s in the
    # documented run): which mode is better there is noise, so only the bars are held at that speed
    fuse_bars.check(res, loading_wins_unthrottled=False)
