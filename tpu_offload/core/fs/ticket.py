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

    __slots__ = ("key", "_fut", "_guard")

    def __init__(self, key: ChunkKey, fut: Future, guard=None):
        self.key = key
        self._fut = fut
        self._guard = guard  # deadline.WriteGuard with fs_io_timeout_s

    def cancel_or_wait(self, timeout: float | None = None) -> bool:
        """True once the slot may be reused: the write was cancelled, ended, or passed its deadline.

        Never waits past the write's deadline (``fs_io_timeout_s``): a write
        still in a hung ``pwritev`` then is abandoned (never published, so
        the slot's next bytes can never reach its file).
        """
        if self._fut.cancel():
            return True
        g = self._guard
        wait = timeout
        if g is not None:
            left = max(0.0, g.remaining())
            wait = left if timeout is None else min(timeout, left)
        try:
            self._fut.result(wait)
        except FutureTimeout:
            if g is not None and g.remaining() <= 0:
                return g.abandon()
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
