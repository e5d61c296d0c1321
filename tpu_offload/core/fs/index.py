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
from typing import Callable, Iterable

import numpy as np


class FileIndex:
    """Guarded by one short lock; a rebuild from a scan never holds it for long.

    ``begin_rebuild`` starts a journal of every key added, touched or removed;
    ``adopt`` builds the new order from the scan off-lock (racy reads of the
    live dict are safe under the GIL, and any key they could have got wrong
    is in the journal), then swaps it in and replays the journal under the
    lock: the engine waits for O(keys changed during the scan), never for
    O(files). Per key it stores only bytes, floats and ints, which the
    garbage collector does not track: a rebuild of 150k entries creates no
    objects whose collection would stall every thread.
    """

    def __init__(self, touch_interval_s: float = 1.0):
        self._lock = threading.Lock()
        self._od: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # key -> last access
        self._disk: dict[bytes, float] = {}  # key -> last access stamped on the file (mtime)
        self._size: dict[bytes, int] = {}
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
            old = self._size.get(key)
            if old is None:
                self._disk[key] = now if disk_time is None else disk_time
            elif disk_time is not None:
                self._disk[key] = disk_time
            self.used_bytes += size - (old or 0)
            self._size[key] = size
            self._od[key] = now
            self._od.move_to_end(key)

    def touch(self, key: bytes) -> bool:
        """Mark as just used; True if the file's mtime is due a restamp."""
        now = self.now()
        with self._lock:
            if key not in self._od:
                return False
            self._changed(key)
            self._od[key] = now
            self._od.move_to_end(key)
            if now - self._disk[key] >= self._touch_interval:
                self._disk[key] = now
                return True
            return False

    def _pop(self, key: bytes) -> int:
        del self._disk[key]
        size = self._size.pop(key)
        self.used_bytes -= size
        self._changed(key)
        return size

    def remove(self, key: bytes) -> int | None:
        with self._lock:
            if self._od.pop(key, None) is None:
                return None
            return self._pop(key)

    def pop_lru_until(self, budget_bytes: int, leased=None, spare: bytes | None = None) \
            -> tuple[list[tuple[bytes, int]], int]:
        """Take least-recent entries out until the total fits the budget; returns them and how many
        leased entries were kept while an unleased one went.

        ``leased`` (a ``core.leases.LeaseTable``, or any container of keys):
        leased entries are passed over while an unleased one is left, and
        each one passed goes to the recent end with its own last access, so
        the next eviction does not meet it again first (a rescan puts it back
        in its place by time); when only leased entries are left, the least
        recent of them go. One probe per entry met. ``spare`` (the file just
        written) goes only after every leased one: a write is never undone
        because leases hold the rest of the tier.
        """
        out = []
        passed: list[tuple[bytes, float]] = []
        with self._lock:
            od = self._od
            if leased is None or not len(leased):
                while self.used_bytes > budget_bytes and od:
                    key, _ = od.popitem(last=False)
                    out.append((key, self._pop(key)))
                return out, 0
            while self.used_bytes > budget_bytes and od:
                key, last = od.popitem(last=False)
                if key in leased or key == spare:
                    passed.append((key, last))  # still counted in used_bytes: the loop ends when od does
                else:
                    out.append((key, self._pop(key)))
            unleased = len(out)
            for j in range(len(passed) if spare is not None else 0):
                if passed[j][0] == spare:  # after every leased one
                    passed.append(passed.pop(j))
                    break
            i = 0
            while self.used_bytes > budget_bytes and i < len(passed):  # only leased entries are left
                key = passed[i][0]
                i += 1
                out.append((key, self._pop(key)))
            honoured = 0
            for key, last in passed[i:]:
                od[key] = last
                honoured += key != spare
        return out, (honoured if unleased else 0)

    def begin_rebuild(self) -> None:
        """Call before the directory scan starts: from here on, changes are journaled."""
        with self._lock:
            self._journal = {}

    def abort_rebuild(self) -> None:
        with self._lock:
            self._journal = None

    def adopt(self, on_disk: Iterable[tuple[bytes, int, float]], pace: Callable[[], None] | None = None) -> None:
        """Adopt a directory scan begun after ``begin_rebuild``: (key, size, mtime) per file.

        Files gone from disk leave the index, except ones added or touched
        since the scan began. Each file's recency is the later of its mtime
        and what this process saw (mtime restamps are throttled). ``pace``
        is called once per entry in the loops that run off the lock.
        """
        pace = pace or (lambda: None)
        live = self._od
        keys: list[bytes] = []
        lasts: list[float] = []
        sizes: list[int] = []
        disks: list[float] = []
        for key, size, mtime in on_disk:
            seen = live.get(key)
            keys.append(key)
            lasts.append(mtime if seen is None or seen < mtime else seen)
            sizes.append(size)
            disks.append(mtime)
        order = np.argsort(np.asarray(lasts, dtype=np.float64), kind="stable")
        od: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        disk: dict[bytes, float] = {}
        size_of: dict[bytes, int] = {}
        used = 0
        for i in order.tolist():
            k = keys[i]
            od[k] = lasts[i]
            disk[k] = disks[i]
            size_of[k] = sizes[i]
            used += sizes[i]
            pace()
        del keys, lasts, sizes, disks
        with self._lock:
            journal, self._journal = self._journal or {}, None
            for key in journal:  # in order of change: the most recent end up last
                if od.pop(key, None) is not None:
                    del disk[key]
                    used -= size_of.pop(key)
                cur = self._od.get(key)
                if cur is not None:
                    od[key] = cur
                    disk[key] = self._disk[key]
                    size_of[key] = self._size[key]
                    used += size_of[key]
            old = self._od, self._disk, self._size
            self._od, self._disk, self._size = od, disk, size_of
            self.used_bytes = used
        for d in old:  # emptied piecewise, outside the lock: freeing 150k keys at once holds the GIL
            while d:
                d.popitem()
                pace()

    def keys_lru_order(self) -> list[bytes]:
        with self._lock:
            return list(self._od)

    def clear(self) -> None:
        with self._lock:
            self._od.clear()
            self._disk.clear()
            self._size.clear()
            self.used_bytes = 0
