"""A fixed pool of I/O threads with two queues: reads before writes.

A promotion read blocks a request; a write only fills the cache. With one
FIFO a burst of 256 writes would sit in front of every read, so reads go to
a high-priority queue the workers always drain first. Tasks are
``concurrent.futures.Future``s, so a not-yet-started write can be cancelled.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger("tpu_offload.fs")


class IOWorkers:
    def __init__(self, threads: int, name: str = "fs-io"):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._cv = threading.Condition()
        self._high: collections.deque = collections.deque()
        self._low: collections.deque = collections.deque()
        self._outstanding = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., Any], *args: Any, high: bool = False) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("I/O pool is closed")
            (self._high if high else self._low).append((fut, fn, args))
            self._outstanding += 1
            self._cv.notify()
        return fut

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted task has finished (or was cancelled)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._high and not self._low and not self._closed:
                    self._cv.wait()
                if self._high:
                    item = self._high.popleft()
                elif self._low:
                    item = self._low.popleft()
                else:
                    return  # closed and empty
            fut, fn, args = item
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # surfaced via the future
                        log.exception("fs I/O task failed")
                        fut.set_exception(e)
            finally:
                with self._cv:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self._cv.notify_all()
