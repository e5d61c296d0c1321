"""Per-interval transfer telemetry that vLLM aggregates and logs.

Counters only: vLLM sums them across workers and steps and prints ``reduce()``
in its periodic "KV Transfer metrics" line. Completions do not ride here (they
use the worker-metadata channel), except on vLLM versions without one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpu_offload.connector.compat import STATS_REPORT_KEY, KVConnectorStats
from tpu_offload.connector.metadata import OffloadReport

COUNTERS = (
    "store_bytes", "store_seconds", "stored_chunks",
    "load_bytes", "load_seconds", "loaded_chunks",
    "load_errors", "store_errors",
    "deferred_store_blocks", "deferred_load_blocks", "alloc_failures",
    "lookup_tokens", "hit_tokens",
    "recomputed_hit_tokens",  # hits the load decision recomputed (core/costs.py)
)


@dataclasses.dataclass
class OffloadStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: 0 for k in COUNTERS}

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> "OffloadStats":
        for k, v in (other.data or {}).items():
            if k == STATS_REPORT_KEY:
                mine = self.data.get(k)
                merged = OffloadReport.coerce(v) if mine is None else OffloadReport.coerce(mine).aggregate(v)
                self.data[k] = merged.to_dict()
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        gib = 1 << 30
        return {
            "Stored chunks": d.get("stored_chunks", 0),
            "Loaded chunks": d.get("loaded_chunks", 0),
            "Store GiB/s": round(d.get("store_bytes", 0) / gib / d["store_seconds"], 3) if d.get("store_seconds") else 0,
            "Load GiB/s": round(d.get("load_bytes", 0) / gib / d["load_seconds"], 3) if d.get("load_seconds") else 0,
            "Load errors": d.get("load_errors", 0),
            "Store errors": d.get("store_errors", 0),
            "Deferred blocks": d.get("deferred_store_blocks", 0) + d.get("deferred_load_blocks", 0),
            "Hit tokens": d.get("hit_tokens", 0),
            "Recomputed hit tokens": d.get("recomputed_hit_tokens", 0),
        }

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k != STATS_REPORT_KEY) and not self.data.get(STATS_REPORT_KEY)

    def clone_and_reset(self) -> "OffloadStats":
        old = OffloadStats(data=dict(self.data))
        self.reset()
        return old

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> "OffloadStats":
        return cls(data=dict(data)) if data else cls()
