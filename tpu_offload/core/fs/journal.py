"""What this process did to the file tier, for the router's KV events.

The file tier lives in the workers, the KV-event publisher in the scheduler,
so the worker journals its outcomes and the engine adapter ships them over
its worker-to-scheduler channel each step:

* ``published``: a chunk file exists for the key (we wrote it, or found it
  already there when asked to write it);
* ``failed``: a write we were asked to do did not publish (queue full,
  read-only volume, I/O error, cancelled);
* ``removed``: a file we had seen is gone (our capacity eviction, a rejected
  file, a read that found it deleted);
* ``tier_off`` / ``tier_on``: the whole tier turned off (every lookup
  misses) or came back; the scheduler offers no file hits in between.

Bounded: the adapter drains it every step, so it never holds more than a
step's outcomes; if nobody drains it (events off elsewhere), the oldest
entries go and ``lost`` counts them, with one warning.
"""

from __future__ import annotations

import collections
import logging
import threading

log = logging.getLogger("tpu_offload.fs")

PUBLISHED, FAILED, REMOVED = "published", "failed", "removed"
# The tier itself turned off / came back (key b""): the scheduler offers no file hits meanwhile.
TIER_OFF, TIER_ON = "tier_off", "tier_on"


class FileJournal:
    def __init__(self, max_entries: int = 1 << 16):
        self._entries: collections.deque[tuple[str, bytes]] = collections.deque()
        self._max = max_entries
        self._lock = threading.Lock()
        self.lost = 0

    def _add(self, kind: str, key: bytes) -> None:
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.popleft()
                self.lost += 1
                if self.lost == 1:
                    log.warning("fs journal: more than %d file outcomes were not collected; the oldest are "
                                "dropped, so KV events for the file tier are incomplete", self._max)
            self._entries.append((kind, bytes(key)))

    def published(self, key: bytes) -> None:
        self._add(PUBLISHED, key)

    def failed(self, key: bytes) -> None:
        self._add(FAILED, key)

    def removed(self, key: bytes) -> None:
        self._add(REMOVED, key)

    def tier_state(self, off: bool) -> None:
        self._add(TIER_OFF if off else TIER_ON, b"")

    def take(self) -> list[tuple[str, bytes]]:
        """Everything since the last call, in order."""
        with self._lock:
            out = list(self._entries)
            self._entries.clear()
        return out
