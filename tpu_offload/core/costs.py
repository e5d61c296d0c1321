"""Load or recompute: per-tier transfer costs and the engine's prefill cost, learned online.

A hit is worth loading only while its load finishes before recomputing it
would. Each tier's time for ``n`` bytes is modelled as ``latency + n /
bandwidth``, fitted to the tier's last completed transfers (a fixed window
that weighs recent ones most: it follows a mount that slows down). A sample
also loses weight by its age against the newest (``HALF_LIFE_S``): a tier the
decision stopped using is taught only by the probe's few reads, spaced by its
interval, and by position alone a window of old slow (or censored) loads
would outweigh them for many rounds, so a mount that recovered would never be
used again; by age, two probe rounds outweigh any window. Transfers
of different sizes separate latency and bandwidth (a weighted least-squares
line); transfers all of one size scale the prior's shape to what they took.
The prior (a modest guess) serves only until the first measurement: a
measured tier is never pulled back toward it. Timed probe reads
(``core/fs/probe.py``) measure the file tier before any request bets on it.
A transfer still outstanding counts as at least its age, so a hung mount
stops being offered after one timeout's worth of waiting, not after it fails;
one abandoned by its hedge (``hedge_s``) counts ``CENSORED`` times its age
(it took at least that). The engine's prefill time per token is the median of
its recent steps, each timed from its scheduling to its output's return.
``decide`` returns the longest prefix of a hit whose risk (``bet_seconds``: the
expected time of the tiers that can be slow, a stall of the host tier; scaled by
``bias``) is at most its recompute time; the rest is recomputed.
Backend-neutral: callers time their own transfers and steps.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

import numpy as np

HOST, FILE, PENDING = "cpu", "fs", "pending"  # host tier, file tier, a chunk whose store is in flight
HBM = "hbm"  # a chunk HBM's prefix cache holds past the device's own hit: copied block to block on the device
TIERS = (HOST, FILE, PENDING, HBM)
MODES = ("auto", "always", "never")

# Priors: modest figures a healthy tier beats, so decisions start close to "always load".
_PRIOR = {  # tier -> (bytes/s, latency s)
    HOST: (10e9, 1e-3),
    FILE: (1e9, 5e-3),
    PENDING: (5e9, 5e-3),  # finishing a store: device-to-host copy still running
    HBM: (1e12, 1e-5),  # a device-local copy: (near) free next to any tier or a recompute
}
PRIOR_PREFILL_S_PER_TOKEN = 2e-4
STALE_S = 600.0  # an outstanding transfer older than this was lost, not slow (every tier I/O has a deadline)
CENSORED = 2.0  # an abandoned transfer took at least its age: counted this many times it, so the next
# decision lands clearly on the recompute side instead of at the edge the hedge just proved too slow
RECENCY = 0.8  # weight of a sample one transfer older than the next (a window of 16: the newest ~ 5x the oldest)
# A sample this many seconds older than the newest weighs half as much again: a tier the decision stopped
# using is taught only by the probe's few reads, and these must outweigh the window's old samples within
# a minute or two of probing, however many the window holds (a mount that recovered is used again).
# Samples seconds apart (a busy tier) barely decay, so there the newest-first order rules.
HALF_LIFE_S = 10.0
HEDGE_FLOOR_S = 0.05  # the least a file read is given before it is abandoned (a tiny hit's recompute is ~0)
# A load is given this many times its estimated recompute before it is abandoned: the prefill estimate
# moves at most CLIP (4x) per sample, so it can lag a machine that slowed down by that much, and a load's
# end is seen only at a step boundary. At 1 and at 2, the real engine on a busy 2-core CPU gave up loads
# from a fast tier (the load-decision engine test); a false hedge costs its request one recompute.
HEDGE_FACTOR = 4.0
# Until the engine's prefill time is measured the estimate is the prior's guess, and a slow engine is
# well past it (tpu-inference on JAX CPU: 0.7-1.3 ms a token against 0.2): the hedge is this many times
# wider then, or it gives up loads from a fast tier; the first request still has a bound.
GUESS_MARGIN = 4.0


class TransferCost:
    """Seconds one tier takes for ``n`` bytes: ``latency + n / bandwidth``, fitted to recent transfers.

    Thread-safe: a probe thread (``core/fs/probe.py``) may feed it while the scheduler reads it.
    """

    def __init__(self, bytes_per_s: float, latency_s: float, window: int = 16,
                 clock: Callable[[], float] = time.monotonic):
        self.prior = (float(latency_s), 1.0 / float(bytes_per_s))
        self._fit = self.prior
        self._x: collections.deque = collections.deque(maxlen=window)
        self._y: collections.deque = collections.deque(maxlen=window)
        self._t: collections.deque = collections.deque(maxlen=window)  # when each sample was learned
        self._open: dict[object, float] = {}  # outstanding transfers: id -> start time
        self._clock = clock
        self._lock = threading.RLock()
        self.samples = 0
        self.last_sample_at = float("-inf")  # when the last transfer was learned (the probe's idle test)

    # ---- outstanding transfers ---------------------------------------------
    def start(self, tag: object) -> None:
        with self._lock:
            self._open.setdefault(tag, self._clock())

    def finish(self, tag: object, nbytes: int, censored: bool = False) -> None:
        """A transfer started with ``start(tag)`` completed, well or not: learn its time.

        ``censored``: it was abandoned (or failed at a deadline): it would have taken at least ``CENSORED``
        times as long."""
        with self._lock:
            t0 = self._open.pop(tag, None)
            if t0 is not None and nbytes > 0:
                self.observe(nbytes, (self._clock() - t0) * (CENSORED if censored else 1.0))

    def finish_many(self, tags: Sequence[object], nbytes: int, censored: bool = False) -> None:
        """One transfer of several outstanding tags (e.g. a job's chunks): timed from the oldest."""
        with self._lock:
            starts = [t0 for t0 in (self._open.pop(t, None) for t in tags) if t0 is not None]
            if starts and nbytes > 0:
                self.observe(nbytes, (self._clock() - min(starts)) * (CENSORED if censored else 1.0))

    def drop(self, tag: object) -> None:
        with self._lock:
            self._open.pop(tag, None)

    def forget_open(self) -> None:
        """Outstanding transfers that will never report (a reset)."""
        with self._lock:
            self._open.clear()

    def oldest_age(self) -> float:
        """Age of the oldest transfer still outstanding (one older than ``STALE_S`` was lost: dropped)."""
        with self._lock:
            if not self._open:
                return 0.0
            now = self._clock()
            for tag in [t for t, t0 in self._open.items() if now - t0 > STALE_S]:
                del self._open[tag]
            return now - min(self._open.values()) if self._open else 0.0

    # ---- the model -------------------------------------------------------------
    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not np.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            self._x.append(float(nbytes))
            self._y.append(max(float(seconds), 1e-9))
            self.samples += 1
            self.last_sample_at = self._clock()
            self._t.append(self.last_sample_at)
            self._fit = self._refit()

    def _refit(self) -> tuple[float, float]:
        """Weighted (newest first, and by age) fit of the window; the prior sets only the one-size split of the two."""
        x, y, t = np.asarray(self._x), np.asarray(self._y), np.asarray(self._t)
        age = np.maximum(t[-1] - t, 0.0)
        w = RECENCY ** np.arange(len(x))[::-1] * 0.5 ** np.minimum(age / HALF_LIFE_S, 1000.0)
        w = w / w.sum()
        lat0, inv0 = self.prior
        mx, my = float((w * x).sum()), float((w * y).sum())
        var = float((w * (x - mx) ** 2).sum())
        if var > (0.05 * mx) ** 2:  # sizes differ: latency and bandwidth separate
            inv = float((w * (x - mx) * (y - my)).sum()) / var
            if inv > 0:
                lat = min(max(my - inv * mx, 0.0), float(y.min()))
                return lat, max((my - lat) / mx, 1e-15)  # the line passes through the (weighted) mean
        # one size (or a line sloping down: noise): the prior's shape, scaled to what the transfers took
        f = float(np.exp((w * np.log(y / (lat0 + inv0 * x))).sum()))
        return lat0 * f, inv0 * f

    def seconds(self, nbytes: int) -> float:
        """Expected seconds for ``nbytes``; at least the age of the oldest transfer still outstanding."""
        if nbytes <= 0:
            return 0.0
        lat, inv = self._fit
        return max(lat + inv * nbytes, self.oldest_age())

    def stall_s(self, nbytes: int) -> float:
        """Seconds the oldest outstanding transfer has waited past what ``nbytes`` is expected to take.

        A bounded tier (host, HBM) is not bet against in ``auto``: only a stall of it counts (a load that
        queues behind one stuck there waits at least that long)."""
        if nbytes <= 0:
            return 0.0
        lat, inv = self._fit
        return max(0.0, self.oldest_age() - (lat + inv * nbytes))

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self._fit[1]

    @property
    def latency_s(self) -> float:
        return self._fit[0]


class PrefillCost:
    """The engine's seconds per prefill token: the median of its recent steps.

    A step is timed from when it is scheduled to when its output comes back (``scheduled`` with the id
    the step's metadata carries, ``completed`` with the ids the workers echo), less the time it queued
    behind the step before it, since steps execute one after another. Schedule-to-schedule intervals would
    not do: with async scheduling and a batch queue the engine schedules the next step when one is
    dispatched, not when it ends. Until any id comes back (a worker that echoes none) ``step`` times
    those intervals instead. The first echoed step of each padded size (a power of two) is not timed:
    an engine that compiles on first use compiles then (tpu-inference, even with its precompile on,
    compiles an eager input unpacking per bucket on first use: tests/tpu_engine/test_tpu_engine_served_shape.py).
    Each sample is
    clipped to ``CLIP`` times the estimate (an interval may hold an idle gap), but for the first echoed one
    while the estimate is still the prior's guess (timed to its output, it holds no gap), and the estimate is the
    median of the last ``WINDOW``: it follows a changed rate within half a window and ignores a lone outlier either way.
    Timed to their outputs, samples carry no one-sided error, so the estimate does not drift.
    """

    CLIP = 4.0
    WINDOW = 9
    MAX_OPEN = 64  # scheduled steps awaiting their echo (an older one's report was lost)

    def __init__(self, s_per_token: float | None = None, min_tokens: int = 16,
                 clock: Callable[[], float] = time.monotonic):
        self.known = s_per_token is not None  # given (a deployment's or a test's figure), not the prior's guess
        self.s_per_token = self._prior = float(PRIOR_PREFILL_S_PER_TOKEN if s_per_token is None else s_per_token)
        self._min = min_tokens
        self._clock = clock
        self._open: tuple[float, int] | None = None  # the interval fallback's step in progress
        self._recent: collections.deque = collections.deque(maxlen=self.WINDOW)  # seconds per token
        self._scheduled: collections.OrderedDict[int, tuple[float, int]] = collections.OrderedDict()
        self._last_done = float("-inf")  # when the last echoed step's output came back
        self._sizes: set[int] = set()  # padded step sizes seen (their first step is not timed)
        self.echoed = False  # step ids come back: time steps by them, not by schedule intervals
        self.samples = 0

    def scheduled(self, step_id: int, tokens: int) -> None:
        """Step ``step_id`` of ``tokens`` scheduled tokens was scheduled now."""
        if not self.echoed:
            self.step(tokens)
        if step_id < 0:
            return
        self._scheduled[step_id] = (self._clock(), int(tokens))
        while len(self._scheduled) > self.MAX_OPEN:
            self._scheduled.popitem(last=False)

    def completed(self, step_ids: Sequence[int]) -> None:
        """The outputs of steps ``step_ids`` came back now (ids already seen, e.g. another process's, are skipped)."""
        now = self._clock()
        for sid in sorted(set(step_ids)):
            entry = self._scheduled.pop(sid, None)
            if entry is None:
                continue
            while self._scheduled and next(iter(self._scheduled)) < sid:  # earlier steps whose report was lost
                self._scheduled.popitem(last=False)
            if not self.echoed:  # the interval fallback's samples may have timed dispatches: drop them
                self._recent.clear()
                self.s_per_token = self._prior
            self.echoed, self._open = True, None
            t0, n = entry
            start = max(t0, self._last_done)  # queued behind the previous step: started when that one ended
            self._last_done = now
            size = 1 << max(0, n - 1).bit_length()  # engines pad a step's tokens to a power of two
            if size not in self._sizes:  # the first step of each padded size may have compiled it: not timed
                self._sizes.add(size)
            elif n >= self._min:  # timed to its output, no idle gap: the first one replaces a guess whole
                self.observe(n, self._clip(now - start, n) if self.measured else now - start)

    def step(self, tokens: int) -> None:
        """Fallback timing: a step of ``tokens`` scheduled tokens starts now (the previous one ended)."""
        now = self._clock()
        if self._open is not None:
            t0, n = self._open
            if n >= self._min:
                self.observe(n, self._clip(now - t0, n))
        self._open = (now, int(tokens)) if tokens else None

    def _clip(self, seconds: float, tokens: int) -> float:
        return min(max(seconds / tokens, self.s_per_token / self.CLIP), self.s_per_token * self.CLIP) * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` in ``seconds`` (steps too small to say much are skipped)."""
        if tokens < self._min or not np.isfinite(seconds) or seconds <= 0:
            return
        self._recent.append(seconds / tokens)
        self.s_per_token = float(np.median(self._recent))  # the first sample replaces the prior
        self.samples += 1

    def seconds(self, tokens: int) -> float:
        return self.s_per_token * tokens

    @property
    def measured(self) -> bool:
        """Whether the estimate is this engine's (a timed step, or a given figure), not the prior's guess."""
        return self.known or bool(self._recent)


@dataclasses.dataclass
class Decision:
    """What to do with a hit of ``len(tiers)`` chunks: load the first ``load``, recompute the rest."""

    tiers: list[str]
    load: int
    reason: str  # "auto", "always", "never"
    load_s: float = 0.0  # expected seconds to load the first ``load`` chunks
    recompute_s: float = 0.0  # expected seconds to recompute them
    saved_s: float = 0.0  # expected seconds saved against the other choice for the whole hit

    @property
    def recomputed(self) -> int:
        return len(self.tiers) - self.load

    def tokens_by_tier(self, chunk_tokens: int, loaded: bool) -> dict[str, int]:
        part = self.tiers[: self.load] if loaded else self.tiers[self.load :]
        out: dict[str, int] = {}
        for t in part:
            out[t] = out.get(t, 0) + chunk_tokens
        return out


class CostModel:
    """Every tier's ``TransferCost`` and the engine's ``PrefillCost``, with the deployment's settings."""

    def __init__(self, mode: str = "auto", bias: float = 1.0, host_bytes_per_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if mode not in MODES:
            raise ValueError(f"load decision mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode = mode
        self.bias = float(bias)
        self.tiers = {t: TransferCost(*_PRIOR[t], clock=clock) for t in TIERS}
        if host_bytes_per_s:
            self.tiers[HOST] = TransferCost(host_bytes_per_s, _PRIOR[HOST][1], clock=clock)
        self.prefill = PrefillCost(clock=clock)

    def load_seconds(self, counts: dict[str, int], chunk_bytes: int) -> float:
        """Expected seconds to load chunks from several tiers: each tier's part, then the device copy of all.

        Parts run one after another (a conservative sum): a file is read into a host slot and a pending
        store must finish before the host-to-device copy that every chunk but an HBM one takes.
        """
        total = sum(counts.values()) - counts.get(HBM, 0)
        s = self.tiers[HOST].seconds(total * chunk_bytes)
        for t in (FILE, PENDING, HBM):
            if counts.get(t):
                s += self.tiers[t].seconds(counts[t] * chunk_bytes)
        return s

    def bet_seconds(self, counts: dict[str, int], chunk_bytes: int) -> float:
        """What loading chunks from several tiers risks against recomputing them, for ``auto``.

        Tiers that can be slow (the file tier, a store still in flight) count their expected time; the
        host tier and HBM count only a stall (``TransferCost.stall_s``). A host copy moves KV far faster
        than a prefill recomputes it on every supported accelerator; what the scheduler measures of it is
        mostly the engine step it lands in, which would make ``auto`` recompute hits smaller than a step's
        worth of tokens: compute spent to save that request one step.
        """
        total = sum(counts.values()) - counts.get(HBM, 0)
        s = self.tiers[HOST].stall_s(total * chunk_bytes)
        if counts.get(HBM):
            s += self.tiers[HBM].stall_s(counts[HBM] * chunk_bytes)
        for t in (FILE, PENDING):
            if counts.get(t):
                s += self.tiers[t].seconds(counts[t] * chunk_bytes)
        return s

    def decide(self, tiers: Sequence[str], chunk_bytes: int, chunk_tokens: int, skip_tokens: int = 0) -> Decision:
        """The longest prefix of a hit (one tier name per chunk) worth loading.

        ``skip_tokens``: tokens of the first chunk the engine already holds (not recomputed either way).
        """
        tiers = list(tiers)
        n = len(tiers)
        if not n or self.mode == "always":
            return Decision(tiers, n, "always")
        if self.mode == "never":
            return Decision(tiers, 0, "never", saved_s=0.0)
        counts = {t: 0 for t in TIERS}
        best, best_l, best_r = 0, 0.0, 0.0
        tokens = -skip_tokens
        load_all = rec_all = 0.0
        for i, t in enumerate(tiers):
            counts[t] = counts.get(t, 0) + 1
            tokens += chunk_tokens
            load_all = self.load_seconds(counts, chunk_bytes)
            rec_all = self.prefill.seconds(tokens)
            if self.bias * self.bet_seconds(counts, chunk_bytes) <= rec_all:
                best, best_l, best_r = i + 1, load_all, rec_all
        # against loading everything: what the cut saves; the loaded part saves its recompute time
        rest = max(0.0, (load_all - best_l) - (rec_all - best_r))
        return Decision(tiers, best, "auto", best_l, best_r, max(0.0, best_r - best_l) + rest)

    def hedge_s(self, tokens: int) -> float:
        """Seconds a file-tier load of ``tokens`` hit tokens may take before it is abandoned (``auto`` only).

        The time recomputing them would take: past it the load can no longer win, so its reads are given
        up and the tokens recomputed (a failed load). ``HEDGE_FACTOR`` times that estimate (``GUESS_MARGIN``
        times more while the estimate is the prior's guess), at least ``HEDGE_FLOOR_S``; 0 (no hedge) in
        other modes.
        """
        if self.mode != "auto" or tokens <= 0:
            return 0.0
        margin = 1.0 if self.prefill.measured else GUESS_MARGIN
        return max(HEDGE_FACTOR * margin * self.prefill.seconds(tokens), HEDGE_FLOOR_S)
