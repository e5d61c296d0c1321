"""In-memory LRU index of one namespace's files, with byte accounting.

The directory is the truth (other processes write and delete there); this
index is our view of it, rebuilt from the directory at start and merged with
it on rescans, so eviction and ``contains`` need no syscall on the hot path.
Recency is wall-clock seconds on the file server's clock (our clock plus an
offset the tier measures), so it compares with file mtimes, which is how
recency travels between processes and survives restarts.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Iterable

import numpy as np


class _Rec:
    __slots__ = ("size", "last", "disk")

    def __init__(self, size: int, last: float, disk: float):
        self.size = size
        self.last = last  # last access we know of (wall seconds)
        self.disk = disk  # last access stamped on the file (mtime)


class FileIndex:
    """Guarded by one short lock; a rebuild from a scan never holds it for long.

    ``begin_rebuild`` starts a journal of every key added, touched or removed;
    ``adopt`` builds the new order from the scan off-lock (racy reads of the
    live dict are safe under the GIL, and any key they could have got wrong
    is in the journal), then swaps it in and replays the journal under the
    lock: the engine waits for O(keys changed during the scan), never for
    O(files).
    """

    def __init__(self, touch_interval_s: float = 1.0):
        self._lock = threading.Lock()
        self._od: collections.OrderedDict[bytes, _Rec] = collections.OrderedDict()
        self._touch_interval = touch_interval_s
        self._journal: dict[bytes, None] | None = None
        self.used_bytes = 0
        self.offset = 0.0  # file server's clock minus ours (set by the tier at each rescan)

    def now(self) -> float:
        return time.time() + self.offset

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, key: bytes) -> bool:
        return key in self._od

    def _changed(self, key: bytes) -> None:
        j = self._journal
        if j is not None:
            j.pop(key, None)
            j[key] = None

    def add(self, key: bytes, size: int, disk_time: float | None = None) -> None:
        """Insert or refresh as most recent (a write or a verified read)."""
        now = self.now()
        with self._lock:
            self._changed(key)
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
        now = self.now()
        with self._lock:
            rec = self._od.get(key)
            if rec is None:
                return False
            self._changed(key)
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
            self._changed(key)
            self.used_bytes -= rec.size
            return rec.size

    def pop_lru_until(self, budget_bytes: int) -> list[tuple[bytes, int]]:
        """Take least-recent entries out until the total fits the budget."""
        out = []
        with self._lock:
            while self.used_bytes > budget_bytes and self._od:
                key, rec = self._od.popitem(last=False)
                self._changed(key)
                self.used_bytes -= rec.size
                out.append((key, rec.size))
        return out

    def begin_rebuild(self) -> None:
        """Call before the directory scan starts: from here on, changes are journaled."""
        with self._lock:
            self._journal = {}

    def abort_rebuild(self) -> None:
        with self._lock:
            self._journal = None

    def adopt(self, on_disk: Iterable[tuple[bytes, int, float]], pause_every: int = 4096) -> None:
        """Adopt a directory scan begun after ``begin_rebuild``: (key, size, mtime) per file.

        Files gone from disk leave the index, except ones added or touched
        since the scan began. Each file's recency is the later of its mtime
        and what this process saw (mtime restamps are throttled).
        """
        live = self._od
        keys, recs, lasts = [], [], []
        for n, (key, size, mtime) in enumerate(on_disk, 1):
            rec = live.get(key)
            last = max(mtime, rec.last) if rec is not None else mtime
            keys.append(key)
            recs.append(_Rec(size, last, mtime))
            lasts.append(last)
            if n % pause_every == 0:
                time.sleep(0)  # hand the GIL to a waiting engine thread
        order = np.argsort(np.asarray(lasts, dtype=np.float64), kind="stable")  # sorts without the GIL
        new: collections.OrderedDict[bytes, _Rec] = collections.OrderedDict()
        used = 0
        for n, i in enumerate(order.tolist(), 1):
            r = recs[i]
            new[keys[i]] = r
            used += r.size
            if n % pause_every == 0:
                time.sleep(0)
        with self._lock:
            journal, self._journal = self._journal or {}, None
            for key in journal:  # in order of change: the most recent end up last
                cur = self._od.get(key)
                old = new.pop(key, None)
                if old is not None:
                    used -= old.size
                if cur is not None:
                    new[key] = cur
                    used += cur.size
            self._od = new
            self.used_bytes = used

    def keys_lru_order(self) -> list[bytes]:
        with self._lock:
            return list(self._od)

    def clear(self) -> None:
        with self._lock:
            self._od.clear()
            self.used_bytes = 0
