"""Load plans: which chunks a request gets from the tiers, sent in order.

A plan is built once the request's blocks exist. Chunks in the host tier
are pinned at once; chunks only on the shared filesystem get a host slot and
a promotion order first, and join the load when the worker has read them. A
chunk whose promotion failed is sent with slot -1 so the worker reports its
blocks as load errors (vLLM recomputes them). Asynchronous plans are sent in
parts within the step's load budget (connector/budget.py), in order; the
request's last part tells the worker to report it in ``finished_recving``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tpu_offload.connector.metadata import LoadOp, OffloadMetadata, PromoteOp
from tpu_offload.core.keys import ChunkKey


@dataclasses.dataclass
class Order:
    """One work order sent to every worker process; done when all have reported."""

    req_id: str
    keys: list[ChunkKey]
    slots: list[int]
    items: list[int] = dataclasses.field(default_factory=list)  # plan indices (promotions)
    reports: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # process -> bad slots
    op_id: int = -1  # set when every process has reported it (the cost model's clock)



def settle_store(manager, order: Order, failed: set[int]) -> list[ChunkKey]:
    """Complete an order's stores in the manager: failed slots vanish. Returns their keys."""
    ok = [k for k, s in zip(order.keys, order.slots) if s not in failed]
    bad = [k for k, s in zip(order.keys, order.slots) if s in failed]
    if ok:
        manager.complete_store(ok, True)
    if bad:
        manager.complete_store(bad, False)
    return bad

class InFlight:
    """Chunk keys of asynchronous loads vLLM is still waiting for, per request.

    vLLM caches a request's loaded blocks only when its load finishes, so a
    second request sharing the prefix must wait for that (then hit vLLM's own
    prefix cache) rather than load the same chunks again. Counted per key:
    requests may overlap. Per request so every release is idempotent.
    """

    def __init__(self):
        self._by_req: dict[str, frozenset[ChunkKey]] = {}
        self._count: dict[ChunkKey, int] = {}

    def add(self, req_id: str, keys: list[ChunkKey]) -> None:
        self.release(req_id)
        if not keys:
            return
        own = self._by_req[req_id] = frozenset(keys)
        for k in own:
            self._count[k] = self._count.get(k, 0) + 1

    def release(self, req_id: str) -> None:
        for k in self._by_req.pop(req_id, ()):
            n = self._count[k] - 1
            if n:
                self._count[k] = n
            else:
                del self._count[k]

    def has(self, req_id: str) -> bool:
        return req_id in self._by_req

    def busy(self, keys: list[ChunkKey], req_id: str) -> bool:
        """Whether another request is loading any of ``keys``."""
        own = self._by_req.get(req_id, frozenset())
        return any(k in self._count and (k not in own or self._count[k] > 1) for k in keys)

    def clear(self) -> None:
        self._by_req.clear()
        self._count.clear()

    def __len__(self) -> int:
        return len(self._by_req)


@dataclasses.dataclass
class LoadPlan:
    req_id: str
    async_load: bool
    keys: list[ChunkKey]
    slots: list[int]
    blocks: list[int]  # blocks_per_chunk destination ids per chunk
    ready: list[bool]  # pinned in the host tier (or failed: slot -1)
    to_promote: list[int] = dataclasses.field(default_factory=list)  # indices not yet sent
    evict: list[tuple[int, bytes, bytes]] = dataclasses.field(default_factory=list)  # write-back before promoting
    salt: bytes = b""  # the request's cache_salt (file tier: the tenant keys of its files)
    groups: list[list[int]] = dataclasses.field(default_factory=list)  # ids per layer class (LoadOp.groups)
    restart: int = -1  # LoadOp.restart
    src: list[list[int] | None] = dataclasses.field(default_factory=list)  # per chunk: HBM source ids (pinned)
    budget_s: float = 0.0  # the hedge of its promotions (PromoteOp.budget_s): 0 for none
    emitted: int = 0
    cancelled: bool = False


class LoadPlanner:
    def __init__(self, manager, bpc: int, next_id: Callable[[], int]):
        self.manager = manager
        self.bpc = bpc
        self._next_id = next_id
        self.plans: dict[str, LoadPlan] = {}
        self.load_orders: dict[int, Order] = {}
        self.promote_orders: dict[int, Order] = {}
        self.hbm_orders: dict[int, Order] = {}  # op -> HBM source blocks pinned until every process reports it
        self.unpin_hbm: Callable[[list[int]], None] = lambda ids: None  # connector/interleave.py

    def add(self, plan: LoadPlan) -> None:
        self.plans[plan.req_id] = plan

    def emit(self, meta: OffloadMetadata, budget_blocks: int, on_defer: Callable[[int], None]) -> int:
        """Add this step's promotions and loads to ``meta``; returns the load budget left.

        Loads inside the step (not asynchronous) go whole, and first: asynchronous parts get what they leave.
        """
        budget_blocks -= sum(self._ready_end(p) - p.emitted for p in self.plans.values()
                             if not p.async_load and not p.cancelled) * self.bpc
        for req_id in list(self.plans):
            plan = self.plans[req_id]
            if plan.to_promote and not plan.cancelled:
                idx, plan.to_promote = plan.to_promote, []
                op = PromoteOp(self._next_id(), req_id, [plan.slots[i] for i in idx],
                               [bytes(plan.keys[i]) for i in idx], plan.evict, plan.salt, plan.budget_s)
                plan.evict = []
                meta.promotes.append(op)
                self.promote_orders[op.op_id] = Order(req_id, [plan.keys[i] for i in idx], op.slots, idx)
            if plan.cancelled:
                meta.loads.append(self._load_op(plan, 0))  # empty and last
                del self.plans[req_id]
                continue
            avail = self._ready_end(plan) - plan.emitted
            take = min(avail, max(0, budget_blocks) // self.bpc) if plan.async_load else avail
            if avail > take:
                on_defer((avail - take) * self.bpc)
            if take:
                if plan.async_load:
                    budget_blocks -= take * self.bpc
                meta.loads.append(self._load_op(plan, take))
            if plan.emitted == len(plan.keys):
                del self.plans[req_id]
        return budget_blocks

    @staticmethod
    def _ready_end(plan: LoadPlan) -> int:
        end = plan.emitted
        while end < len(plan.keys) and plan.ready[end]:
            end += 1
        return end

    def _load_op(self, plan: LoadPlan, take: int) -> LoadOp:
        a, b = plan.emitted, plan.emitted + take
        plan.emitted = b
        last = plan.cancelled or b == len(plan.keys)
        src = plan.src[a:b] if plan.src else []
        op = LoadOp(self._next_id(), plan.req_id, plan.slots[a:b], plan.blocks[a * self.bpc : b * self.bpc],
                    async_load=plan.async_load, last=last,
                    groups=[g[a * self.bpc : b * self.bpc] for g in plan.groups], restart=plan.restart,
                    src=[i for ids in src for i in (ids or [-1] * self.bpc)] if any(src) else [])
        pinned = [(k, s) for k, s in zip(plan.keys[a:b], plan.slots[a:b]) if s >= 0]
        if pinned:
            self.load_orders[op.op_id] = Order(plan.req_id, [k for k, _ in pinned], [s for _, s in pinned])
        held = [i for ids in src if ids for i in ids]
        if held:
            self.hbm_orders[op.op_id] = Order(plan.req_id, [], [], items=held)
        return op

    def _unpin_unsent(self, plan: LoadPlan) -> None:
        """HBM source blocks of chunks never sent go back to vLLM's pool."""
        for i in range(plan.emitted, len(plan.src)):
            if plan.src[i]:
                self.unpin_hbm(plan.src[i])
                plan.src[i] = None

    def promoted(self, order: Order, failed: set[int]) -> list[ChunkKey]:
        """A promotion finished on every process: the chunks join their plan. Returns failed keys."""
        bad = settle_store(self.manager, order, failed)
        plan = self.plans.get(order.req_id)
        if plan is None or plan.cancelled:
            return bad
        for i, key, slot in zip(order.items, order.keys, order.slots):
            if slot not in failed:
                try:
                    self.manager.prepare_load([key])  # pinned for the load that follows
                except KeyError:  # dropped by a reset meanwhile
                    plan.slots[i] = -1
            else:
                plan.slots[i] = -1
            plan.ready[i] = True
        return bad

    def cancel(self, req_id: str) -> None:
        """The request finished while waiting for its load: release what was never sent."""
        plan = self.plans.get(req_id)
        if plan is None:
            return
        unsent = range(plan.emitted, len(plan.keys))
        pinned = [plan.keys[i] for i in unsent if plan.ready[i] and plan.slots[i] >= 0]
        if pinned:
            self.manager.complete_load(pinned)
        self._unpin_unsent(plan)
        if plan.to_promote:  # slots allocated for reads that were never sent
            self.manager.complete_store([plan.keys[i] for i in plan.to_promote], False)
            plan.to_promote = []
        plan.cancelled = True  # one empty last op still goes out: the worker must report finished_recving

    def invalidate(self) -> None:
        """A reset: every chunk not yet sent fails (its blocks are recomputed), pins and slots released.

        Sent loads finish normally; the manager has already doomed their pins.
        """
        for plan in self.plans.values():
            unsent = range(plan.emitted, len(plan.keys))
            pinned = [plan.keys[i] for i in unsent if plan.ready[i] and plan.slots[i] >= 0]
            if pinned:
                self.manager.complete_load(pinned)
            self._unpin_unsent(plan)
            if plan.to_promote:
                self.manager.complete_store([plan.keys[i] for i in plan.to_promote], False)
                plan.to_promote = []
            for i in unsent:
                plan.slots[i], plan.ready[i] = -1, True

    def pending(self) -> bool:
        return bool(self.plans or self.load_orders or self.promote_orders or self.hbm_orders)
