"""Prometheus text exposition, parsed just enough to diff counters and read gauges."""

from __future__ import annotations

import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict  # (name, frozenset of (label, value)) -> float


def parse(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = frozenset(_LABEL.findall(m.group(3) or ""))
            out[(m.group(1), labels)] = float(m.group(4))
    return out


def total(samples: Samples, name: str, default: float | None = 0.0, **labels: str) -> float | None:
    """Sum of ``name``'s samples whose labels include ``labels``; ``default`` if none."""
    want = set(labels.items())
    vals = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    return sum(vals) if vals else default


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return (total(after, name, **labels) or 0.0) - (total(before, name, **labels) or 0.0)
