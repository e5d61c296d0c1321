"""Timed probe reads of the file tier: its speed known before a request is bet on it.

Why: the load decision (``core/costs.py``) compares a file-tier load with a
recompute. Learning the tier only from the loads it lets through means the
first requests after start are bets on a prior, and a tier the decision
stopped using is never measured again. So one thread per mount reads one of
the namespace's chunk files at two sizes (its header, then the whole file),
timed (the fastest of a few reads each), at start and again whenever no real
transfer has taught the tier for ``interval_s``: two sizes separate the
mount's latency from its bandwidth. A round that moved a measured tier's
estimate by more than ``CHANGED`` is checked again after a quarter of the
interval: a mount that recovered (or failed) is confirmed quickly, which is
how a tier the decision stopped using comes back into use.
Each read is an outstanding transfer while it runs (``TransferCost.start``),
so a mount that hangs the probe is priced at least at the hang's age.

A round is bounded in time (``BUDGET_S``), not only in bytes: on a very slow
mount reading a whole chunk file a few times would tie up the mount and the
thread for minutes. The whole-file read stops at the round's deadline (its
requests sized to what the budget has left) and what it read by then is learned as it is (that many
bytes took that long: a true sample, never one that makes the tier look
faster than it was); a repeat that would not finish by the deadline is skipped.

The probe only reads (never writes), never follows a symlink, drops the
file's cached pages before each read (``posix_fadvise``, best effort, so a
page cache does not pass for the mount), and runs on its own daemon thread:
the engine never waits on it. With no chunk file yet there is nothing to
load either; it looks again each interval, or when ``poke``d.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Callable

from tpu_offload.core.fs import fileio
from tpu_offload.core.fs.format import HEADER_SIZE
from tpu_offload.core.fs.layout import is_chunk_name

log = logging.getLogger("tpu_offload.fs")

INTERVAL_S = 30.0  # a probe when no real transfer has taught the tier for this long
_PICK = 64  # chunk files looked at per probe (one is read)
REPEATS = 3  # reads per size; the fastest is learned
BUDGET_S = 5.0  # a round's reads stop at this deadline (plus about one request): at 0.1 MB/s, ~0.5 MB read
PIECE = 256 << 10  # a bounded read's first request (then sized to the budget left): its overrun on a slow mount
CHANGED = 2.0  # a round that moved the tier's estimate this much (either way) is checked again soon


def find_chunk_file(ns_dir: str, limit: int = _PICK, rng: random.Random | None = None) -> str | None:
    """A published chunk file of the namespace (``ns/ab/cd/<key hex>``), picked among the first ``limit``."""
    rng = rng or random
    found: list[str] = []
    leaves = 0
    try:
        with os.scandir(ns_dir) as top:
            subs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        rng.shuffle(subs)
        for a in subs:
            with os.scandir(a) as mid:
                for b in (e.path for e in mid if len(e.name) == 2 and e.is_dir(follow_symlinks=False)):
                    with os.scandir(b) as files:
                        found += [e.path for e in files if is_chunk_name(e.name) and e.is_file(follow_symlinks=False)]
                    leaves += 1
                    if len(found) >= limit or leaves >= limit or (found and leaves >= 8):
                        return rng.choice(found) if found else None
    except OSError:
        pass
    return rng.choice(found) if found else None


def timed_read(path: str, nbytes: int, deadline: float | None = None) -> int:
    """Read the first ``nbytes`` of ``path`` (cached pages dropped first); the bytes read.

    ``deadline`` (a ``time.perf_counter`` time): stop once it passed. Its read requests start at
    ``PIECE`` bytes and are then sized to what the rate so far can read by the deadline (at most 8 MiB):
    a slow mount overruns the deadline by about one small request, a fast one is read in large ones."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        got, buf = 0, bytearray(min(nbytes, 8 << 20))
        piece = len(buf) if deadline is None else min(len(buf), PIECE)
        t0 = time.perf_counter()
        while got < nbytes:
            if fileio.fault is not None:
                fileio.fault("read")
            n = os.preadv(fd, [memoryview(buf)[: min(piece, nbytes - got)]], got)
            if n <= 0:
                break
            got += n
            if deadline is not None:
                now = time.perf_counter()
                if now >= deadline:
                    break
                piece = max(1, int(min(len(buf), max(PIECE, got / max(now - t0, 1e-9) * (deadline - now)))))
        return got
    finally:
        os.close(fd)


class ReadProbe:
    """Probes one mount for one ``TransferCost`` (the file tier's): see the module docstring.

    ``ns_dir``: a callable giving the namespace directory to pick files from (it moves after a reset).
    """

    def __init__(self, ns_dir: Callable[[], str], cost, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, name: str = "tpu-offload-fs-probe",
                 budget_s: float | None = None):
        self._ns_dir = ns_dir
        self.cost = cost
        self.interval_s = float(interval_s)
        self.budget_s = float(BUDGET_S if budget_s is None else budget_s)
        self._soon = False  # the last round moved the estimate: the next is due after a quarter interval
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._name = name
        self._thread: threading.Thread | None = None
        self.probes = 0  # sizes timed and learned (tests, debugging)
        self._seq = 0
        self._last = float("-inf")

    def probe_once(self) -> bool:
        """Time header reads and whole-file reads of chunk files; False if there was none to read.

        Each size is read ``REPEATS`` times and its fastest read is learned: a stall of the probe's own
        thread (the engine busy at start, the GIL) only ever adds time, the mount's cost does not vary
        that way within a second. The round stops at ``budget_s`` (see the module docstring): a read cut
        short there is learned for the bytes it read, and the round ends."""
        path = find_chunk_file(self._ns_dir())
        if path is None:
            return False
        try:
            size = os.lstat(path).st_size
        except OSError:
            return False
        measured = self.cost.samples > 0
        before = self.cost.seconds(size)
        deadline = time.perf_counter() + self.budget_s
        for n in (HEADER_SIZE, size):
            best: tuple[float, int] | None = None  # (seconds, bytes) of the fastest whole read
            cut = False
            tag = ("probe", self._seq)
            self._seq += 1
            self.cost.start(tag)  # outstanding while the reads run: a hung mount is priced at its age
            try:
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    got = timed_read(path, n, deadline)
                    dt = time.perf_counter() - t0
                    if got < n and got < size:  # cut at the deadline (or the file shrank): what it took
                        best, cut = (dt, got), True
                        break
                    if got and (best is None or dt < best[0]):
                        best = (dt, got)
                    if time.perf_counter() + dt > deadline:  # another read would not finish in time
                        break
            except OSError as e:  # gone meanwhile (evicted), or the mount failed
                log.debug("fs probe: %s: %s", path, e)
                return False
            finally:
                self.cost.drop(tag)
            if best is not None and best[1]:
                self.cost.observe(best[1], best[0])
                self.probes += 1
            if cut or time.perf_counter() >= deadline:
                break
        self._last = self._clock()
        after = self.cost.seconds(size)
        self._soon = measured and before > 0 and after > 0 and max(after / before, before / after) >= CHANGED
        return True

    def due(self) -> bool:
        """No probe and no real transfer has taught the tier for ``interval_s`` (a quarter of it after a
        round that moved a measured tier's estimate by ``CHANGED``: confirm the change soon)."""
        now = self._clock()
        last = max(self._last, self.cost.last_sample_at)
        return now - last >= (self.interval_s / 4 if self._soon and self._last >= last else self.interval_s)

    def start(self) -> "ReadProbe":
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def poke(self) -> None:
        """Probe now if none has run yet (a file just appeared); never blocks."""
        if self.probes == 0:
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            if first or self.due():
                try:
                    first = not self.probe_once() and first
                except Exception:  # never take anything down: the decision falls back to real transfers
                    log.exception("fs probe failed")
            self._wake.wait(min(self.interval_s, 5.0) if first else self.interval_s / 4)
            self._wake.clear()
