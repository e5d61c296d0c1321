"""The Makefile and test settings behind the README's commands.

A bare ``make`` must list the targets and install nothing (the environments are 11 GB); every
target says what it does; editing the Makefile must not reinstall the environments, while a
changed pin must; and the per-test time limit must sit above every bound a test sets itself,
or it would cut the slowest engine test short. Make runs with ``-n`` (print, don't run) in a
scratch copy, so nothing here installs or starts anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
LOCK = REPO / "requirements" / "tpu-inference-cpu.lock"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make(cwd: Path, *args: str) -> str:
    # Not what the make running this suite was given: its flags, and PYTEST_ARGS (a command-line variable
    # there, so exported to this process: a suite run as `make test-vllm PYTEST_ARGS=...`, or make test's ENGINE_SUITE).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTEST_ARGS", "ENGINE_SUITE")}
    proc = subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What make reads of a fresh clone: the Makefile and the files its stamps depend on."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "requirements", tmp_path / "requirements")
    return tmp_path


def stamps(out: str) -> list[str]:
    return re.findall(r"^touch (\S+)$", out, re.M)


def pytest_runs(out: str) -> list[str]:
    return [" ".join(args.split()) for args in re.findall(r"-m pytest -q (.*)$", out, re.M)]


def phony_targets() -> list[str]:
    return re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M).group(1).split()


def test_bare_make_lists_every_target_and_installs_nothing():
    assert "pip" not in make(REPO, "-n") and "venv" not in make(REPO, "-n")
    listed = dict(re.findall(r"^  (\S+) +(\S.*)$", make(REPO), re.M))
    assert set(listed) == set(phony_targets()), set(phony_targets()) ^ set(listed)
    assert all(len(line) > 20 for line in listed.values()), listed


def test_a_fresh_checkout_checks_first_then_builds_only_what_the_goal_needs(checkout):
    setup = make(checkout, "-n", "setup")
    assert len(stamps(setup)) == 2 and setup.index("check_setup.sh") < setup.index("pip install")
    assert re.search(r"check_setup\.sh .* 1 1$", setup, re.M), setup  # both environments, checked up front
    test = make(checkout, "-n", "test")
    assert stamps(test) == stamps(setup), test  # each environment built once, before any suite
    vllm = "tests --ignore=tests/tpu --ignore=tests/tpu_compiler --ignore=tests/tpu_engine"
    lane2 = [f"tests/tpu_engine/test_tpu_engine_{name}.py"
             for name in ("families_served", "served_shape", "fresh_cache", "vllm_kernels", "drafts")]
    no_timing = '-m "not timing"'  # the wall-time bars run alone, after the lanes
    engines = '-m "engine and not timing"'
    assert pytest_runs(test) == [  # every suite once: the vLLM one as its units, host-tier and file-tier engines
        f"{no_timing} tests/tpu_engine " + " ".join(f"--ignore={f}" for f in lane2), f'-m "not engine" {vllm}',
        f"{engines} {vllm} --ignore=tests/gpu_fs --ignore=tests/events", "tests/tpu", "tests/tpu_compiler",
        f"{no_timing} " + " ".join(lane2), "-m engine tests/gpu_fs tests/events",
        f"{no_timing} -m timing tests/tpu_engine"]  # the later -m wins: only the bars
    timed = [f for f in REPO.glob("tests/**/test_*.py") if re.search(r"^pytestmark = .*mark\.timing", f.read_text(), re.M)]
    assert sorted(f.parent.name for f in timed) == ["gpu_fs", "tpu_engine"], timed  # both reached by make test
    engine = make(checkout, "-n", "test-tpu-engine")  # alone, the whole engine suite
    assert pytest_runs(engine) == [f"{no_timing} tests/tpu_engine"], engine
    timing = make(checkout, "-n", "test-timing")  # both environments, each engine's bars
    assert len(stamps(timing)) == 2 and pytest_runs(timing) == [f"-m timing {vllm}", "-m timing tests/tpu_engine"]
    vllm_only = make(checkout, "-n", "test-vllm")
    assert len(stamps(vllm_only)) == 1 and re.search(r"check_setup\.sh .* 1 0$", vllm_only, re.M), vllm_only
    fast = make(checkout, "-n", "test-fast")
    assert len(stamps(fast)) == 2 and pytest_runs(fast) == [
        '-m "not engine" tests --ignore=tests/tpu --ignore=tests/tpu_compiler --ignore=tests/tpu_engine',
        '-m "not engine" tests/tpu']


def test_editing_the_makefile_reinstalls_nothing_but_a_new_pin_does(checkout):
    made = stamps(make(checkout, "-n", "setup"))

    def edited(name: str) -> str:
        """What `make -n test` would run once ``name`` is newer than both environments (real mtimes: make's
        -W is not passed to the sub-make that builds them)."""
        for stamp in made:
            (checkout / stamp).parent.mkdir(parents=True, exist_ok=True)
            (checkout / stamp).touch()
            os.utime(checkout / stamp, (1_000_000_000, 1_000_000_000))
        for src in ("Makefile", "pyproject.toml", "requirements/tpu-inference-cpu.lock"):
            os.utime(checkout / src, (999_999_000, 999_999_000))
        if name:
            os.utime(checkout / name, (1_000_001_000, 1_000_001_000))
        return make(checkout, "-n", "test")

    assert "pip install" not in edited("")
    assert "pip install" not in edited("Makefile")
    assert "pip install -q --no-compile -e" in edited("pyproject.toml")
    assert "pip install -q --no-compile -r requirements/tpu-inference-cpu.lock" in edited(
        "requirements/tpu-inference-cpu.lock")


def _own_bounds() -> dict[str, int]:
    """The longest wait each test file sets itself (subprocess and engine-child timeouts)."""
    bound = re.compile(r"\b(?:timeout|timeout_s|[A-Z_]*TIMEOUT(?:_S)?)\s*=\s*(\d+)\b")
    found = {}
    for path in (REPO / "tests").rglob("*.py"):
        values = [int(v) for v in bound.findall(path.read_text())]
        if values:
            found[str(path.relative_to(REPO))] = max(values)
    return found


def test_every_test_has_a_time_limit_above_its_own_bounds():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    ini = project["tool"]["pytest"]["ini_options"]
    limit = int(ini["timeout"])
    bounds = _own_bounds()
    slowest = max(bounds, key=bounds.get)
    assert bounds[slowest] >= 900, bounds  # the scan sees the engine suite's own bounds
    assert limit > bounds[slowest], f"timeout {limit} s cuts {slowest} short (it waits up to {bounds[slowest]} s)"
    assert ini["timeout_method"] == "thread"  # a test hung in native code is ended too
    pin = next(r for r in project["project"]["optional-dependencies"]["test"] if r.startswith("pytest-timeout"))
    assert pin in LOCK.read_text().splitlines(), f"{pin} differs between pyproject.toml and {LOCK.name}"
