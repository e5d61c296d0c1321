"""The write-back clock: chunks stored only in host RAM reach the file tier within ``lag`` seconds.

A step loop only writes back on eviction or when it runs; an idle engine runs
no step, so a thread wakes every ``lag / 4`` (10 ms to 1 s), or at once when
poked (``lag == 0``), and drains what is older than ``lag``. Shared by both
engines' file-tier glue.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class LagDrain:
    def __init__(self, drain: Callable[[float], object], lag_s: float, name: str,
                 has_work: Callable[[], bool] = lambda: True):
        self._drain, self._lag, self._has_work = drain, lag_s, has_work
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        period = min(max(self._lag / 4, 0.01), 1.0)
        while not self._closed:
            self._wake.wait(period)
            self._wake.clear()
            if self._closed:
                return
            try:
                if self._has_work():
                    self._drain(self._lag)
            except Exception:  # never let the thread die silently
                log.exception("file tier: write-back drain failed")
