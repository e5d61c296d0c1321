"""The file tier's KV events on vLLM (medium ``STORAGE``).

The workers write and remove chunk files; the scheduler publishes events. So
each worker ships its ``FileJournal`` in the worker metadata vLLM already
sends every step (``FileTierWorkerMetadata``, summed over ranks by vLLM's
aggregator), and the scheduler's ``FileEvents`` turns it into
``OffloadingEvent``s:

* a chunk is announced ``STORAGE`` once every rank has published its file
  (a lookup needs all of them), with ``removal_expected`` so vLLM's event
  tracker keeps the chunk's payload until the file is gone;
* it is retracted when any rank removes or rejects its file;
* vLLM's tracker forgets a chunk's payload (hashes, tokens) at its host
  eviction, and a file written after that would be announced with the key
  hash alone. So while a file write of a chunk is outstanding (write-through
  from its store, write-back from its eviction), its host removal is held
  back until the write's outcome arrives, or ``hold_s`` passes;
* at most ``max_announced`` chunks are announced; past that the oldest is
  retracted: the router may under-count the file tier, never over-count it,
  and the scheduler's memory stays bounded on a huge volume.

Files other replicas write or delete are theirs to announce.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Iterable, Iterator

from gpu_offload.vllm.compat import Medium, OffloadingEvent, OffloadingWorkerMetadata

from tpu_offload.core.fs.journal import FAILED, PUBLISHED, REMOVED, TIER_OFF, TIER_ON

HOLD_S = 60.0
MAX_ANNOUNCED = 1 << 18


@dataclasses.dataclass
class FileTierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed-jobs metadata plus each rank's file outcomes (key -> ranks)."""

    fs_published: dict[bytes, int] = dataclasses.field(default_factory=dict)
    fs_failed: dict[bytes, int] = dataclasses.field(default_factory=dict)
    fs_removed: dict[bytes, int] = dataclasses.field(default_factory=dict)
    # Failed load jobs of the step -> the chunk keys that failed (None: all of the job's), so the
    # scheduler hides only those chunks; ``reports_load_failures``: our workers filled it in.
    load_failures: dict[int, tuple | None] = dataclasses.field(default_factory=dict)
    reports_load_failures: bool = False
    # Ranks whose file tier turned off this step, minus ranks whose tier came back (summed over ranks).
    fs_off_delta: int = 0
    # Ids of the steps this report's ranks executed (the scheduler's number on the step's metadata, hooks.py):
    # the scheduler times each step from its scheduling to this report (the load decision, core/costs.py)
    steps: list[int] = dataclasses.field(default_factory=list)
    # The ranks' metrics of the step (``OffloadingConnectorStats``), for our manager's ``get_stats``.
    worker_stats: Any = None

    @classmethod
    def wrap(cls, meta: OffloadingWorkerMetadata | None, journal: Iterable[tuple[str, bytes]]):
        out = cls() if meta is None else cls(completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats)
        fields = {PUBLISHED: out.fs_published, FAILED: out.fs_failed, REMOVED: out.fs_removed}
        for kind, key in journal:
            if kind in (TIER_OFF, TIER_ON):
                out.fs_off_delta += 1 if kind == TIER_OFF else -1
                continue
            d = fields[kind]
            d[key] = 1  # one rank: several outcomes of a key in one step count once, the last wins below
            for other in fields.values():
                if other is not d:
                    other.pop(key, None)
        return out

    def aggregate(self, other):
        base = OffloadingWorkerMetadata.aggregate(self, other)
        merged = FileTierWorkerMetadata(completed_jobs=base.completed_jobs, transfer_stats=base.transfer_stats)
        for name in ("fs_published", "fs_failed", "fs_removed"):
            d = dict(getattr(self, name))
            for k, n in getattr(other, name, {}).items():
                d[k] = d.get(k, 0) + n
            setattr(merged, name, d)
        failures = dict(self.load_failures)
        for job, keys in getattr(other, "load_failures", {}).items():  # ranks fail apart: the union
            have = failures.get(job, ())
            failures[job] = None if have is None or keys is None else tuple(dict.fromkeys((*have, *keys)))
        merged.load_failures = failures
        merged.reports_load_failures = self.reports_load_failures and getattr(other, "reports_load_failures", False)
        merged.fs_off_delta = self.fs_off_delta + getattr(other, "fs_off_delta", 0)
        merged.steps = list(dict.fromkeys((*self.steps, *getattr(other, "steps", ()))))  # every rank echoes each
        theirs = getattr(other, "worker_stats", None)  # summed as vLLM sums worker stats: the first accumulates
        merged.worker_stats = theirs if self.worker_stats is None else (
            self.worker_stats if theirs is None else self.worker_stats.aggregate(theirs))
        return merged

    def has_files(self) -> bool:
        return bool(self.fs_published or self.fs_failed or self.fs_removed or self.fs_off_delta)


class FileEvents:
    """Scheduler side: file outcomes in, ``STORAGE`` events and held host removals out."""

    def __init__(self, world_size: int, hold_s: float = HOLD_S, max_announced: int = MAX_ANNOUNCED,
                 clock=time.monotonic):
        self.world = max(1, world_size)
        self.hold_s = hold_s
        self.max_announced = max_announced
        self._clock = clock
        self._ranks: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # partial publishes
        self._announced: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._expect: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # key -> deadline
        self._held: dict[bytes, None] = {}  # host removals waiting for their file's outcome
        self._out: list[OffloadingEvent] = []
        self.held_timeouts = 0  # holds released without an outcome (tests, logs)

    # ---- what the scheduler decided ----------------------------------------------
    def expect(self, keys: Iterable[bytes]) -> None:
        """A file write of these chunks is coming (hold their host removal until it lands)."""
        deadline = self._clock() + self.hold_s
        for k in keys:
            if k not in self._announced:
                self._expect[k] = deadline
                self._expect.move_to_end(k)

    def hold(self, keys: Iterable[bytes]) -> list[bytes]:
        """Host removals of ``keys``: returns the ones to announce now, holds the rest."""
        now = []
        for k in keys:
            if k in self._expect:
                self._held[k] = None
            else:
                now.append(k)
        return now

    def back_in_host(self, keys: Iterable[bytes]) -> list[bytes]:
        """Host stores of ``keys``: a held removal and this store cancel out (the router never saw it leave)."""
        fresh = []
        for k in keys:
            if k in self._held:
                del self._held[k]
            else:
                fresh.append(k)
        return fresh

    # ---- what the workers did -----------------------------------------------------
    def note(self, meta: FileTierWorkerMetadata) -> None:
        for k, n in meta.fs_published.items():
            if k in self._announced:
                continue
            got = self._ranks.pop(k, 0) + n
            if got >= self.world:
                self._announce(k)
                self._resolve(k)
            else:
                self._ranks[k] = got
                while len(self._ranks) > self.max_announced:
                    self._ranks.popitem(last=False)
        for k in meta.fs_failed:
            self._ranks.pop(k, None)
            self._resolve(k)
        for k in meta.fs_removed:
            self._ranks.pop(k, None)
            if k in self._announced:
                del self._announced[k]
                self._out.append(OffloadingEvent(keys=[k], medium=Medium.STORAGE, removed=True))

    def _announce(self, k: bytes) -> None:
        self._announced[k] = None
        self._out.append(OffloadingEvent(keys=[k], medium=Medium.STORAGE, removed=False, removal_expected=True))
        if len(self._announced) > self.max_announced:
            old, _ = self._announced.popitem(last=False)
            self._out.append(OffloadingEvent(keys=[old], medium=Medium.STORAGE, removed=True))

    def _resolve(self, k: bytes) -> None:
        self._expect.pop(k, None)
        if k in self._held:
            del self._held[k]
            self._out.append(OffloadingEvent(keys=[k], medium=Medium.CPU, removed=True))

    # ---- events ----------------------------------------------------------------------
    def take(self) -> Iterator[OffloadingEvent]:
        """``STORAGE`` events and released host removals, in the order they happened."""
        now = self._clock()
        while self._expect:
            k, deadline = next(iter(self._expect.items()))
            if deadline > now:
                break
            del self._expect[k]
            if k in self._held:
                del self._held[k]
                self.held_timeouts += 1
                self._out.append(OffloadingEvent(keys=[k], medium=Medium.CPU, removed=True))
        out, self._out = self._out, []
        yield from out

    def reset(self) -> None:
        """vLLM's tracker starts over too: nothing to retract or release."""
        self._ranks.clear()
        self._announced.clear()
        self._expect.clear()
        self._held.clear()
        self._out.clear()
