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


class Unwrapper:
    """Worker side: the merged metadata as one ``OffloadMetadata`` in global block ids and slots."""

    def __init__(self, ranks: int, num_blocks: int, num_slots: int):
        if num_blocks % ranks or num_slots % ranks:
            raise ValueError(f"{num_blocks} cache blocks and {num_slots} host slots must divide over {ranks} "
                             "attention-DP ranks")
        self.ranks, self.blocks_per_rank, self.slots_per_rank = ranks, num_blocks // ranks, num_slots // ranks
        self._slot_base: dict[int, int] = {}  # op id -> its rank's first slot, until its completion is reported
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
        for item in merged.requests_meta:
            if not isinstance(item, RankOrders):
                continue
            block_base = item.local_block_ids[0]
            slot_base = self.rank_of(block_base) * self.slots_per_rank
            m = item.meta
            for op in (*m.loads, *m.stores):
                op.blocks = _shift(op.blocks, block_base)
                op.groups = [_shift(g, block_base) for g in op.groups]
                op.slots = _shift(op.slots, slot_base)
                if getattr(op, "restart", -1) >= 0:
                    op.restart += block_base
                self._slot_base[op.op_id] = slot_base
            out.loads += m.loads
            out.stores += m.stores
            out.release += m.release
            out.restored_id = out.restored_id or m.restored_id
            out.snapshot_id = out.snapshot_id or m.snapshot_id
            out.reset_salt = out.reset_salt or m.reset_salt
        self._last, self._out = merged, out
        return out

    def localize(self, report: OffloadReport | None) -> OffloadReport | None:
        """Failed slots back in each rank's own numbering (every rank sees every entry; op ids tell whose)."""
        if report is None:
            return None

        def local(entries):
            out = []
            for op_id, proc, bad in entries:
                base = self._slot_base.pop(op_id, 0)
                out.append((op_id, proc, [s - base for s in bad]))
            return out

        report.stores, report.loads = local(report.stores), local(report.loads)
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
