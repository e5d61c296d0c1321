"""Shared by the KV-event tests."""

from __future__ import annotations

import time


def wait_for(cond, timeout: float = 30.0) -> bool:
    """Events arrive on the subscriber's thread: poll ``cond`` until it holds or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()
