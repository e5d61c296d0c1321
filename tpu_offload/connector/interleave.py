"""Interleaved lookups: a hit goes on through chunks HBM still caches after vLLM's first miss.

vLLM computes the device's prefix-cache hit, stops at its first missing
block, and asks the connector about the rest. The blocks after that miss may
alternate: HBM caches one chunk, the host or file tier the next (always so
with ``store_policy: exclusive``, where a chunk is in one place or the other;
also whenever the host LRU evicted a chunk HBM still caches). The scheduler
walks the chunks from the device hit on: a chunk whose blocks HBM's prefix
cache holds (the full-attention group, by vLLM's block hash) is copied on the
device into the request's new blocks, one the tiers hold is loaded, and the
hit ends at the first chunk neither has. HBM is preferred when both hold it.

The source blocks are pinned (``BlockPool.touch``: one more reference, out of
the free queue) when the load is admitted (``update_state_after_alloc``) and
freed back to the pool when the worker reports the load (every process), or
when the load is cancelled or invalidated before it is sent. A source block
vLLM handed out between the lookup and the allocation (this request's own
allocation may take it from the free queue) has lost its hash: the chunk
comes from the tiers instead, or is a load error (recomputed).

Not offered (the hit ends at the first chunk the tiers lack, as before):
several KV-cache groups (vLLM's hybrid manager: the other groups' blocks
would need their own hashes and windows), attention-DP ranks (each rank's
pool numbers its blocks in its own range, and ranks share host slots, not
HBM), sliding-window layers stored by their window (a chunk's tail would
need the window's blocks of the chunks before it), synchronous-only engines
without vLLM's prefix cache, or a vLLM whose block pool lacks the calls.
"""

from __future__ import annotations

import logging

from tpu_offload.connector import compat

log = logging.getLogger(__name__)

HBM_SLOT = -2  # LoadOp slot of a chunk copied from HBM blocks (LoadOp.src) instead of loaded from a slot


class HbmHits:
    def __init__(self, sched):
        self.sched = sched
        self.disabled_why = ""
        self.pinned = 0  # source blocks this scheduler holds a reference on (tests, stats)

    def _pool(self):
        return compat.hbm_block_pool(self.sched.kv_cache_manager)

    def active(self) -> bool:
        if self.disabled_why:
            return False
        s, why = self.sched.s, ""
        if self.sched.kv_cache_manager is None:
            return False  # not bound yet (vLLM binds it before its first schedule)
        if not self.sched._hbm_caching():
            why = "vLLM's prefix caching is off"
        elif self._pool() is None:
            why = "this vLLM's block pool lacks get_cached_block/touch/free_blocks"
        elif s.hybrid or s.full_group != 0:
            why = "several KV-cache groups"
        elif s.dp > 1:
            why = "attention-DP ranks"
        elif self.sched.tails.classes():
            why = "sliding-window layers stored by their window"
        if why:
            self.disabled_why = why
            log.info("tpu_offload: interleaved lookups off (%s): a hit ends at the first chunk the tiers lack", why)
            return False
        return True

    def chunk_blocks(self, request, c: int, exclude=frozenset()) -> list[int] | None:
        """Block ids of chunk ``c`` of ``request`` if HBM's prefix cache holds all its blocks, else None."""
        pool, bpc = self._pool(), self.sched.bpc
        hashes = request.block_hashes
        if (c + 1) * bpc > len(hashes):
            return None
        ids = []
        for b in range(c * bpc, (c + 1) * bpc):
            got = pool.get_cached_block(hashes[b], [self.sched.s.full_group])
            if not got or got[0].is_null or got[0].block_id in exclude:
                return None
            ids.append(got[0].block_id)
        return ids

    def pin(self, ids: list[int]) -> None:
        pool = self._pool()
        pool.touch([pool.blocks[i] for i in ids])
        self.pinned += len(ids)

    def release(self, ids) -> None:
        ids = [i for i in ids if i >= 0]
        if not ids:
            return
        pool = self._pool()
        pool.free_blocks(pool.blocks[i] for i in ids)
        self.pinned -= len(ids)
