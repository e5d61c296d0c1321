"""Deadlines for file-tier I/O: a hung or failing mount costs a recompute, never a hung request.

Why: an NFS server that stops answering (or a FUSE daemon that hangs) blocks
``preadv``/``pwritev``/``stat`` in the kernel, uninterruptibly; no Python
code can cancel that call. So nothing an engine thread waits on may be such
a call without a deadline:

* reads run on I/O threads; a ``Watchdog`` reports one failed at its
  deadline (the request recomputes) and the late result is dropped;
* a write that passes its deadline is abandoned (``WriteGuard``): the slot
  it reads may be reused at once, and the temp file is never published;
* presence checks (``stat``) run on a small pool with a deadline
  (``BoundedCalls``); after one times out the mount is skipped (a miss) for
  a while instead of queueing every lookup behind the hung call.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

log = logging.getLogger("tpu_offload.fs")


class Watchdog:
    """One daemon thread firing callbacks at deadlines; arming one is a heap push."""

    def __init__(self, name: str = "fs-deadline"):
        self._cv = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self._name = name
        self._thread: threading.Thread | None = None

    def arm(self, after_s: float, fn: Callable[[], None]) -> list:
        entry = [time.monotonic() + after_s, next(self._seq), fn, True]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return entry

    @staticmethod
    def disarm(entry: list) -> None:
        entry[3] = False

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or (self._heap[0][3] and self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                entry = heapq.heappop(self._heap)
            if entry[3]:
                try:
                    entry[2]()
                except Exception:
                    log.exception("fs deadline callback failed")


WATCHDOG = Watchdog()


class WriteGuard:
    """Who wins between a write's publish and the engine's "slot may be reused now"."""

    __slots__ = ("timeout_s", "deadline", "_lock", "payload_done", "abandoned")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # set when the write starts (queueing is not I/O)
        self._lock = threading.Lock()
        self.payload_done = False
        self.abandoned = False

    def start(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def remaining(self) -> float:
        return self.timeout_s if self.deadline is None else self.deadline - time.monotonic()

    def publish(self) -> bool:
        """The writer has the payload in its temp file: may it rename? False past the deadline or abandoned."""
        with self._lock:
            if self.abandoned or self.remaining() <= 0:
                self.abandoned = True
                return False
            self.payload_done = True  # the slot is not read any more: reusable whatever the rename does
            return True

    def abandon(self) -> bool:
        """The engine needs the slot: from now the write never publishes (unless its payload is already down)."""
        with self._lock:
            if not self.payload_done:
                self.abandoned = True
        return True


class BoundedCalls:
    """Metadata calls (``stat``) off the calling thread, each with a deadline.

    After a call times out the mount counts as hung for ``timeout_s``: calls
    then return ``default`` at once (a miss), so lookups never queue behind
    a hung call. ``timeouts`` counts the calls that timed out.
    """

    def __init__(self, timeout_s: float, threads: int = 2, name: str = "fs-stat"):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._hung_until = 0.0
        self.timeouts = 0
        self.skipped = 0

    def call(self, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        if time.monotonic() < self._hung_until:
            self.skipped += 1
            return default
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(self.timeout_s)
        except FutureTimeout:
            self.timeouts += 1
            if self._hung_until == 0.0 or self.timeouts == 1:
                log.warning("fs: a presence check took over %.1fs (fs_io_timeout_s); the shared directory is "
                            "treated as a miss for %.1fs at a time until it answers", self.timeout_s, self.timeout_s)
            self._hung_until = time.monotonic() + self.timeout_s
            return default
