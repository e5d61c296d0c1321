"""A pytest plugin: each suite ends with the time its slowest test files took.

``make test`` runs its suites in two lanes side by side and balances them by file (a file's
tests share engines, so a file moves between lanes whole); pytest's own ``--durations``
lists tests, not files. Setup, call and teardown all count: most of an engine file's time
is the setup that starts its engine. Loaded by ``-p`` from pyproject's addopts; imports only
the standard library.
"""

from __future__ import annotations

from collections import Counter

SHOWN = 12
_seconds: Counter = Counter()


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    terminalreporter.write_sep("=", f"slowest files, {min(SHOWN, len(_seconds))} of {len(_seconds)} "
                                    "(setup + call + teardown)")
    for path, s in _seconds.most_common(SHOWN):
        terminalreporter.write_line(f"{s:8.2f}s {path}")
