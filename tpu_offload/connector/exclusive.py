"""The ``exclusive`` store policy on vLLM's scheduler: copy a chunk to the host when HBM lets go of it.

A complete chunk is not stored; it is watched (``core/policy.HbmWatch``) in
the blocks that hold it, tagged with vLLM's block hash. vLLM evicts a cached
block only by handing it out in ``schedule()`` (``BlockPool.get_new_blocks``
drops its hash), and every block it hands out reaches the connector in the
same ``schedule()``: in ``update_state_after_alloc`` (new requests, async
loads included) or in the scheduler output (new, resumed and running
requests). ``build_connector_meta`` checks those ids: a watched block whose
hash changed is about to be overwritten by this step's forward (or a load),
so its chunk is copied now, in ``meta.early_stores``, which the worker
gathers in ``start_load_kv``, before this step's loads and forward. The
block pool is only read, never patched.

A chunk that cannot be copied in time (staging budget, host tier full of
pinned or in-flight chunks) is lost, as an eviction is, and counted
(``exclusive_lost_chunks``): never wrong bytes, since the copy is either
ordered before the overwrite or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tpu_offload.connector import compat
from tpu_offload.connector.loads import Order
from tpu_offload.connector.metadata import StoreOp
from tpu_offload.core.keys import ChunkKey
from tpu_offload.core.manager import Lookup
from tpu_offload.core.policy import HbmWatch

log = logging.getLogger(__name__)

REQ_ID = "__exclusive_evictions__"  # store orders of evicted chunks belong to no live request


@dataclasses.dataclass(slots=True)
class _Copy:
    """What a later store of one watched chunk needs (its request may be gone by then)."""

    blocks: list[int]  # full-attention group ids, blocks_per_chunk of them
    per_class: list[list[int]]  # ids per layer class (empty: every layer moves ``blocks``)
    salt: bytes


class ExclusiveStores:
    def __init__(self, sched):
        self.sched = sched
        self.watch = HbmWatch()
        self._handed: list[int] = []  # block ids seen in update_state_after_alloc this step
        self.disabled_why = ""

    # ---- reading vLLM (never writing) ---------------------------------------
    def _tag_of(self):
        return compat.block_tag_reader(self.sched.kv_cache_manager)

    def active(self) -> bool:
        """Exclusive needs vLLM's prefix cache (its block hashes); without it every chunk is written through."""
        if self.disabled_why:
            return False
        why = ""
        if not self.sched._hbm_caching():
            why = "vLLM's prefix caching is off"
        elif self._tag_of() is None:
            why = "this vLLM's block pool does not expose block hashes"
        if why:
            self.disabled_why = why
            log.warning("tpu_offload: store_policy=exclusive needs HBM's prefix cache (%s); writing through", why)
            return False
        return True

    # ---- scheduler hooks ------------------------------------------------------
    def try_watch(self, st, c: int, key: ChunkKey, n: int, block_ids, salt: bytes) -> bool:
        """Watch chunk ``c`` of a request instead of storing it. False: store it now (write-through)."""
        if not self.active():
            return False
        s, tails = self.sched.s, self.sched.tails
        span = range(c * self.sched.bpc, (c + 1) * self.sched.bpc)
        full = block_ids[s.full_group]
        if span[-1] >= len(full):
            return False
        blocks = [full[b] for b in span]
        per_class = tails.chunk_ids(block_ids, span, in_tail=tails.in_a_tail(c, n)) if tails.classes() else []
        ids = blocks + [i for ids in per_class for i in ids]
        if not self.watch.watch(key, ids, self._tag_of(), _Copy(blocks, per_class, salt)):
            return False
        self.sched.events.record(key, st.request, c)  # the payload, while the request is alive
        return True

    def handed_out(self, blocks) -> None:
        if len(self.watch):
            for ids in compat.block_ids_by_group(blocks):
                self._handed.extend(ids)

    def emit(self, meta, so, budget: int) -> int:
        """Copy the watched chunks whose blocks this step hands to other content; returns the budget left."""
        handed, self._handed = self._handed, []
        if not len(self.watch):
            return budget
        for r in so.scheduled_new_reqs:
            for ids in compat.block_ids_by_group(r.block_ids):
                handed.extend(ids)
        for ids in getattr(so.scheduled_cached_reqs, "new_block_ids", None) or ():
            if ids:
                for g in compat.block_ids_by_group(ids):
                    handed.extend(g)
        tag_of = self._tag_of()
        evicted = self.watch.check(handed, tag_of)
        if not evicted:
            return budget
        sched, manager, bpc = self.sched, self.sched.manager, self.sched.bpc
        todo, present = [], []
        for w in evicted:
            state = manager.lookup(w.key)
            if state is Lookup.MISS:
                todo.append(w)
            else:  # already on the host (loaded from it, or a second copy's store in flight)
                present.append(w.key)
                sched.events.forget(w.key)
        if present:
            manager.touch([k for k in present if manager.lookup(k) is Lookup.HIT])
        fit = max(0, budget) // bpc
        lost = todo[fit:]
        todo = todo[:fit]
        alloc = manager.prepare_store([w.key for w in todo]) if todo else None
        while alloc is None and len(todo) > 1:
            lost = todo[len(todo) // 2:] + lost
            todo = todo[: len(todo) // 2]
            alloc = manager.prepare_store([w.key for w in todo])
        if alloc is None:
            lost = todo + lost
            todo = []
        for w in lost:
            sched.events.forget(w.key)
        core = sched.metrics.core
        core.record_exclusive("on_host", len(present))
        core.record_exclusive("lost", len(lost))
        if lost:
            sched._add("exclusive_lost_chunks", len(lost))
        if not todo:
            return budget
        evict = sched._allocated(alloc)  # host chunks this allocation evicts (write-back: written first)
        slot_of = dict(zip(alloc.keys, (int(x) for x in alloc.slots)))
        by_salt: dict[bytes, list] = {}
        for w in todo:
            if w.key in slot_of:
                by_salt.setdefault(w.payload.salt, []).append(w)
                if w.payload.salt and sched.write_back:
                    sched._salt_of[w.key] = w.payload.salt
        for salt, part in by_salt.items():
            slots = [slot_of[w.key] for w in part]
            blocks = [b for w in part for b in w.payload.blocks]
            groups: list[list[int]] = [[] for _ in sched.tails.classes()]
            for w in part:
                for lst, ids in zip(groups, w.payload.per_class):
                    lst.extend(ids)
                if groups:
                    sched.tails.record(w.key, w.payload.per_class)
            okeys = [w.key for w in part]
            op = StoreOp(next(sched._ids), REQ_ID, slots, blocks,
                         keys=[bytes(k) for k in okeys] if sched._fs_lookup is not None else [],
                         evict=evict, salt=salt, groups=groups)
            evict = []
            meta.early_stores.append(op)
            sched._store_orders[op.op_id] = Order(op.req_id, okeys, slots)
        n = len(alloc.keys)
        sched._add("exclusive_stored_chunks", n)
        core.record_exclusive("copied", n)
        return budget - n * bpc

    def reset(self) -> None:
        """A cache reset (new weights): HBM's bytes must never reach the host tier."""
        for w in self.watch.clear():
            self.sched.events.forget(w.key)
        self._handed.clear()

    def stats(self) -> dict[str, Any]:
        return {"watched_chunks": len(self.watch), "lost_unseen": self.watch.lost}
