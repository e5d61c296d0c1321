"""Chunks the engine's own prefix cache (HBM) still holds, as a load source.

vLLM's scheduler takes its device prefix-cache hit up to the first block it
lacks, then asks the connector for the rest, and the connector stops at the
first chunk our tiers lack. When blocks alternate (the device holds A, our
tier B, the device C but our tier not: our LRU dropped a chunk the device
still caches, or its store was dropped), everything from C on would be
recomputed. Here a chunk whose every block the device block pool still
caches is a hit sourced from the device: the worker copies it block to block
into the request's own blocks (vLLM's allocator gives a request fresh blocks
past its own hit, so the copy is one extra block per chunk while it lives). When both the device and a tier hold a
chunk, the device copy is taken (no bus traffic).

Source blocks are protected from reuse with ``block_pool.touch`` (a
reference, as for any prefix hit) from the lookup, before vLLM allocates the
request's blocks (otherwise that allocation could evict and reuse the very
block to copy from), until the load completes (``free_blocks``). Pins of a
lookup that no load consumed are released when vLLM next looks the request up,
right after its allocation (``settle``), when the request finishes, and at a
reset. A request whose previous lookup kept pins but was not allocated (no
room) is looked up once without device sources, so pins cannot starve its
allocation.

The first chunk after vLLM's own hit is never taken from the device: it can
be on the device only where vLLM capped its hit on purpose (it recomputes
at least a prompt's last token), and a device copy there would turn that
synchronous recompute into an asynchronous load.

Copies run in the worker after the step's forward (the source may be a
block this very step computes). Supported for one full-attention KV group
whose engine block is one hash block (``compat.device_source_group``); any
other shape keeps the plain prefix lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gpu_offload.vllm.compat import get_offload_block_hash, get_offload_group_idx, make_offload_key
from tpu_offload.core import costs

DEVICE = costs.HBM  # tier name in our metrics and load decisions: a device-local copy, priced near free
_REFUSED_MAX = 4096


class DeviceSource:
    """Scheduler side: which chunks the block pool holds, and the references held on them."""

    def __init__(self, block_pool: Any, group_id: int, blocks_per_chunk: int, tokens_per_block: int):
        self.pool = block_pool
        self.group_id = group_id
        self.k = blocks_per_chunk
        self.tokens_per_block = tokens_per_block
        self._hashes: dict[str, Any] = {}  # req id -> its block hashes, during its lookup
        self._start: dict[str, int] = {}  # req id -> tokens vLLM's own hit covers, during its lookup
        self._pins: dict[str, dict] = {}  # req id -> {key: blocks} pinned by lookups, not yet loaded
        self._loads: dict[str, dict] = {}  # req id -> {key: blocks} of its load in flight
        self._skip_once: set[str] = set()  # requests whose next lookup takes no device source
        self._refused: OrderedDict = OrderedDict()  # keys a device-sourced load failed on
        self.pinned_blocks = 0  # references held now (tests)

    # ---- lookups ------------------------------------------------------------------
    def begin(self, req_id: str, block_hashes, num_computed_tokens: int | None = None) -> None:
        """vLLM starts looking ``req_id`` up. Pins still held from its last lookup were never
        allocated (vLLM had no room): drop them, and take no device source this time."""
        if self._pins.get(req_id):
            self.release(req_id)
            self._skip_once.add(req_id)
        elif self._skip_once:
            self._skip_once.discard(req_id)
        self._hashes[req_id] = block_hashes
        if num_computed_tokens is not None:
            self._start[req_id] = num_computed_tokens

    def end(self, req_id: str, hit_tokens) -> None:
        """The lookup is over; without a hit nothing will be allocated, so its pins go now."""
        self._hashes.pop(req_id, None)
        self._start.pop(req_id, None)
        if not hit_tokens:
            self.release(req_id)

    def cached(self, key, req_context) -> list | None:
        """The device blocks of chunk ``key`` if the pool caches every one of them."""
        req_id = getattr(req_context, "req_id", None)
        if req_id is None or req_id in self._skip_once or key in self._refused:
            return None
        if get_offload_group_idx(key) != self.group_id:
            return None
        where = getattr(req_context, "get_offload_key_position", None)
        pos = where(key) if where is not None else None
        start = self._start.get(req_id)
        if start is not None and pos is not None and pos - self.k * self.tokens_per_block <= start:
            return None  # the first chunk after vLLM's own hit (see the module doc)
        if self.k == 1:
            hashes = [get_offload_block_hash(key)]
        else:
            all_hashes = self._hashes.get(req_id)
            if pos is None or all_hashes is None or pos % (self.k * self.tokens_per_block):
                return None
            end = pos // self.tokens_per_block
            if end > len(all_hashes) or end < self.k:
                return None
            hashes = list(all_hashes[end - self.k:end])
            if make_offload_key(hashes[-1], self.group_id) != key:
                return None
        blocks = []
        for h in hashes:
            got = self.pool.get_cached_block(h, [self.group_id])
            if not got or got[0].is_null:
                return None
            blocks.append(got[0])
        return blocks

    def pin(self, req_id: str, key, blocks: list) -> None:
        mine = self._pins.setdefault(req_id, {})
        if key in mine:
            return
        self.pool.touch(blocks)
        mine[key] = blocks
        self.pinned_blocks += len(blocks)

    # ---- loads --------------------------------------------------------------------
    def take(self, req_id: str, keys) -> dict:
        """{key: blocks} of ``keys`` this request's lookup pinned: they load from the device
        and stay pinned until ``complete``; the rest of its pins are released."""
        mine = self._pins.pop(req_id, None)
        if not mine:
            return {}
        out = {k: mine.pop(k) for k in keys if k in mine}
        self._free(mine.values())
        if out:
            self._loads.setdefault(req_id, {}).update(out)
        return out

    def settle(self, req_id: str) -> None:
        """vLLM allocated the request (and called ``prepare_load`` if it loads): pins it did not take go."""
        self.release(req_id)

    def sourced(self, req_id: str, key) -> bool:
        return key in self._loads.get(req_id, ())

    def complete(self, req_id: str, keys) -> set:
        """The load finished (or failed): its source blocks are free again. Returns the device-sourced keys."""
        mine = self._loads.get(req_id)
        if not mine:
            return set()
        done = {k: mine.pop(k) for k in keys if k in mine}
        if not mine:
            del self._loads[req_id]
        self._free(done.values())
        return set(done)

    def refuse(self, keys) -> None:
        """Chunks a load failed on are not sourced from the device again (no reload loop)."""
        for k in keys:
            self._refused[k] = None
            self._refused.move_to_end(k)
        while len(self._refused) > _REFUSED_MAX:
            self._refused.popitem(last=False)

    def release(self, req_id: str) -> None:
        """Drop the lookup pins of ``req_id`` (never those of its load in flight)."""
        mine = self._pins.pop(req_id, None)
        if mine:
            self._free(mine.values())

    def finished(self, req_id: str) -> None:
        self.release(req_id)
        self._skip_once.discard(req_id)
        self._hashes.pop(req_id, None)
        self._start.pop(req_id, None)

    def reset(self) -> None:
        """vLLM's reset drops every job in flight without completing it (the workers flush them
        first): every reference goes."""
        for d in (self._pins, self._loads):
            for mine in d.values():
                self._free(mine.values())
            d.clear()
        self._skip_once.clear()
        self._refused.clear()

    def _free(self, block_lists) -> None:
        blocks = [b for bl in block_lists for b in bl]
        if blocks:
            self.pool.free_blocks(blocks)
            self.pinned_blocks -= len(blocks)
