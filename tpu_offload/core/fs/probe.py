"""Timed probe reads of the file tier: its speed known before a request is bet on it.

Why: the load decision (``core/costs.py``) compares a file-tier load with a
recompute. Learning the tier only from the loads it lets through means the
first requests after start are bets on a prior, and a tier the decision
stopped using is never measured again. So one thread per mount reads one of
the namespace's chunk files at two sizes (its header, then the whole file),
timed (the fastest of a few reads each), at start and again whenever no real
transfer has taught the tier for ``interval_s``: two sizes separate the
mount's latency from its bandwidth.
Each read is an outstanding transfer while it runs (``TransferCost.start``),
so a mount that hangs the probe is priced at least at the hang's age.

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


def timed_read(path: str, nbytes: int) -> int:
    """Read the first ``nbytes`` of ``path`` (cached pages dropped first); the bytes read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        got, buf = 0, bytearray(min(nbytes, 8 << 20))
        while got < nbytes:
            if fileio.fault is not None:
                fileio.fault("read")
            n = os.preadv(fd, [memoryview(buf)[: min(len(buf), nbytes - got)]], got)
            if n <= 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


class ReadProbe:
    """Probes one mount for one ``TransferCost`` (the file tier's): see the module docstring.

    ``ns_dir``: a callable giving the namespace directory to pick files from (it moves after a reset).
    """

    def __init__(self, ns_dir: Callable[[], str], cost, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, name: str = "tpu-offload-fs-probe"):
        self._ns_dir = ns_dir
        self.cost = cost
        self.interval_s = float(interval_s)
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
        that way within a second."""
        path = find_chunk_file(self._ns_dir())
        if path is None:
            return False
        try:
            size = os.lstat(path).st_size
        except OSError:
            return False
        for n in (HEADER_SIZE, size):
            best, got = float("inf"), 0
            tag = ("probe", self._seq)
            self._seq += 1
            self.cost.start(tag)  # outstanding while the reads run: a hung mount is priced at its age
            try:
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    got = timed_read(path, n)
                    best = min(best, time.perf_counter() - t0)
            except OSError as e:  # gone meanwhile (evicted), or the mount failed
                log.debug("fs probe: %s: %s", path, e)
                return False
            finally:
                self.cost.drop(tag)
            if got:
                self.cost.observe(got, best)
                self.probes += 1
        self._last = self._clock()
        return True

    def due(self) -> bool:
        """No probe and no real transfer has taught the tier for ``interval_s``."""
        now = self._clock()
        return now - max(self._last, self.cost.last_sample_at) >= self.interval_s

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
