"""What the scheduler tells the workers each step, and what they report back.

Work orders name chunk *slots* (the scheduler's manager owns the slot map)
and engine block ids; the worker sees a key only where it names a file.
With the file tier, orders carry the request's ``cache_salt`` (``salt``):
with a secret, the worker names, signs and verifies that request's files with
the tenant's keys (``core/fs/auth.py``), as on vLLM. Every order has an id so
completions from several processes can be counted per order: a chunk is
loadable only once every process holding a shard of it has reported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpu_offload.connector.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclasses.dataclass
class LoadOp:
    op_id: int
    req_id: str
    slots: list[int]  # -1: the chunk could not be brought to the host tier (a load error)
    blocks: list[int]  # blocks_per_chunk destination ids per slot; -1 = already computed
    async_load: bool  # report the request in finished_recving when its last op completes
    last: bool  # the request's final load op
    # Per layer class, destination ids as ``blocks`` (-1: not loaded). Classes: vLLM's KV-cache groups
    # with its hybrid manager (each has its own block table; a sliding-window group's ids only in the
    # window before the hit's end), else [every layer, sliding-window layers] in "window" mode.
    # Empty: every layer loads ``blocks``.
    groups: list[list[int]] = dataclasses.field(default_factory=list)
    # With windowed layers: the request's first loaded block. A failed chunk recomputes the request from
    # there, not from the chunk: a later restart would need sliding-window KV the load never brought.
    restart: int = -1
    # Interleaved lookups (connector/interleave.py): for a chunk with slot HBM_SLOT (-2), its source HBM
    # blocks (blocks_per_chunk per slot, as ``blocks``), copied on the device; -1 elsewhere. Empty: none.
    src: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StoreOp:
    op_id: int
    req_id: str
    slots: list[int]
    blocks: list[int]  # blocks_per_chunk source ids per slot
    keys: list[bytes] = dataclasses.field(default_factory=list)  # filesystem only: the chunks' keys
    # write-back: (slot, key, salt) of chunks this allocation evicts, written first
    evict: list[tuple[int, bytes, bytes]] = dataclasses.field(default_factory=list)
    salt: bytes = b""  # the request's cache_salt: the tenant keys of its files (b"": the deployment's)
    groups: list[list[int]] = dataclasses.field(default_factory=list)  # as LoadOp's: -1 = not stored


@dataclasses.dataclass
class PromoteOp:
    """Filesystem -> host slots (the chunks' load follows as a LoadOp)."""

    op_id: int
    req_id: str
    slots: list[int]
    keys: list[bytes]
    evict: list[tuple[int, bytes, bytes]] = dataclasses.field(default_factory=list)
    salt: bytes = b""  # the request's cache_salt: its files are verified with that tenant's keys
    budget_s: float = 0.0  # load_decision auto: reads not done this long after the worker gets them fail (the hedge)


@dataclasses.dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = dataclasses.field(default_factory=list)
    stores: list[StoreOp] = dataclasses.field(default_factory=list)
    promotes: list[PromoteOp] = dataclasses.field(default_factory=list)
    # store_policy=exclusive: chunks whose HBM blocks this step hands to other content. Gathered in
    # start_load_kv, before this step's loads and forward overwrite them (connector/exclusive.py).
    early_stores: list[StoreOp] = dataclasses.field(default_factory=list)
    # Finished requests whose blocks vLLM keeps for us: report them in
    # finished_sending once all their store ops (this step's included) are done.
    release: list[str] = dataclasses.field(default_factory=list)
    # Warm restart: the id of the index the scheduler restored ("" if none): workers drop
    # restored slabs saved under another; and the id this run saves under.
    restored_id: str = ""
    snapshot_id: str = ""
    # Set by reset_cache (a weight update): workers switch the file tier to a namespace salted with it,
    # drop write-throughs of older stores, and save no snapshot. "" = never reset.
    reset_salt: str = ""
    # DP attention: each rank's metadata travels as one item here (connector/dp.py), the only
    # list tpu-inference's DPScheduler merges into the ``type(meta)()`` the worker gets.
    requests_meta: list = dataclasses.field(default_factory=list)
    # The scheduler's number for this step (-1: none). Workers echo it in their report, so the scheduler
    # times the step from its scheduling to its output's return (the engine's prefill cost, core/costs.py).
    step: int = -1
    # Session leases on the file tier (core/leases.py), which lives in the workers: (session, ttl_s) of requests
    # that came back, and (session, ttl_s, prefix chunk keys, cache_salt) of requests that finished this step.
    fs_renews: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    fs_leases: list[tuple[str, float, list[bytes], bytes]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class OffloadReport(KVConnectorWorkerMetadata):
    """Completed orders from one or more worker processes (merged by ``aggregate``)."""

    process_count: int = 1
    # (op_id, process_index, slots that failed)
    stores: list[tuple[int, int, list[int]]] = dataclasses.field(default_factory=list)
    # (op_id, process_index, slots whose bytes were bad or whose transfer failed)
    loads: list[tuple[int, int, list[int]]] = dataclasses.field(default_factory=list)
    # (op_id, process_index, slots whose file could not be read)
    promotes: list[tuple[int, int, list[int]]] = dataclasses.field(default_factory=list)
    # Chunk files published / removed (``FileJournal``), for the file tier's KV events
    fs_published: list[bytes] = dataclasses.field(default_factory=list)
    fs_removed: list[bytes] = dataclasses.field(default_factory=list)
    # (process_index, file tier state) when a worker's tier changes state: no file hits while one is off
    fs_states: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # DP attention (connector/dp.py): host slots another store is overwriting, then (slot, generation,
    # key) of chunks now stored, so every rank's scheduler can load any rank's chunks
    retired: list[int] = dataclasses.field(default_factory=list)
    published: list[tuple[int, int, bytes]] = dataclasses.field(default_factory=list)
    # Ids of the steps whose metadata this process executed (``OffloadMetadata.step``): every step reports
    steps: list[int] = dataclasses.field(default_factory=list)

    def aggregate(self, other: "OffloadReport") -> "OffloadReport":
        other = OffloadReport.coerce(other)
        return OffloadReport(
            process_count=max(self.process_count, other.process_count),
            stores=self.stores + other.stores,
            loads=self.loads + other.loads,
            promotes=self.promotes + other.promotes,
            fs_published=self.fs_published + other.fs_published,
            fs_removed=self.fs_removed + other.fs_removed,
            fs_states=self.fs_states + other.fs_states,
            retired=self.retired + other.retired,
            published=self.published + other.published,
            steps=self.steps + [s for s in other.steps if s not in self.steps],
        )

    def is_empty(self) -> bool:
        return not (self.stores or self.loads or self.promotes or self.fs_published or self.fs_removed
                    or self.fs_states or self.retired or self.published or self.steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def coerce(cls, value) -> "OffloadReport":
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(
                process_count=int(value.get("process_count", 1)),
                stores=[(int(a), int(b), list(c)) for a, b, c in value.get("stores", [])],
                loads=[(int(a), int(b), list(c)) for a, b, c in value.get("loads", [])],
                promotes=[(int(a), int(b), list(c)) for a, b, c in value.get("promotes", [])],
                fs_published=[bytes(k) for k in value.get("fs_published", [])],
                fs_removed=[bytes(k) for k in value.get("fs_removed", [])],
                retired=[int(s) for s in value.get("retired", [])],
                published=[(int(a), int(b), bytes(k)) for a, b, k in value.get("published", [])],
                fs_states=[(int(a), str(b)) for a, b in value.get("fs_states", [])],
                steps=[int(s) for s in value.get("steps", [])],
            )
        raise TypeError(f"not an offload report: {type(value).__name__}")
