"""The load decision on vLLM's key-by-key lookups: one decision per scan of a request's keys.

The cost model (``tpu_offload.core.costs``) decides over a whole prefix: load its longest start whose
expected time is at most its recompute, recompute the rest. vLLM asks the manager about a request's
keys one at a time, in order, after its device prefix (``OffloadingManager.lookup``). So the first
lookup of a scan decides over the rest of the request's keys (their positions are in its
``ReqContext``), and each later key of the scan reads as a hit only inside the prefix it kept.
A request's decision is counted once, when vLLM admits it (``admitted``); a scan that starts over
(vLLM looks the request up again, e.g. after a preemption) decides again. The engine's prefill time
per token, which loads are weighed against, is learned from each step's scheduling (``step_sent``)
to the worker report that echoes its id (``steps_done``).
"""

from __future__ import annotations

from typing import Callable, Iterable

from tpu_offload.core import costs

from gpu_offload.vllm.compat import offload_key_group as _group


class LoadDecisions:
    """The manager's load decisions: per-request scans, the tokens each decision counted, the step clock.

    ``tier_of(key, salt, req_context)``: where the manager would load ``key`` from (``costs.HOST``,
    ``FILE``, ``PENDING``, ``device_source.DEVICE``) or None (a miss ends the prefix); ``salt_of``:
    a request's ``cache_salt``.
    """

    def __init__(self, mode: str, bias: float, *, chunk_bytes: int, tokens_per_chunk: int,
                 tier_of: Callable, salt_of: Callable):
        self.costs = costs.CostModel(mode, bias)
        self.chunk_bytes, self.tokens_per_chunk = chunk_bytes, tokens_per_chunk
        self._tier_of, self._salt_of = tier_of, salt_of
        self._step_id = -1  # the last step's number (step_sent)
        self._scans: dict[str, _Scan] = {}  # req id -> its current lookup scan's decision
        self._decisions: dict[str, tuple[costs.Decision, int]] = {}  # req id -> (last decision, chunk tokens)
        self.decision_tokens: dict[tuple[str, str, str], int] = {}  # (action, reason, tier) -> tokens
        self._pending: dict[tuple[str, str, str], int] = {}  # since the last take_pending
        self._saved_pending = 0.0

    def worth_loading(self, key, req_context) -> bool:
        """Whether ``key`` is inside the prefix its request's load decision keeps."""
        where = getattr(req_context, "get_offload_key_position", None)
        pos = where(key) if where is not None else None
        req_id = getattr(req_context, "req_id", None)
        if pos is None or req_id is None:
            return True
        scan = self._scans.get(req_id)
        if scan is None or pos <= scan.last or scan.group != _group(key):  # a new scan of this request
            scan = self._scans[req_id] = self._decide(key, pos, req_context)
        scan.last = pos
        return pos <= scan.end

    def _decide(self, key, pos: int, req_context) -> "_Scan":
        group = _group(key)
        positions = getattr(req_context, "_offload_key_positions", {})
        later = sorted((p, k) for k, p in positions.items() if p >= pos and _group(k) == group)
        salt = self._salt_of(req_context)
        tiers, ends = [], []
        for p, k in later:
            t = self._tier_of(k, salt, req_context)
            if t is None:
                break
            tiers.append(t)
            ends.append(p)
        tokens = self.tokens_per_chunk or (ends[1] - ends[0] if len(ends) > 1 else 0)
        if not tiers or not tokens:
            return _Scan(group, pos, 1 << 62)
        d = self.costs.decide(tiers, self.chunk_bytes, tokens)
        self._decisions[req_context.req_id] = (d, tokens)
        return _Scan(group, pos, ends[d.load - 1] if d.load else pos - 1)

    def admitted(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM admitted this step: each one's last decision counted once."""
        for req_id in req_ids:
            self._scans.pop(req_id, None)
            got = self._decisions.pop(req_id, None)
            if got is not None:
                self._count(*got)

    def finished(self, req_id: str) -> None:
        self._scans.pop(req_id, None)
        self._decisions.pop(req_id, None)

    def _count(self, d: "costs.Decision", tokens: int) -> None:
        for action, loaded in (("load", True), ("recompute", False)):
            for tier, n in d.tokens_by_tier(tokens, loaded).items():
                k = (action, d.reason, tier)
                self.decision_tokens[k] = self.decision_tokens.get(k, 0) + n
                self._pending[k] = self._pending.get(k, 0) + n
        self._saved_pending += d.saved_s

    def take_pending(self) -> tuple[dict[tuple[str, str, str], int], float]:
        """Tokens by (action, reason, tier) and the seconds saved, since the last call (the stats)."""
        out = self._pending, self._saved_pending
        self._pending, self._saved_pending = {}, 0.0
        return out

    def step_sent(self, tokens: int) -> int:
        """A step was scheduled: its id, which the workers echo when its output is back (``steps_done``)."""
        step = self._step_id = self._step_id + 1
        self.costs.prefill.scheduled(step, tokens or 0)
        return step

    def steps_done(self, steps) -> None:
        self.costs.prefill.completed(steps)

    def reset(self) -> None:
        """After a cache reset: no scan outlives it, and no transfer still open teaches a tier."""
        self._scans.clear()
        for tier in self.costs.tiers.values():
            tier.forget_open()


class _Scan:
    """One pass of vLLM over a request's keys: its group, first position, last seen, and last one to load."""

    __slots__ = ("group", "last", "end")

    def __init__(self, group, start: int, end: int):
        self.group, self.last, self.end = group, start - 1, end
