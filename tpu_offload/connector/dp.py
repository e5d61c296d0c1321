"""The connector under tpu-inference's DP attention (``DPScheduler``).

What tpu-inference 0.32 does (``core/sched/dp_scheduler.py``):

* one vLLM ``Scheduler`` per attention-DP rank, each in a process forked
  from the EngineCore, each with its own connector (scheduler half) and
  ``num_blocks = total // ranks``; the one worker sees caches whose block
  dimension holds the ranks' ranges side by side (sharded over ``ATTN_DATA``);
* the ranks' connector metadata is merged into an empty ``type(meta)()``;
  only ``requests_meta`` (items' ``local_block_ids`` /
  ``save_spec.src_blocks`` / ``load_spec.dst_blocks`` shifted by
  ``rank * num_blocks_per_rank``), ``reqs_to_send`` and ``reqs_to_load``
  are carried over: any other field arrives empty;
* every rank receives the whole ``kv_connector_output`` (finished sets,
  load failures, worker metadata) of every step, not its own share;
* the ranks' ``kv_connector_stats`` are dropped from the combined
  ``SchedulerStats`` (only prefix-cache stats are summed).

One host tier serves every rank. Each rank's scheduler owns (allocates,
evicts, pins) an equal partition of the slots, so the ranks never contend for
a slot; every rank can *read* every partition. The rank scheduler processes
share no memory, so the worker, which sees every store, is the seam: it
numbers each slot's contents (a generation, bumped when a store into the
slot is dispatched) and reports, with the completions every rank already
receives, the slots being overwritten (``retired``) and the chunks now stored
(``published``: slot, generation, key). Each rank keeps those in a
``SharedIndex`` and, past the chunks its own index holds, hits on the other
ranks' chunks and loads them straight from their slots into its own blocks
(one host copy). It cannot pin another rank's slot, so its load names the
generation it saw; the worker fails the chunk (the request recomputes) if the
owner has since overwritten it. Cost: the chunk keys travel in the store
orders and back in the reports (16 bytes per chunk each way, to every rank),
a dict entry per stored chunk in every rank, and a lost hit (a recompute)
when the owner evicts between lookup and load.

So each rank wraps its whole ``OffloadMetadata`` into one ``requests_meta``
item whose ``local_block_ids`` is ``[0]``: the merge turns it into the
rank's first global block id, which tells the worker the rank's block base
and hence its rank. The worker shifts the item's block ids by it and its
slots into the rank's partition of the one host tier
(``slots_per_rank * rank``), and translates failed slots back in its report.
Op ids carry a random per-process base, so a rank recognises its own
completions among everyone's; finished request ids are filtered to the
requests holding blocks on this rank; load failures are reported per
request (``failed_recving``), never as block ids, whose numbering differs
per rank.
"""

from __future__ import annotations

import dataclasses
import secrets

from tpu_offload.connector.metadata import OffloadMetadata, OffloadReport

OP_ID_SPAN = 1 << 40  # op ids one rank may issue before its range could meet another's


@dataclasses.dataclass
class RankOrders:
    """One rank's orders as a ``requests_meta`` item that DPScheduler's merge carries."""

    meta: OffloadMetadata
    local_block_ids: list[int] = dataclasses.field(default_factory=lambda: [0])  # the merge adds the rank's base


def first_op_id(ranks: int) -> int:
    """Where a scheduler's op ids start: 0 alone, a random range per rank process under DP."""
    return 0 if ranks <= 1 else secrets.randbelow(1 << 22) * OP_ID_SPAN


def wrap(meta: OffloadMetadata) -> OffloadMetadata:
    """A rank's metadata in the only shape DPScheduler's merge keeps."""
    return OffloadMetadata(requests_meta=[RankOrders(meta)])


def _shift(ids: list[int], by: int) -> list[int]:
    return [i + by if i >= 0 else i for i in ids]


def foreign_ref(slot: int, gen: int, num_slots: int) -> int:
    """Another rank's chunk in a load order's slot list: below -1, so the planner never treats it
    as a slot of its own (no pin, no release), and it names the generation the lookup saw."""
    return -2 - (gen * num_slots + slot)


def parse_ref(ref: int, num_slots: int) -> tuple[int, int]:
    """(global slot, generation) of a ``foreign_ref``."""
    gen, slot = divmod(-2 - ref, num_slots)
    return slot, gen


class SharedIndex:
    """A rank scheduler's view of every rank's stored chunks, fed by the worker's reports."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots  # the whole tier's, all ranks
        self._by_key: dict[bytes, tuple[int, int]] = {}  # key -> (global slot, generation)
        self._by_slot: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def apply(self, report: OffloadReport) -> None:
        for slot in report.retired:
            self._retire(slot)
        for slot, gen, key in report.published:
            self._retire(slot)
            self._by_key[key], self._by_slot[slot] = (slot, gen), key

    def _retire(self, slot: int) -> None:
        key = self._by_slot.pop(slot, None)
        if key is not None and self._by_key.get(key, (None,))[0] == slot:
            del self._by_key[key]

    def extend(self, keys: list, n: int) -> int:
        """Past the ``n`` leading chunks this rank holds, how far the prefix goes with any rank's."""
        while n < len(keys) and bytes(keys[n]) in self._by_key:
            n += 1
        return n

    def place(self, manager, keys: list, idx: list[int], slots: list[int], ready: list[bool]) -> list[int]:
        """Fill ``slots`` for the chunks at ``idx`` this rank does not hold (a ``foreign_ref``; -1 when
        gone: a load error); returns the indices this rank's own index pins."""
        from tpu_offload.core.manager import Lookup

        own = []
        for i in idx:
            if manager.lookup(keys[i]) is Lookup.HIT:
                own.append(i)
                continue
            found = self._by_key.get(bytes(keys[i]))
            slots[i] = -1 if found is None else foreign_ref(found[0], found[1], self.num_slots)
            ready[i] = True
        return own

    def clear(self) -> None:
        self._by_key.clear()
        self._by_slot.clear()


class Unwrapper:
    """Worker side: the merged metadata as one ``OffloadMetadata`` in global block ids and slots."""

    def __init__(self, ranks: int, num_blocks: int, num_slots: int):
        if num_blocks % ranks or num_slots % ranks:
            raise ValueError(f"{num_blocks} cache blocks and {num_slots} host slots must divide over {ranks} "
                             "attention-DP ranks")
        self.ranks, self.blocks_per_rank, self.slots_per_rank = ranks, num_blocks // ranks, num_slots // ranks
        self.num_slots = num_slots
        self._slot_base: dict[int, int] = {}  # op id -> its rank's first slot, until its completion is reported
        self._gen = [0] * num_slots  # per slot: stores dispatched into it so far
        self._stored: dict[int, list[tuple[int, int, bytes]]] = {}  # store op id -> (slot, gen, key) to publish
        self._retired: list[int] = []
        self.foreign = 0  # chunks loaded from another rank's slots
        self.stale = 0  # loads of another rank's chunk that its owner had overwritten since the lookup
        self.metrics = None  # ConnectorMetrics: both counts exported as tpu_offload_cross_rank_loads
        self._salts: dict[int, str] = {}  # per rank, its last cache reset (OffloadScheduler.reset_cache)
        self._last = self._out = None

    def rank_of(self, block_base: int) -> int:
        rank, rest = divmod(block_base, self.blocks_per_rank)
        if rest or not 0 <= rank < self.ranks:
            raise ValueError(f"rank block base {block_base} is not a multiple of {self.blocks_per_rank} "
                             f"blocks per rank below {self.ranks} ranks")
        return rank

    def __call__(self, merged) -> OffloadMetadata | None:
        if not isinstance(merged, OffloadMetadata):
            return None
        if merged is self._last:  # start_load_kv and wait_for_save get the same object
            return self._out
        out = OffloadMetadata()
        items = [i for i in merged.requests_meta if isinstance(i, RankOrders)]
        salts = {self.rank_of(i.local_block_ids[0]): i.meta.reset_salt for i in items}
        if any(self._salts.get(r, "") != salt for r, salt in salts.items()):
            self._stored.clear()  # the ranks reset their tiers: stores dispatched before must not be published
        self._salts.update(salts)
        for item in items:
            block_base = item.local_block_ids[0]
            slot_base = self.rank_of(block_base) * self.slots_per_rank
            m = item.meta
            for op in (*m.loads, *m.stores):
                op.blocks = _shift(op.blocks, block_base)
                op.groups = [_shift(g, block_base) for g in op.groups]
                if getattr(op, "restart", -1) >= 0:
                    op.restart += block_base
                self._slot_base[op.op_id] = slot_base
            for op in m.loads:  # this step's loads are dispatched before its stores: check them first
                op.slots = [s + slot_base if s >= 0 else self._foreign(s) for s in op.slots]
            for op in m.stores:
                op.slots = _shift(op.slots, slot_base)
                for s in op.slots:
                    self._gen[s] += 1
                    self._retired.append(s)
                if op.keys:
                    self._stored[op.op_id] = [(s, self._gen[s], bytes(k)) for s, k in zip(op.slots, op.keys)]
                    op.keys = []  # no file tier under DP: the worker must not try to write them
            out.loads += m.loads
            out.stores += m.stores
            out.release += m.release
            out.restored_id = out.restored_id or m.restored_id
            out.snapshot_id = out.snapshot_id or m.snapshot_id
            out.reset_salt = out.reset_salt or m.reset_salt
        self._last, self._out = merged, out
        return out

    def _foreign(self, ref: int) -> int:
        """The global slot of another rank's chunk, or -1 (a load error) if it was overwritten since."""
        if ref == -1:
            return -1
        slot, gen = parse_ref(ref, self.num_slots)
        if slot < self.num_slots and self._gen[slot] == gen:
            self.foreign += 1
            self._count("loaded")
            return slot
        self.stale += 1
        self._count("stale")
        return -1

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.cross_rank.labels(outcome=outcome).inc()

    def localize(self, report: OffloadReport | None) -> OffloadReport | None:
        """Failed slots back in each rank's own numbering (every rank sees every entry; op ids tell whose),
        and the slots retired and chunks stored since the last report, for every rank's index."""
        if report is None:
            return None

        def local(entries, stores: bool):
            out = []
            for op_id, proc, bad in entries:
                base = self._slot_base.pop(op_id, 0)
                done = self._stored.pop(op_id, ()) if stores else ()
                report.published += [(s, g, k) for s, g, k in done if s not in bad and self._gen[s] == g]
                # another rank's slot means nothing to the issuer's index: -1
                out.append((op_id, proc, [s - base if base <= s < base + self.slots_per_rank else -1
                                          for s in bad]))
            return out

        report.retired, self._retired = self._retired, []  # before the publications of this report
        report.stores, report.loads = local(report.stores, True), local(report.loads, False)
        return report


def keep_own(output, kv_cache_manager) -> None:
    """Drop the finished request ids that belong to other ranks (vLLM asserts it knows each one).

    A request the worker reports finished sending or receiving holds blocks
    on its rank until vLLM handles that report, and on no other rank."""
    if kv_cache_manager is None:
        return

    def mine(req_id: str) -> bool:
        return any(kv_cache_manager.get_block_ids(req_id))

    for name in ("finished_sending", "finished_recving"):
        ids = getattr(output, name, None)
        if ids:
            setattr(output, name, {r for r in ids if mine(r)})
