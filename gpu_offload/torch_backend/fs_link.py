"""Worker side of the file tier: every chunk file read and write of one worker.

It sits between the worker's host slab (``HostChunkPool``) and a
``FileTier``, and follows the slab's one rule: **no new bytes go into a slot
while a file write still reads it** (``WriteTicket.cancel_or_wait`` first),
so a file can never hold a newer chunk's bytes under an older key.

* write_through (default): once a store into a slot completes, the slot is
  queued for writing under its key (no copy; the ticket is kept per slot).
  Other replicas see the chunk as soon as the write lands.
* write_back: a stored chunk stays only in host RAM ("dirty") until the
  first of: ``write_back_lag_s`` has passed (a background thread writes it
  from the slot, so an idle engine still publishes it), the manager evicts
  it (its bytes are copied into a small preallocated ring before the slot is
  reused, and written from there), or shutdown (``close`` writes every
  dirty chunk, then waits for the queue). ``write_back_lag_s=None``: no
  time bound (eviction and shutdown only). A full ring drops the write, a
  full tier queue defers a lag write to the next round (both counted): the
  engine never waits for a file.
* promotion: the slots of file-resident chunks are filled from their files
  on the tier's I/O threads (reads go ahead of writes and are verified);
  the engine polls, then copies the slots to the device like any host hit.
  A failed read leaves the slot invalid, so its blocks become a load error
  and vLLM recomputes them.

* reset (``follow_epoch``): after ``reset_prefix_cache(reset_connector=True)``
  the scheduler's specs name a new epoch; the first one seen moves this
  worker to that epoch's namespace (``make_tier``), discards write-back
  chunks not yet written (old weights' KV) and retires the old tier on a
  thread (its files deleted), so old KV never comes back from files.

No torch here: the transfer engine calls these hooks with slot numbers, on
its own thread; the write-back drainer thread shares the per-slot state
under one lock, held only for bookkeeping and queueing (never for I/O).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from gpu_offload._log import get_logger
from tpu_offload.core.fs import FileTier, TierState, WriteTicket
from tpu_offload.core.fs.lag import LagDrain
from tpu_offload.core.pool import HostChunkPool

logger = get_logger(__name__)

RING_MAX_SLOTS = 32
RING_MAX_BYTES = 256 << 20


@dataclasses.dataclass
class FileStats:
    """Monotonic counters (tests, the demo and benchmarks read them)."""

    writes: int = 0  # write-through writes queued
    write_backs: int = 0  # write-back writes queued on eviction (from the ring)
    lag_writes: int = 0  # write-back writes queued because a chunk was dirty for the lag
    shutdown_writes: int = 0  # write-back writes queued by close()
    lag_deferred: int = 0  # lag writes put off a round because the tier queue was full
    writes_dropped: int = 0  # the tier refused (queue full, read-only, off)
    write_backs_ring_full: int = 0  # no free ring buffer: not written
    reset_discarded: int = 0  # write-back chunks of the old weights dropped at a reset
    promotions: int = 0  # chunks filled from files
    promotion_failures: int = 0  # missing, corrupt or unreadable: recomputed
    promoted_bytes: int = 0
    promotion_seconds: float = 0.0  # from queueing the reads to the last one landing


class Promotion:
    """The reads of one load job; completes on the tier's I/O threads."""

    def __init__(self, slots: list[int]):
        self.slots = slots
        self.ok = np.zeros(len(slots), dtype=bool)
        self._left = len(slots)
        self._lock = threading.Lock()
        self._event = threading.Event()
        self.t0 = time.perf_counter()
        self.t1 = self.t0
        if not slots:
            self._event.set()

    def done(self, i: int, ok: bool) -> None:
        with self._lock:
            self.ok[i] = ok
            self._left -= 1
            last = self._left == 0
        if last:
            self.t1 = time.perf_counter()
            self._event.set()

    def ready(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class FileLink:
    def __init__(self, tier: FileTier, pool: HostChunkPool, write_mode: str = "write_through",
                 ring_slots: int | None = None, *, write_back_lag_s: float | None = None, make_tier=None):
        if write_mode not in ("write_back", "write_through"):
            raise ValueError(f"write_mode must be 'write_back' or 'write_through', got {write_mode!r}")
        if write_back_lag_s is not None and not write_back_lag_s >= 0:
            raise ValueError(f"write_back_lag_s must be >= 0 or None, got {write_back_lag_s!r}")
        if tier.chunk_bytes != pool.chunk_bytes:
            raise ValueError(f"file tier stores {tier.chunk_bytes} B chunks, host slots hold {pool.chunk_bytes} B")
        self.tier = tier
        self.pool = pool
        self.epoch = ""
        self._make_tier = make_tier
        self.write_mode = write_mode
        self.write_back_lag_s = write_back_lag_s if write_mode == "write_back" else None
        n = pool.num_slots
        self._lock = threading.Lock()
        self._tickets: list[WriteTicket | None] = [None] * n  # writes reading a slot
        self._slot_key: list[bytes | None] = [None] * n
        self._slot_salt: list[bytes] = [b""] * n  # the request's cache_salt: the tenant keys of its file
        self._key_slot: dict[bytes, int] = {}
        self._dirty: dict[int, float] = {}  # write-back: slot -> when its store completed, oldest first
        self.stats = FileStats()
        self.ring: HostChunkPool | None = None
        self._ring_tickets: list[WriteTicket | None] = []
        self._ring_next = 0
        self._drainer: LagDrain | None = None
        if write_mode == "write_back":
            if ring_slots is None:
                ring_slots = min(tier.queue_depth, RING_MAX_SLOTS, max(1, RING_MAX_BYTES // pool.stride))
            self.ring = HostChunkPool(max(1, ring_slots), pool.chunk_bytes)
            self._ring_tickets = [None] * self.ring.num_slots
            if self.write_back_lag_s is not None:
                self._drainer = LagDrain(lambda lag: self.drain(older_than=lag), self.write_back_lag_s, "fs-write-back")

    # ---- hooks of the transfer engine ------------------------------------
    def follow_epoch(self, epoch: str) -> None:
        """The scheduler reset the tiers (``epoch`` changed): move to that epoch's namespace."""
        if epoch == self.epoch or self._make_tier is None:
            return
        new = self._make_tier(epoch)
        with self._lock:
            self.epoch = epoch
            self.stats.reset_discarded += len(self._dirty)
            self._dirty.clear()  # the old weights' KV: never written anywhere now
            old, self.tier = self.tier, new
            new.journal, old.journal = old.journal, None
        logger.info("file tier: cache reset, now at %s; retiring %s", new.ns_dir, old.ns_dir)
        threading.Thread(target=old.retire, kwargs={"timeout": 60}, name="fs-retire", daemon=True).start()

    def before_overwrite(self, slots: Sequence[int], keys: Sequence[bytes] | None,
                         evicted: Sequence[bytes] = (), salt: bytes = b"") -> None:
        """Slots are about to receive new bytes (a store or a promotion).

        Evicted dirty chunks are written back first (write_back), then writes
        still reading the slots are cancelled or waited for, then the slots
        are recorded under their new keys (``None``: unknown, never written).
        """
        with self._lock:
            if evicted and self.ring is not None:
                for key in evicted:
                    slot = self._key_slot.get(key)
                    if slot is not None and self._dirty.pop(slot, None) is not None and self.pool.valid[slot]:
                        self._write_back(key, slot)
            tickets = self._tickets
            for i, slot in enumerate(slots):
                t = tickets[slot]
                if t is not None:
                    t.cancel_or_wait()
                    tickets[slot] = None
                self._dirty.pop(slot, None)
                self._assign(slot, keys[i] if keys is not None else None)
                self._slot_salt[slot] = salt

    def after_store(self, slots: Sequence[int]) -> None:
        """A store into ``slots`` completed (they are valid): write-through now,
        write-back within the lag."""
        with self._lock:
            if self.write_mode == "write_back":
                now = time.monotonic()
                for slot in slots:
                    if self._slot_key[slot] is not None:
                        self._dirty[slot] = now
                if self._dirty and self.write_back_lag_s == 0 and self._drainer is not None:
                    self._drainer.poke()
                return
            for slot in slots:
                key = self._slot_key[slot]
                if key is None:
                    continue
                t = self.tier.submit_write(key, self.pool.row(slot), self._slot_salt[slot])
                if t is None:
                    self.stats.writes_dropped += 1
                else:
                    self._tickets[slot] = t
                    self.stats.writes += 1

    def start_promotion(self, slots: list[int], keys: list[bytes], evicted: Sequence[bytes] = (),
                        salt: bytes = b"", budget_s: float = 0.0) -> Promotion:
        """Queue the reads that fill ``slots``; the slots are invalid until they land.

        ``budget_s``: the load's hedge (``core/costs.py``): a read not done by then fails (0: none)."""
        self.before_overwrite(slots, keys, evicted, salt)
        self.pool.valid[slots] = False
        p = Promotion(slots)
        for i, (slot, key) in enumerate(zip(slots, keys)):
            if not self.tier.submit_read(key, self.pool.row(slot), lambda ok, i=i: p.done(i, ok), salt,
                                         deadline_s=budget_s if budget_s > 0 else None):
                p.done(i, False)
        return p

    def finish_promotion(self, p: Promotion) -> None:
        """On the engine thread, once ``p.ready()``: publish what landed."""
        good = [s for s, ok in zip(p.slots, p.ok) if ok]
        self.pool.valid[good] = True
        s = self.stats
        s.promotions += len(good)
        s.promotion_failures += len(p.slots) - len(good)
        s.promoted_bytes += len(good) * self.pool.chunk_bytes
        s.promotion_seconds += p.t1 - p.t0

    @property
    def dirty_chunks(self) -> int:
        """Write-back chunks only in host RAM so far."""
        return len(self._dirty)

    def flush(self, timeout: float | None = None) -> bool:
        return self.tier.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Write every dirty chunk, wait for the queue, close the tier."""
        if self._drainer is not None:
            self._drainer.stop(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._dirty:
            before = len(self._dirty)
            self.drain(older_than=None, why="shutdown")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.tier.flush(left) or len(self._dirty) == before:
                break
        if self._dirty:
            logger.warning("file tier: %d write-back chunk(s) could not be written before shutdown",
                           len(self._dirty))
            self.stats.writes_dropped += len(self._dirty)
            self._dirty.clear()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.tier.close(left)

    # ---- write-back draining ---------------------------------------------
    def drain(self, older_than: float | None, why: str = "lag") -> int:
        """Queue writes of dirty chunks stored at least ``older_than`` seconds
        ago (None: all), oldest first, until the tier queue is full."""
        queued = 0
        with self._lock:
            if not self._dirty:
                return 0
            cutoff = None if older_than is None else time.monotonic() - older_than
            for slot, t0 in list(self._dirty.items()):
                if cutoff is not None and t0 > cutoff:
                    break
                key = self._slot_key[slot]
                if key is None or not self.pool.valid[slot]:
                    del self._dirty[slot]
                    continue
                ticket = self.tier.submit_write(key, self.pool.row(slot), self._slot_salt[slot])
                if ticket is None:
                    if self.tier.state is TierState.RW:  # queue full: try again next round
                        self.stats.lag_deferred += 1
                        break
                    del self._dirty[slot]  # read-only or off: never written
                    self.stats.writes_dropped += 1
                    continue
                del self._dirty[slot]
                self._tickets[slot] = ticket
                queued += 1
            if why == "shutdown":
                self.stats.shutdown_writes += queued
            else:
                self.stats.lag_writes += queued
        return queued

    # ---- internals ---------------------------------------------------------
    def _assign(self, slot: int, key: bytes | None) -> None:
        old = self._slot_key[slot]
        if old is not None and self._key_slot.get(old) == slot:
            del self._key_slot[old]
        self._slot_key[slot] = key
        if key is not None:
            self._key_slot[key] = slot

    def _write_back(self, key: bytes, slot: int) -> None:
        i = self._free_ring_row()
        if i is None:
            self.stats.write_backs_ring_full += 1
            if self.tier.journal is not None:
                self.tier.journal.failed(key)
            return
        row = self.ring.row(i)
        np.copyto(row, self.pool.row(slot))
        t = self.tier.submit_write(key, row, self._slot_salt[slot])
        if t is None:
            self.stats.writes_dropped += 1
            return
        self._ring_tickets[i] = t
        self.stats.write_backs += 1

    def _free_ring_row(self) -> int | None:
        tickets = self._ring_tickets
        n = len(tickets)
        for j in range(n):
            i = (self._ring_next + j) % n
            t = tickets[i]
            if t is None or t.done():
                tickets[i] = None
                self._ring_next = (i + 1) % n
                return i
        return None
