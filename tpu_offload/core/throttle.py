"""Run a publish step at most once a period, without ever leaving the last state unpublished.

Mirroring live gauges into ``PROMETHEUS_MULTIPROC_DIR`` files costs a write
per gauge, so it is throttled; but the last change of a burst often comes in a
call that the throttle skips, and an idle engine makes no later call. A call
inside the period therefore schedules one trailing run at its end.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class TrailingThrottle:
    def __init__(self, fn: Callable[[], None], period_s: float = 1.0):
        self._fn = fn
        self._period = period_s
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __call__(self, force: bool = False) -> None:
        with self._lock:
            wait = self._period - (time.monotonic() - self._last)
            if not force and wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._trailing)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._last = time.monotonic()
            self._fn()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
        self(force=True)
