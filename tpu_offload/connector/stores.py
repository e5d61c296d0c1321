"""Store planning on vLLM's scheduler: which of a request's chunks to store this step, and into which slots.

Apart from the scheduler's lookups and loads because a store has rules of
its own: every newly full chunk is stored the step it completes (prompt
chunks always, decode chunks with ``decode_save``), chunks the host tier
already holds are only touched, a chunk found bad is not stored again until
it ages out, the staging budget defers (never drops) the rest, and a
finished request keeps its blocks while any of its chunks is still to be
stored. Works on the scheduler's index and per-request state (``sched``),
as ``connector/exclusive.py`` does.
"""

from __future__ import annotations

import logging

from tpu_offload.connector import compat
from tpu_offload.connector.loads import Order
from tpu_offload.connector.metadata import StoreOp
from tpu_offload.core.keys import ChunkKey
from tpu_offload.core.manager import Lookup

log = logging.getLogger(__name__)


class StorePlanner:
    def __init__(self, sched):
        self.sched = sched

    def emit(self, meta, so, budget: int) -> int:
        """This step's store orders into ``meta``: requests whose blocks we hold first, then this step's
        scheduled ones. Returns the staging budget left (negative: overdrawn by the last order)."""
        sched = self.sched
        for req_id, st in list(sched._reqs.items()):
            if not st.finishing:
                continue
            computed = st.request.num_computed_tokens
            done, budget = self.plan(meta, st, computed, st.final_blocks, budget, final=True)
            if done:
                meta.release.append(req_id)
                del sched._reqs[req_id]
        scheduled = [(r.req_id, so.num_scheduled_tokens.get(r.req_id, 0)) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        scheduled += [(rid, so.num_scheduled_tokens.get(rid, 0)) for rid in cached.req_ids]
        for req_id, n_new in scheduled:
            st = sched._reqs.get(req_id)
            if st is None or st.finishing or budget < 0:
                continue
            computed = min(st.request.num_computed_tokens + n_new, st.request.num_tokens)
            _, budget = self.plan(meta, st, computed, None, budget, final=False)
        return budget

    def unstored(self, st, block_ids) -> bool:
        """At ``request_finished``: whether the request still has chunks to store (then vLLM must leave
        its blocks to us). exclusive: chunks its blocks keep cached in HBM are watched instead."""
        sched = self.sched
        n = 0 if st.stale else self.storable(st, st.request.num_computed_tokens)
        keys = sched._req_keys(st, n)
        if sched.exclusive is not None and n > st.cursor:  # its blocks stay cached in HBM: watch, do not hold them
            ids = compat.block_ids_by_group(block_ids)
            while st.cursor < n and (sched.manager.lookup(keys[st.cursor]) is Lookup.PENDING
                                     or self.watch(st, st.cursor, keys[st.cursor], n, ids)):
                st.cursor += 1
        return any(sched.manager.lookup(keys[i]) is Lookup.MISS for i in range(st.cursor, n))

    def storable(self, st, computed_tokens: int) -> int:
        """Chunks of the request whose KV is complete and whose tokens are known."""
        sched = self.sched
        req = st.request
        n = min(computed_tokens // sched.chunk_tokens, len(req.block_hashes) // sched.bpc)
        if not sched.decode_save:
            n = min(n, req.num_prompt_tokens // sched.chunk_tokens)
        return n

    def plan(self, meta, st, computed: int, block_ids, budget: int, final: bool) -> tuple[bool, int]:
        """Plan this step's stores for one request. Returns (nothing left to store, budget left)."""
        sched = self.sched
        if st.stale:
            return True, budget
        bpc = sched.bpc
        n = self.storable(st, computed)
        keys = sched._req_keys(st, n)
        touched, cand = [], []
        i = st.cursor
        if sched.exclusive is not None and i < n and block_ids is None and sched.exclusive.active():
            block_ids = compat.request_block_ids(sched.kv_cache_manager, st.request.request_id)
        while i < n:
            state = sched.manager.lookup(keys[i])
            if sched.exclusive is not None and state is not Lookup.PENDING and self.watch(st, i, keys[i], n, block_ids):
                if state is Lookup.HIT:
                    touched.append(keys[i])
                i += 1
                continue
            if state is Lookup.MISS:
                sched._quarantine.discard(keys[i])  # evicted since it was found bad: storable again
                if (len(cand) + 1) * bpc > budget:
                    break
                cand.append(i)
            elif state is Lookup.HIT and keys[i] not in sched._quarantine:  # let bad chunks age out
                touched.append(keys[i])
            i += 1
        if touched:
            sched.manager.touch(touched)
        if i < n:
            sched._defer("store", (n - i) * bpc)
        if cand:
            alloc = sched.manager.prepare_store([keys[c] for c in cand])
            while alloc is None and len(cand) > 1:  # store the longest prefix that fits
                cand = cand[: len(cand) // 2]
                i = cand[-1] + 1
                alloc = sched.manager.prepare_store([keys[c] for c in cand])
            if alloc is None:
                sched.metrics.core.record_alloc_failure()
                sched._add("alloc_failures", 1)
                # Chunks whose stores are in flight become evictable within a step or two: keep the
                # finished request's blocks until then. Only pins (loads) left: give the blocks back.
                if final and not sched.manager.stats().pending_chunks:
                    log.warning("request %s: host tier full of pinned chunks; %d final chunks not stored",
                                st.request.request_id, len(cand))
                    return True, budget
                st.cursor = cand[0]
                return False, budget
            salt = sched._store_salt(st.request)
            evict = sched._allocated(alloc, salt)
            slot_of = dict(zip(alloc.keys, (int(x) for x in alloc.slots)))
            if block_ids is None:  # the ids now: vLLM may have freed a sliding-window group's older blocks
                block_ids = compat.request_block_ids(sched.kv_cache_manager, st.request.request_id)
            slots, blocks, okeys = [], [], []
            tails = sched.tails
            groups: list[list[int]] = [[] for _ in tails.classes()]
            for c in cand:
                k = keys[c]
                if k not in slot_of:
                    continue
                slots.append(slot_of[k])
                okeys.append(k)
                span = range(c * bpc, (c + 1) * bpc)
                blocks.extend(block_ids[sched.s.full_group][b] for b in span)
                if groups:  # sliding-window layers: only the chunks a request continuing this one reads
                    per_class = tails.chunk_ids(block_ids, span, in_tail=tails.in_a_tail(c, n))
                    for lst, ids in zip(groups, per_class):
                        lst.extend(ids)
                    tails.record(k, per_class)
                sched.events.record(k, st.request, c)
            if groups:
                tails.prune(lambda k: sched.manager.lookup(k) is not Lookup.MISS)
            if slots:
                named = sched._fs_lookup is not None or sched.shared is not None  # files, or DP ranks' index
                op = StoreOp(next(sched._ids), st.request.request_id, slots, blocks,
                             keys=[bytes(k) for k in okeys] if named else [], evict=evict,
                             salt=salt, groups=groups)
                meta.stores.append(op)
                sched._store_orders[op.op_id] = Order(op.req_id, okeys, slots)
                budget -= len(slots) * bpc
        st.cursor = i
        return i >= n, budget

    def watch(self, st, c: int, key: ChunkKey, n: int, block_ids) -> bool:
        """exclusive: leave chunk ``c`` in HBM, watched, instead of storing it (False: store it)."""
        sched = self.sched
        if block_ids is None or key in sched._quarantine:
            return False
        return sched.exclusive.try_watch(st, c, key, n, block_ids, sched._store_salt(st.request))
