"""In-memory LRU index of one namespace's files, with byte accounting.

The directory is the truth (other processes write and delete there); this
index is our view of it, rebuilt from the directory at start and merged with
it on rescans, so eviction and ``contains`` need no syscall on the hot path.
Recency is wall-clock seconds so it compares with file mtimes, which is how
recency travels between processes and survives restarts.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Iterable


class _Rec:
    __slots__ = ("size", "last", "disk")

    def __init__(self, size: int, last: float, disk: float):
        self.size = size
        self.last = last  # last access we know of (wall seconds)
        self.disk = disk  # last access stamped on the file (mtime)


class FileIndex:
    def __init__(self, touch_interval_s: float = 1.0):
        self._lock = threading.Lock()
        self._od: collections.OrderedDict[bytes, _Rec] = collections.OrderedDict()
        self._touch_interval = touch_interval_s
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, key: bytes) -> bool:
        return key in self._od

    def add(self, key: bytes, size: int, disk_time: float | None = None) -> None:
        """Insert or refresh as most recent (a write or a verified read)."""
        now = time.time()
        with self._lock:
            rec = self._od.get(key)
            if rec is None:
                self._od[key] = _Rec(size, now, now if disk_time is None else disk_time)
                self.used_bytes += size
                return
            self.used_bytes += size - rec.size
            rec.size, rec.last = size, now
            if disk_time is not None:
                rec.disk = disk_time
            self._od.move_to_end(key)

    def touch(self, key: bytes) -> bool:
        """Mark as just used; True if the file's mtime is due a restamp."""
        now = time.time()
        with self._lock:
            rec = self._od.get(key)
            if rec is None:
                return False
            rec.last = now
            self._od.move_to_end(key)
            if now - rec.disk >= self._touch_interval:
                rec.disk = now
                return True
            return False

    def remove(self, key: bytes) -> int | None:
        with self._lock:
            rec = self._od.pop(key, None)
            if rec is None:
                return None
            self.used_bytes -= rec.size
            return rec.size

    def pop_lru_until(self, budget_bytes: int) -> list[tuple[bytes, int]]:
        """Take least-recent entries out until the total fits the budget."""
        out = []
        with self._lock:
            while self.used_bytes > budget_bytes and self._od:
                key, rec = self._od.popitem(last=False)
                self.used_bytes -= rec.size
                out.append((key, rec.size))
        return out

    def replace(self, on_disk: Iterable[tuple[bytes, int, float]], scan_started: float) -> None:
        """Adopt a directory scan: (key, size, mtime) per file found.

        Files gone from disk leave the index, except ones we touched after the
        scan began (written while it ran). Each file's recency is the later of
        its mtime and what this process saw (mtime restamps are throttled).
        """
        with self._lock:
            merged = []
            seen = set()
            for key, size, mtime in on_disk:
                seen.add(key)
                rec = self._od.get(key)
                last = max(mtime, rec.last) if rec is not None else mtime
                merged.append((last, key, _Rec(size, last, mtime)))
            for key, rec in self._od.items():
                if key not in seen and rec.last >= scan_started:
                    merged.append((rec.last, key, rec))
            merged.sort(key=lambda t: t[0])
            self._od = collections.OrderedDict((k, r) for _, k, r in merged)
            self.used_bytes = sum(r.size for _, _, r in merged)

    def keys_lru_order(self) -> list[bytes]:
        with self._lock:
            return list(self._od)

    def clear(self) -> None:
        with self._lock:
            self._od.clear()
            self.used_bytes = 0
