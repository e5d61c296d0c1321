"""Session leases: keep an agentic session's prefix through its tool gaps.

An agent's turn ends, a tool runs for seconds to minutes, and the next turn
comes back with the same (longer) prefix. Plain LRU evicts that prefix when
other sessions' traffic fills the tier during the gap. A request may carry a
retention hint in ``kv_transfer_params`` (``HINT_KEY``: a session id and a
time to keep its prefix); the tier then evicts the session's chunks only
after every unleased chunk of the same tier, until the lease expires.

Bounds, so hints can neither pin a tier nor grow memory:

* at most ``max_chunks`` distinct chunks are leased at once (a share of the
  tier, ``lease_max_fraction``): a lease takes the head of its prefix (what
  every later turn needs) up to what is left;
* at most ``max_sessions`` sessions, in arrays made once; a hint for a new
  session while the table is full is refused (counted);
* a lease lasts ``ttl_s`` from its last renewal: a request of the session
  renews it (``renew``), and its end re-leases its (longer) prefix (``lease``).

Per chunk, the hot path costs one dict probe (``in``); expiry is a heap of
deadlines, so sessions that never come back cost nothing until they expire.
A chunk two sessions lease (a shared system prompt) stays leased until both
leases end. Nothing here knows about slots or engines: the tier's eviction
asks ``key in table`` and reports what it evicted (``drop``). Each tier has
its own table, sized by its own capacity: the host tier's (``lru.py``) and
the file tier's (``fs/tier.py``, keyed by on-disk id, in the process that
owns the tier, so on a shared volume it orders only that process's evictions).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

HINT_KEY = "tpu_offload_lease"  # kv_transfer_params[HINT_KEY] = {"session": str, "ttl_s": number}
MAX_TTL_S = 3600.0  # a longer ttl_s is clamped: a lease is for a tool gap, not a cache policy
MAX_SESSION_CHARS = 256


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseHint:
    """A validated retention hint of one request."""

    session: str
    ttl_s: float


_warned: set[str] = set()


def _bad(cause: str) -> None:
    if cause not in _warned:  # once per cause and process: a client sending bad hints must not flood the log
        _warned.add(cause)
        log.warning("tpu_offload: ignoring a %s hint in kv_transfer_params: %s (expected {%r: {\"session\": "
                    "\"<id>\", \"ttl_s\": <seconds>}}); the request is served without a lease",
                    HINT_KEY, cause, HINT_KEY)


def has_hint(params: Any) -> bool:
    """Whether ``kv_transfer_params`` carry a lease hint at all (cheap: before computing a request's keys)."""
    return isinstance(params, dict) and HINT_KEY in params


def parse_hint(params: Any) -> LeaseHint | None:
    """The request's lease hint from its ``kv_transfer_params``; None if absent or invalid (never raises)."""
    if not isinstance(params, dict):
        return None
    raw = params.get(HINT_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return _bad("not an object")
    session = raw.get("session")
    if not isinstance(session, str) or not session.strip():
        return _bad("'session' is not a non-empty string")
    if len(session) > MAX_SESSION_CHARS:
        return _bad(f"'session' is longer than {MAX_SESSION_CHARS} characters")
    ttl = raw.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        return _bad("'ttl_s' is not a number of seconds > 0")
    if ttl > MAX_TTL_S:
        _bad(f"'ttl_s' is above {MAX_TTL_S:g} s; clamped to it")
        ttl = MAX_TTL_S
    return LeaseHint(session, float(ttl))


class LeaseTable:
    """Which chunks are leased, by which sessions, until when. See the module doc."""

    def __init__(self, max_sessions: int, max_chunks: int, clock: Callable[[], float] = time.monotonic):
        if max_sessions <= 0 or max_chunks < 0:
            raise ValueError(f"max_sessions must be > 0 and max_chunks >= 0, got {max_sessions}, {max_chunks}")
        self.max_sessions = max_sessions
        self.max_chunks = max_chunks
        self.clock = clock
        # Per session, in arrays made once: its id, deadline, generation (stale heap entries) and keys.
        self._ids: list[str | None] = [None] * max_sessions
        self._deadline = [0.0] * max_sessions
        self._gen = [0] * max_sessions
        self._keys: list[list] = [[] for _ in range(max_sessions)]
        self._free = list(range(max_sessions - 1, -1, -1))
        self._slot: dict[str, int] = {}  # session id -> index
        self._count: dict = {}  # leased key -> sessions leasing it (bounded by max_chunks)
        self._heap: list[tuple[float, int, int]] = []  # (deadline, index, generation)
        # Monotonic counters (metrics read their increase with take_counts).
        self.honoured = 0  # leased chunks an eviction passed over to take an unleased one
        self.expired = 0  # leases that ran out
        self.refused = 0  # hints for a new session while the table was full
        self._taken = (0, 0)

    # ---- the hot path -----------------------------------------------------
    def __contains__(self, key) -> bool:
        return key in self._count

    def __len__(self) -> int:
        """Chunks leased now (each once, however many sessions lease it)."""
        return len(self._count)

    @property
    def active(self) -> bool:
        return bool(self._slot)

    def isdisjoint(self, keys: Iterable) -> bool:
        return self._count.keys().isdisjoint(keys)

    # ---- sessions ---------------------------------------------------------------
    def lease(self, session: str, ttl_s: float, keys: Sequence) -> int:
        """Lease ``keys`` (a prefix, head first) to ``session`` for ``ttl_s`` from now, replacing its
        earlier keys; returns how many are leased (the share bound may cut the tail)."""
        self.expire()
        i = self._slot.get(session)
        if i is None:
            if not self._free:
                self.refused += 1
                return 0
            i = self._free.pop()
            self._slot[session] = i
            self._ids[i] = session
        self._release_keys(i)
        count, mine = self._count, self._keys[i]
        room = self.max_chunks - len(count)
        seen = set()
        for k in keys:
            if k in seen:
                continue
            n = count.get(k)
            if n is None:
                if room <= 0:
                    break
                room -= 1
                count[k] = 1
            else:
                count[k] = n + 1
            seen.add(k)
            mine.append(k)
        self._set_deadline(i, ttl_s)
        return len(mine)

    def renew(self, session: str, ttl_s: float) -> bool:
        """The session came back: its lease runs ``ttl_s`` from now. False if it holds none."""
        self.expire()
        i = self._slot.get(session)
        if i is None:
            return False
        self._set_deadline(i, ttl_s)
        return True

    def expire(self, now: float | None = None) -> int:
        """End the leases whose deadline passed; returns how many."""
        heap = self._heap
        if not heap:
            return 0
        now = self.clock() if now is None else now
        n = 0
        while heap and heap[0][0] <= now:
            _, i, gen = heapq.heappop(heap)
            if gen == self._gen[i] and self._ids[i] is not None:
                self._end(i)
                self.expired += 1
                n += 1
        return n

    def drop(self, keys: Iterable) -> None:
        """These chunks left the tier (evicted, discarded): they hold no lease any more."""
        count = self._count
        if count:
            for k in keys:
                count.pop(k, None)

    def clear(self) -> None:
        """Forget every lease (the tier was reset: nothing it held comes back)."""
        for i in list(self._slot.values()):
            self._end(i)
        self._heap.clear()

    def sessions(self) -> int:
        return len(self._slot)

    def take_counts(self) -> tuple[int, int]:
        """(honoured, expired) since the last call, for counters; ends the leases due first, so the counts
        and the leased-bytes gauge are current even while nothing is evicted (read once per step)."""
        self.expire()
        h, e = self._taken
        self._taken = (self.honoured, self.expired)
        return self.honoured - h, self.expired - e

    # ---- internals -------------------------------------------------------------
    def _set_deadline(self, i: int, ttl_s: float) -> None:
        self._gen[i] += 1
        self._deadline[i] = self.clock() + ttl_s
        heapq.heappush(self._heap, (self._deadline[i], i, self._gen[i]))
        if len(self._heap) > 4 * self.max_sessions + 64:  # renewals leave stale entries: keep the heap bounded
            self._heap = [(self._deadline[j], j, self._gen[j]) for j in self._slot.values()]
            heapq.heapify(self._heap)

    def _release_keys(self, i: int) -> None:
        count = self._count
        for k in self._keys[i]:
            n = count.get(k)
            if n is not None:  # None: evicted while leased
                if n <= 1:
                    del count[k]
                else:
                    count[k] = n - 1
        self._keys[i].clear()

    def _end(self, i: int) -> None:
        self._release_keys(i)
        del self._slot[self._ids[i]]
        self._ids[i] = None
        self._gen[i] += 1
        self._free.append(i)


def table_for(max_fraction: float, max_sessions: int, num_chunks: int, clock=time.monotonic) -> LeaseTable | None:
    """The lease table of a tier of ``num_chunks`` (settings ``lease_max_fraction``/``lease_max_sessions``);
    None when leases are off (a share of 0, or one that rounds to no chunk)."""
    max_chunks = int(max_fraction * num_chunks)
    return LeaseTable(max_sessions, max_chunks, clock) if max_chunks > 0 else None


def renew_from(table: LeaseTable | None, params: Any) -> LeaseHint | None:
    """A request arrived: renew its session's lease if its ``kv_transfer_params`` carry a hint."""
    hint = parse_hint(params) if table is not None else None
    if hint is not None:
        table.renew(hint.session, hint.ttl_s)
    return hint


def lease_from(table: LeaseTable | None, params: Any, keys: Sequence) -> int:
    """A request finished: lease its prefix ``keys`` (head first) to its session, if it carries a hint."""
    hint = parse_hint(params) if table is not None else None
    return table.lease(hint.session, hint.ttl_s, keys) if hint is not None else 0
