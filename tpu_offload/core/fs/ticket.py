"""Tier state and the handle a caller holds on one queued write."""

from __future__ import annotations

import enum
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

from tpu_offload.core.keys import ChunkKey


class TierState(str, enum.Enum):
    RW = "rw"
    READ_ONLY = "read_only"
    OFF = "off"
    CLOSED = "closed"


class WriteTicket:
    """One queued write of a host slot view.

    The write reads the slot's memory directly (no copy), so the owner of the
    slot must call ``cancel_or_wait`` before putting new bytes in it;
    otherwise the new bytes could be published under the old key.
    """

    __slots__ = ("key", "_fut")

    def __init__(self, key: ChunkKey, fut: Future):
        self.key = key
        self._fut = fut

    def cancel_or_wait(self, timeout: float | None = None) -> bool:
        """True once the slot may be reused: the write was cancelled or ended."""
        if self._fut.cancel():
            return True
        try:
            self._fut.result(timeout)
        except FutureTimeout:
            return False
        except (Exception, CancelledError):  # a failed write has ended too; it was counted
            pass
        return True

    def wait(self, timeout: float | None = None) -> bool | None:
        """Block until the write ends; its success, or None on timeout."""
        try:
            self._fut.result(timeout)
        except FutureTimeout:
            return None
        except (Exception, CancelledError):
            pass
        return self.succeeded()

    def done(self) -> bool:
        return self._fut.done()

    def succeeded(self) -> bool | None:
        """None while in flight; False if cancelled or failed."""
        if not self._fut.done():
            return None
        if self._fut.cancelled() or self._fut.exception() is not None:
            return False
        return bool(self._fut.result())


def done_future(result: bool) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f
