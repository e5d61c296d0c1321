"""Moves whole chunks between the paged KV caches and the host tier.

Owns the preallocated buffers: an HBM staging buffer (``staging_blocks``
blocks, all layers) and the host tier (``num_slots`` chunk slots in a few
host-memory-kind slabs, sharded like the caches). Every call dispatches
asynchronously and returns a tiny "done" array to poll; nothing here blocks.

A batch larger than the staging buffer is split into staging-sized passes
through the same buffer (donation orders them), never truncated.

Two host paths behind the same calls (``path``):

* ``program`` (the default): the tier is preallocated slabs, and
  ``store``/``load`` are compiled programs that write and read them in
  place: a loop of one asynchronous copy per chunk, or where asked on TPU
  (``host_copy="dma"``: one attention-DP rank, pieces with a 4 KiB-tile
  view) one Pallas kernel per group that DMAs staging chunks to or from their
  slab rows (host_dma.py; the slabs then u8 tiles, the direct path's type). With
  the DMA gather/scatter every program a pass runs moves that pass's blocks
  and no more (TPU compiler: tests/tpu_compiler), and host memory is
  allocated once.
* ``direct`` (the TPU default where ``direct_dma.supported``; see connector/registration.py): the
  tier is u8 slabs of 4 KiB tiles, and ``store``/``load`` are one Pallas kernel per (group, slab) that
  DMAs straight between the paged caches and the slab rows (direct_dma.py): no staging, no TensorCore
  copy, 2x what the pass moves. Staging stays allocated for HBM-to-HBM copies (``copy``).
* ``device_put`` (opt-in): each stored chunk is sliced out of staging and
  sent with ``jax.device_put`` to its own host-memory-kind array (one per
  slot). Its cost: ``take_chunks`` outputs every staging chunk and
  ``put_chunks`` rewrites them all on every pass, so a 16-block pass costs
  what a full staging buffer does (8,000 MiB accessed per device each at
  Qwen3-32B TP 8 on TPU7x), and every store allocates host arrays (one
  mapping per chunk and device, against ``vm.max_map_count``).

``valid[slot]`` is this process's truth about a slot: cleared when a store
into it is dispatched, set when that store completed. Loading an invalid
slot (or one whose checksum no longer matches) is refused per chunk so the
caller can report those blocks as load errors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import jax
import numpy as np

from tpu_offload.jax_backend import direct_dma, hostview, memory
from tpu_offload.jax_backend.layout import KVLayout
from tpu_offload.jax_backend.pacing import Paced, Pacer, _Piece  # noqa: F401 (re-exported)
from tpu_offload.jax_backend.programs import Programs, ints

log = logging.getLogger(__name__)

# A single pinned allocation of hundreds of GiB fails on some hosts; the tier
# is split into slabs of at most this many bytes per process.
DEFAULT_MAX_SLAB_BYTES = 16 << 30


@dataclasses.dataclass(frozen=True)
class LoadChunk:
    slot: int
    blocks: Sequence[int]  # bpc destination block ids; -1 = already computed, skip
    # With several KV-cache groups: bpc ids per group (each group has its own block table); -1 = skip
    # (a sliding-window group's blocks outside the window). None: ``blocks`` for every group.
    by_group: Sequence[Sequence[int]] | None = None

    def ids(self, kv_group: int) -> Sequence[int]:
        return self.blocks if self.by_group is None else self.by_group[kv_group]


@dataclasses.dataclass(frozen=True)
class StoreChunk:
    slot: int
    blocks: Sequence[int]  # bpc source block ids
    by_group: Sequence[Sequence[int]] | None = None  # as LoadChunk's: -1 = this group's block is not stored

    def ids(self, kv_group: int) -> Sequence[int]:
        return self.blocks if self.by_group is None else self.by_group[kv_group]


@dataclasses.dataclass(frozen=True)
class CopyChunk:
    """A chunk copied between HBM blocks (an interleaved lookup's hit in HBM's prefix cache)."""

    src: Sequence[int]  # bpc source block ids
    dst: Sequence[int]  # bpc destination block ids; -1 = already computed, skip

    def source(self) -> StoreChunk:
        return StoreChunk(-1, [s if d >= 0 else -1 for s, d in zip(self.src, self.dst)])

    def target(self) -> LoadChunk:
        return LoadChunk(-1, list(self.dst))


PATHS = ("program", "device_put", "direct")


class Done(tuple):
    """The "done" arrays of one pass's programs (one store per slab touched): ready when all are."""

    def is_ready(self) -> bool:
        return all(x.is_ready() for x in self)

    def block_until_ready(self):
        for x in self:
            x.block_until_ready()
        return self


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """The buffer sizes and compiled-program factory of one deployment, before anything is allocated
    (so the TPU compiler's verdict can be read for a topology this host does not have)."""

    staging_blocks: int
    rows_per_slab: int
    programs: Programs


def plan_transfers(layout: KVLayout, *, num_slots: int, blocks_per_chunk: int, staging_blocks: int,
                   memory_kind: str = "pinned_host", max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES,
                   kernel: str | None = None, rows_per_slab: int | None = None,
                   host_copy: str | None = None) -> TransferPlan:
    """``rows_per_slab``: the slab size the hosts agreed on (jax_backend/agree.py); default: from
    ``max_slab_bytes`` and this process's share of a chunk."""
    if staging_blocks < blocks_per_chunk:
        raise ValueError(
            f"staging_blocks={staging_blocks} cannot hold one chunk of {blocks_per_chunk} blocks; "
            f"raise staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) to at least {blocks_per_chunk}"
        )
    # Whole chunks only: a staging buffer of 10 blocks with 4-block chunks uses 8. Under DP attention each
    # rank stages and stores its own chunks (ranks.py): staging and every slab split into equal shares.
    d = layout.ranks
    if staging_blocks < blocks_per_chunk * d:
        raise ValueError(f"staging_blocks={staging_blocks} cannot give each of the {d} attention-DP ranks one "
                         f"chunk of {blocks_per_chunk} blocks; raise staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) "
                         f"to at least {blocks_per_chunk * d}")
    if num_slots % d:
        raise ValueError(f"{num_slots} host slots do not divide over the {d} attention-DP ranks' partitions")
    staging_blocks = staging_blocks // (blocks_per_chunk * d) * (blocks_per_chunk * d)
    local_chunk_bytes = max(1, layout.block_bytes * blocks_per_chunk * _local_fraction(layout) / d)
    if rows_per_slab is None:
        rows_per_slab = int(max_slab_bytes // local_chunk_bytes)
    rows_per_slab = max(d, min(num_slots, rows_per_slab) // d * d)
    n_full, rest = divmod(num_slots // d, rows_per_slab // d)  # each rank's partition, in slabs of equal shares
    rows = (rows_per_slab,) * n_full + ((rest * d,) if rest else ())
    programs = Programs(layout, staging_blocks=staging_blocks, blocks_per_chunk=blocks_per_chunk,
                        slab_rows=rows, memory_kind=memory_kind, kernel=kernel, host_copy=host_copy)
    return TransferPlan(staging_blocks=staging_blocks, rows_per_slab=rows_per_slab, programs=programs)


def preflight(layout: KVLayout, plan: TransferPlan, path: str, num_slots: int,
              hbm_check: Callable[[int, int], None] | None = None) -> None:
    """The checks to pass before ``plan`` is allocated: the ``device_put`` path's host buffers (one per chunk
    and device) within the kernel's limits, and ``hbm_check(staging and in-flight bytes, programs' scratch)``
    per device. Raises ``ConfigError``."""
    if path == "device_put":
        local = round(_local_fraction(layout) * layout.mesh.devices.size)
        memory.check_host_buffers(num_slots, local, len(layout.groups))
    if hbm_check is not None:
        staging = plan.staging_blocks * layout.device_block_bytes()
        hbm_check(staging * (2 if path == "device_put" else 1), plan.programs.scratch_bytes(path))


class TransferEngine:
    def __init__(
        self,
        layout: KVLayout,
        *,
        num_slots: int,
        blocks_per_chunk: int,
        staging_blocks: int,
        memory_kind: str = "pinned_host",
        checksums: bool = False,
        max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES,
        hbm_check: Callable[[int, int], None] | None = None,
        path: str = "program",
        kernel: str | None = None,
        plan: TransferPlan | None = None,
    ):
        """``hbm_check(staging_bytes, scratch_bytes)``, per device, runs before anything is allocated.
        ``kernel``: how gather/scatter move blocks (programs.KERNELS; default by platform).
        ``plan``: sizes the caller planned and already checked with ``preflight`` (the hosts' agreed
        plan, connector/registration.py); nothing is checked again."""
        checked = plan is not None
        plan = plan or plan_transfers(layout, num_slots=num_slots, blocks_per_chunk=blocks_per_chunk,
                                      staging_blocks=staging_blocks, memory_kind=memory_kind,
                                      max_slab_bytes=max_slab_bytes, kernel=kernel)
        self.layout = layout
        self.bpc = blocks_per_chunk
        self.num_slots = num_slots
        self.staging_blocks = plan.staging_blocks
        self.staging_chunks = self.staging_blocks // blocks_per_chunk
        self.memory_kind = memory_kind
        self.chunk_bytes = layout.block_bytes * blocks_per_chunk
        self.rows_per_slab = plan.rows_per_slab
        self.programs = plan.programs
        if path not in PATHS:
            raise ValueError(f"transfer path {path!r}: expected one of {', '.join(PATHS)}")
        if path == "device_put":
            self.programs._no_dp(path)
        self.direct = None  # direct path: its kernels' programs (direct_dma.py)
        if path == "direct":
            why = direct_dma.supported(layout)
            if why is not None:
                raise ValueError(f"the direct host path cannot serve this KV cache: {why}")
            self.direct = direct_dma.DirectPrograms(layout, blocks_per_chunk=blocks_per_chunk,
                                                    slab_rows=self.programs.slab_rows, memory_kind=memory_kind,
                                                    capacity=self.staging_blocks)
        self.path = path
        if not checked:
            preflight(layout, plan, path, num_slots, hbm_check)
        self.staging = self.programs.alloc_staging()
        self.slabs = self.alloc_slabs()
        self.host: list[tuple | None] = [None] * num_slots if path == "device_put" else []
        self.valid = np.zeros(num_slots, dtype=bool)
        self._blanks: dict[int, jax.Array] = {}  # device_put path, several hosts: zeros for a lost chunk
        self.checksums = np.zeros(num_slots, dtype=np.uint64) if checksums else None
        # DMAs the gather/scatter kernels issued: the last call's and the total, per program
        self.dmas = {"gather": 0, "scatter": 0}
        self.last_dmas = {"gather": 0, "scatter": 0}
        self.pacer: Pacer | None = None  # set by ``pace``: host copies in pieces, across steps
        self._busy = np.zeros(self.staging_chunks, dtype=bool)  # paced: staging chunks a transfer still holds

    def alloc_slabs(self):
        """This path's host tier, zero-filled: the program path's slabs (u8 4 KiB tiles where its host copies
        are DMA kernels, host_dma.py; else the cache's dtype), the direct path's u8 slabs (the same type),
        none for device_put (a host array tuple per slot, made by each store)."""
        if self.path == "program":
            return self.programs.alloc_slabs()
        return self.direct.alloc_slabs() if self.path == "direct" else None

    # ---- pacing ------------------------------------------------------------
    def pace(self, pacer: "Pacer") -> None:
        """Send host copies through ``pacer`` (the program path, one attention-DP rank): a store gathers at
        once and queues its copies to host in pieces; a load queues its copies from host, then the scatter.
        Each holds its staging chunks until its last piece reading them is sent, so later passes use other
        chunks meanwhile."""
        if self.path != "program" or self.layout.ranks > 1:
            raise ValueError("pacing needs the program path and one attention-DP rank")
        self.pacer = pacer
        pacer.on_send.append(self._sent)
        self.staging_overdrawn = 0  # pieces sent past the step budget because staging was short

    def _sent(self, piece: "_Piece") -> None:
        self._busy[piece.free] = False

    def _claim(self, n: int) -> np.ndarray:
        """``n`` free staging chunks. Never refuses: when earlier transfers still hold too many (more was
        handed over than one step's budget sends: the scheduler's admission keeps that from happening),
        their queued pieces are sent now, past the budget, and counted in ``staging_overdrawn``."""
        free = np.flatnonzero(~self._busy)
        if len(free) < n:
            self.staging_overdrawn += self.pacer.send_all()
            free = np.flatnonzero(~self._busy)
        at = free[:n]
        self._busy[at] = True
        return at

    def _pieces(self, chunks) -> list[slice]:
        per = max(1, self.pacer.piece_bytes // max(1, self.layout.device_block_bytes() * self.bpc))
        return [slice(i, i + per) for i in range(0, len(chunks), per)]

    def _store_paced(self, caches: Callable[[], list], chunks: Sequence[StoreChunk]) -> Paced:
        owner = Paced(self.pacer)
        for part in _split(chunks, self.staging_chunks):  # more than staging: one part's pieces, then the next
            self._store_part(caches, part, owner)
        return owner

    def _store_part(self, caches: Callable[[], list], chunks: Sequence[StoreChunk], owner: Paced) -> None:
        at = self._claim(len(chunks))
        lists = self._block_lists(chunks, at)
        try:
            self.staging = self.programs.gather()(tuple(caches()), self.staging,
                                                  *self.programs.block_args(lists, "gather"))
        except Exception:
            self._busy[at] = False
            raise
        self._count_dmas(lists, "gather")
        moved = [self._chunks_moved(pos) for _, pos in lists]
        slots = [c.slot for c in chunks]
        for sl in self._pieces(chunks):
            run = lambda s=slots[sl], a=at[sl]: self._staging_to_host(s, a, moved)
            owner.left += 1
            self.pacer.queue.append(_Piece("store", self.device_moved_bytes(chunks[sl]), run, owner, at[sl]))

    def load_paced(self, chunks: Sequence[LoadChunk], caches: Callable[[], list],
                   hand_back: Callable[[list], None]) -> Paced:
        """Queue a load: its copies from host in pieces, then the scatter into ``caches()`` (the runner's
        caches when it is dispatched, after that step's forward), whose output goes to ``hand_back``."""
        owner = Paced(self.pacer)
        for part in _split(chunks, self.staging_chunks):
            self._load_part(part, caches, hand_back, owner)
        return owner

    def _load_part(self, chunks: Sequence[LoadChunk], caches: Callable[[], list],
                   hand_back: Callable[[list], None], owner: Paced) -> None:
        at = self._claim(len(chunks))
        lists = self._block_lists(chunks, at)
        moved = [self._chunks_moved(pos) for _, pos in lists]
        slots = [c.slot for c in chunks]
        for sl in self._pieces(chunks):
            run = lambda s=slots[sl], a=at[sl]: self._host_to_staging(s, a, moved)
            owner.left += 1
            self.pacer.queue.append(_Piece("load", self.device_moved_bytes(chunks[sl]), run, owner, at[:0]))

        def scatter():
            new, done = self.programs.scatter()(tuple(caches()), self.staging, *self.programs.block_args(lists, "scatter"))
            self._count_dmas(lists, "scatter")
            hand_back(list(new))
            return done

        owner.left += 1
        self.pacer.queue.append(_Piece("scatter", 0, scatter, owner, at))

    # ---- public ----------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        return self.staging_blocks * self.layout.block_bytes

    @property
    def staging_device_bytes(self) -> int:
        return self.staging_blocks * self.layout.device_block_bytes()

    @property
    def in_flight_device_bytes(self) -> int:
        """device_put path: the chunks sliced out of staging stay on HBM until their DMA has landed,
        up to one staging buffer's worth per pass; the HBM check counts them."""
        return self.staging_device_bytes if self.path == "device_put" else 0

    @property
    def slab_bytes(self) -> int:
        return self.num_slots * self.chunk_bytes

    def moved_bytes(self, chunks: Sequence[LoadChunk | StoreChunk]) -> int:
        """Distinct bytes (all devices) the blocks of ``chunks`` move: each group only its blocks that are not -1."""
        return sum(g.block_bytes * sum(1 for c in chunks for b in c.ids(g.kv_group) if b >= 0)
                   for g in self.layout.groups)

    def device_moved_bytes(self, chunks: Sequence[LoadChunk | StoreChunk]) -> int:
        """Bytes one device holds of what ``chunks`` move (as ``moved_bytes``, per device)."""
        return sum(g.device_block_bytes * sum(1 for c in chunks for b in c.ids(g.kv_group) if b >= 0)
                   for g in self.layout.groups)

    def precompile(self) -> None:
        if self.path == "direct":
            self.programs.gather(), self.programs.scatter()  # HBM-to-HBM copies still go through staging
            self.direct.all_programs()
            return
        self.programs.precompile(self.path)

    def release(self) -> None:
        """Free the host tier and staging now (a fallback to another path allocates its own)."""
        for a in jax.tree.leaves((self.slabs, self.staging)):
            a.delete()
        self.slabs, self.staging = None, None

    def check_loadable(self, slot: int) -> bool:
        """True if this process holds good bytes for ``slot`` (valid, checksum matches)."""
        if not self.valid[slot]:
            return False
        if self.checksums is not None and self._checksum(slot) != self.checksums[slot]:
            log.error("host chunk slot %d failed its checksum; it will be recomputed", slot)
            self.valid[slot] = False
            return False
        return True

    def load(self, kv_caches: list, chunks: Sequence[LoadChunk],
             on_pass: Callable[[list], None] | None = None,
             current: Callable[[], list] | None = None) -> tuple[list, jax.Array | None]:
        """Host slots -> paged blocks. Returns the new caches (the old ones are donated).

        ``on_pass(caches)`` gets the new caches after every pass: a pass donates
        the caches it was given, so if a later pass raises, the caller must
        already hold the earlier pass's output, not the donated arrays.

        Paced (``pace``): queued; returns ``kv_caches`` unchanged and a ``Paced``. The scatter, when
        the pacer sends it, reads ``current()`` (the caller's caches then) and hands its output to
        ``on_pass``.
        """
        if self.pacer is not None:
            if current is None or on_pass is None:
                raise ValueError("a paced load needs current and on_pass: its scatter runs in a later pump")
            paced = self.load_paced(chunks, current, on_pass)  # its claim may send a queued scatter:
            return current(), paced  # the caches are then that scatter's output
        if self.path == "direct":
            return self._direct_load(kv_caches, chunks, on_pass)
        return self._in_passes(kv_caches, chunks, self._load_pass, on_pass)

    def copy(self, kv_caches: list, chunks: Sequence[CopyChunk],
             on_pass: Callable[[list], None] | None = None,
             current: Callable[[], list] | None = None) -> tuple[list, jax.Array | None]:
        """Paged blocks -> other paged blocks, on the device: the store's gather into staging, then the load's
        scatter out of it (the same compiled programs, no host copy, no new program). Returns the new
        caches, as ``load``. One layout group per vLLM KV-cache group is assumed (every layer moves the same
        ids): the scheduler offers HBM copies only then (connector/interleave.py).

        Paced: queued as one piece with no link bytes, sent after the forward like a load's scatter."""
        if self.pacer is not None:
            if current is None or on_pass is None:
                raise ValueError("a paced copy needs current and on_pass: it runs in a later pump")
            paced = self._copy_paced(chunks, current, on_pass)
            return current(), paced
        return self._in_passes(kv_caches, chunks, self._copy_pass, on_pass)

    def _in_passes(self, kv_caches, chunks, run_pass, on_pass):
        """Unpaced load or copy: one ``run_pass`` per staging-sized part, the caller given each pass's caches."""
        done = None
        for part, at in self._passes(chunks):
            kv_caches, done = run_pass(kv_caches, part, at)
            if on_pass is not None:
                on_pass(kv_caches)
        return kv_caches, done

    def _copy_pass(self, kv_caches, part: Sequence[CopyChunk], at):
        src = self._block_lists([c.source() for c in part], at)
        dst = self._block_lists([c.target() for c in part], at)
        self.staging = self.programs.gather()(tuple(kv_caches), self.staging, *self.programs.block_args(src, "gather"))
        self._count_dmas(src, "gather")
        caches, done = self.programs.scatter()(tuple(kv_caches), self.staging,
                                               *self.programs.block_args(dst, "scatter"))
        self._count_dmas(dst, "scatter")
        return list(caches), done

    def _copy_paced(self, chunks: Sequence[CopyChunk], caches: Callable[[], list],
                    hand_back: Callable[[list], None]) -> Paced:
        at = self._claim(len(chunks))  # the scheduler sends at most a step's budget: within staging
        owner = Paced(self.pacer)

        def run():
            new, done = self._copy_pass(caches(), chunks, at)
            hand_back(new)
            return done

        owner.left += 1
        self.pacer.queue.append(_Piece("scatter", 0, run, owner, at))
        return owner

    def store(self, kv_caches: list, chunks: Sequence[StoreChunk],
              current: Callable[[], list] | None = None) -> jax.Array | None:
        """Paged blocks -> host slots. The caches are only read, so they are not returned.

        Paced: ``current()`` (default: ``kv_caches``) is read after staging is claimed, since a claim that
        finds staging short sends queued pieces, and a load's scatter among them replaces the caches."""
        if self.pacer is not None:
            done = self._store_paced(current or (lambda: kv_caches), chunks)  # a failed gather marks nothing
            for c in chunks:
                self.valid[c.slot] = False
            return done
        for c in chunks:
            self.valid[c.slot] = False
        if self.path == "direct":
            return self._direct_store(kv_caches, chunks)
        done = None
        for part, at in self._passes(chunks):
            done = self._store_pass(kv_caches, part, at)
        return done

    def complete_store(self, slots: Sequence[int], ok: bool) -> None:
        """Called once the store's done array is ready (or failed)."""
        slots = np.asarray(slots, dtype=np.int64)
        self.valid[slots] = ok
        if ok and self.checksums is not None:
            for s in slots:
                self.checksums[s] = self._checksum(int(s))

    def row_views(self, slot: int, group: int | None = None) -> list[np.ndarray]:
        """This process's bytes of ``slot`` in every group's slab, or in ``group``'s (writable views)."""
        groups = range(len(self.layout.groups)) if group is None else (group,)
        if self.path == "device_put":
            held = self.host[slot] or (None,) * len(self.layout.groups)
            if any(a is None for a in held):  # a file read into a slot no store has (fully) made yet
                self.host[slot] = tuple(_zeros(av) if a is None else a
                                        for a, av in zip(held, self.programs.host_chunk_avals()))
            return [v for g in groups for v in hostview.array_views(self.host[slot][g])]
        (k,), (row,) = self._rows([slot])
        return [v for g in groups for v in hostview.row_views(self.slabs[g][k], row)]

    # ---- the direct path ---------------------------------------------------
    def _direct_calls(self, chunks):
        """Per call of the direct kernel: (group, slab, cache blocks, slab rows, chunk columns), the moves of
        ``chunks`` grouped by slab and cut into calls of at most ``capacity`` blocks (-1 ids skipped)."""
        slab, row = self._rows([c.slot for c in chunks])
        cap = self.direct.capacity
        for gi, g in enumerate(self.layout.groups):
            ids = np.array([list(c.ids(g.kv_group)) for c in chunks], dtype=np.int64).reshape(len(chunks), self.bpc)
            cols = np.broadcast_to(np.arange(self.bpc), ids.shape)
            rows = np.broadcast_to(row[:, None], ids.shape)
            slabs = np.broadcast_to(slab[:, None], ids.shape)
            keep = ids >= 0
            for k in np.unique(slabs[keep]):
                m = keep & (slabs == k)
                b, r, c = ids[m], rows[m], cols[m]
                for i in range(0, len(b), cap):
                    yield gi, int(k), b[i:i + cap], r[i:i + cap], c[i:i + cap]

    def _count_direct(self, name: str, calls) -> None:
        n = sum(self.direct.dma_count(gi, b, r, c) for gi, _, b, r, c in calls)
        self.last_dmas[name] = n
        self.dmas[name] = self.dmas.get(name, 0) + n

    def _direct_store(self, kv_caches, chunks: Sequence[StoreChunk]) -> Done:
        """One kernel call per (group, slab): the cache blocks straight into their slab rows."""
        calls = list(self._direct_calls(chunks))
        dones = []
        for gi, k, b, r, c in calls:
            g = self.layout.groups[gi]
            new = self.direct.store(gi, self.programs.slab_rows[k])(
                tuple(kv_caches[a] for a in g.layers), self.slabs[gi][k], *self.direct.operands(b, r, c))
            self.slabs = tuple(per[:k] + (new,) + per[k + 1:] if i == gi else per for i, per in enumerate(self.slabs))
            dones.append(new)
        self._count_direct("store", calls)
        return Done(dones)

    def _direct_load(self, kv_caches, chunks: Sequence[LoadChunk], on_pass):
        """One kernel call per (group, slab): the slab rows straight into the cache blocks (donated)."""
        calls = list(self._direct_calls(chunks))
        caches, done = list(kv_caches), None
        for gi, k, b, r, c in calls:
            g = self.layout.groups[gi]
            new = self.direct.load(gi, self.programs.slab_rows[k])(
                tuple(caches[a] for a in g.layers), self.slabs[gi][k], *self.direct.operands(b, r, c))
            for a, arr in zip(g.layers, new):
                caches[a] = arr
            done = Done(new[:1])
            if on_pass is not None:
                on_pass(caches)
        self._count_direct("load", calls)
        return caches, done

    def check_direct(self, kv_caches: list, seed: int = 0) -> tuple[list, str | None]:
        """The direct path's start-up round trip, on the runner's own buffers before it serves: random bytes
        written into a few scattered slab rows (in place, host memory), loaded into scattered cache blocks,
        stored from there into other rows, compared bit for bit. That proves the u8 view moves every byte,
        wherever a chunk lands (a block stored from one place is loaded into another). Returns the new caches
        (the load donates them; the blocks used held nothing yet) and None, or what differed."""
        half = self.num_slots // 2
        usable = (self.layout.num_blocks - 1) // self.bpc  # block 0 left alone (the engine's null block)
        n = min(3, half, usable)
        if n < 1:
            return kv_caches, None
        slots_a = np.unique(np.linspace(0, half - 1, n).astype(np.int64))  # the first half; b: the second
        bases = np.unique(np.linspace(usable - 1, 0, n).astype(np.int64))[::-1]  # scattered, last first
        n = min(len(slots_a), len(bases))
        slots_a, bases = slots_a[:n], bases[:n]
        slots_b = slots_a + half
        blocks = [list(range(1 + int(b) * self.bpc, 1 + (int(b) + 1) * self.bpc)) for b in bases]
        rng = np.random.default_rng(seed)
        want = []
        for s in slots_a:
            views = self.row_views(int(s))
            for v in views:
                v[:] = rng.integers(0, 256, size=v.size, dtype=np.uint8)
            want.append([v.copy() for v in views])
        caches, done = self.load(kv_caches, [LoadChunk(int(s), b) for s, b in zip(slots_a, blocks)])
        if done is not None:
            done.block_until_ready()
        self.store(caches, [StoreChunk(int(s), b) for s, b in zip(slots_b, blocks)]).block_until_ready()
        bad = [int(b) for a, b, w in zip(slots_a, slots_b, want)
               if not all(np.array_equal(x, y) for x, y in zip(w, self.row_views(int(b))))]
        for s in np.concatenate([slots_a, slots_b]):
            for v in self.row_views(int(s)):
                v[:] = 0
        self.valid[slots_a] = self.valid[slots_b] = False
        if bad:
            return caches, (f"the direct kernel's round trip through {len(slots_a)} scattered blocks came back "
                            f"different in slot(s) {bad}")
        return caches, None

    # ---- passes ------------------------------------------------------------
    def _rows(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(slab, row) of each slot. Under DP attention rank r's partition of the slots (connector/dp.py)
        fills its share of every slab's rows, which lives in its devices' host memory (ranks.py)."""
        slots = np.asarray(slots, dtype=np.int64)
        d = self.layout.ranks
        if d == 1:
            return np.divmod(slots, self.rows_per_slab)
        rank, i = np.divmod(slots, self.num_slots // d)
        slab, j = np.divmod(i, self.rows_per_slab // d)
        share = np.asarray(self.programs.slab_rows, dtype=np.int64)[slab] // d
        return slab, rank * share + j

    def _by_slab(self, slots: Sequence[int]):
        """Chunk positions grouped by slab: [(slab, positions in ``slots``, rows in the slab)]."""
        slab, row = self._rows(slots)
        return [(int(k), np.flatnonzero(slab == k), row[slab == k]) for k in np.unique(slab)]

    def _set_slab(self, k: int, new) -> None:
        self.slabs = tuple(per_group[:k] + (s,) + per_group[k + 1:] for per_group, s in zip(self.slabs, new))

    def _passes(self, chunks):
        """The passes through staging: (chunks, the staging chunk of each). In order, a staging buffer
        at a time; under DP attention, each rank's chunks in its own share of
        staging (a chunk's rank: its first block's), as many passes as the busiest rank needs; a load
        from another rank's partition of the slots takes at most ``cross_chunks`` per pair of ranks
        and pass (ranks.py)."""
        ranks = self.layout.ranks
        if ranks == 1:
            for part in _split(chunks, self.staging_chunks):
                yield part, np.arange(len(part))
            return
        share, per_rank = self.staging_chunks // ranks, self.layout.num_blocks // ranks
        cap, per_part = self.programs.cross_chunks, self.num_slots // ranks
        queues: list[list] = [[] for _ in range(ranks)]
        for c in chunks:
            ids = [b for g in self.layout.groups for b in c.ids(g.kv_group) if b >= 0]
            queues[(ids[0] // per_rank) if ids else 0].append(c)
        while any(queues):
            part = []
            for r, q in enumerate(queues):  # a load from another rank's partition: at most ``cap`` per pair
                taken, later, sent = [], [], {}
                for c in q:
                    src = c.slot // per_part if isinstance(c, LoadChunk) else r
                    if len(taken) == share or (src != r and sent.get(src, 0) == cap):
                        later.append(c)
                        continue
                    sent[src] = sent.get(src, 0) + 1
                    taken.append(c)
                queues[r] = later
                part += [(c, r * share + i) for i, c in enumerate(taken)]
            yield [c for c, _ in part], np.array([a for _, a in part], dtype=np.int64)

    def _block_lists(self, part, at):
        """Per group: (block ids, staging positions) of the blocks it moves (-1 ids are skipped;
        chunk i of the pass is staging chunk at[i])."""
        out = []
        for g in self.layout.groups:
            ids = np.concatenate([np.asarray(x.ids(g.kv_group), dtype=np.int64) for x in part])
            keep = np.flatnonzero(ids >= 0)
            pos = (np.repeat(np.asarray(at, dtype=np.int64) * self.bpc, self.bpc)
                   + np.tile(np.arange(self.bpc), len(part)))
            out.append((ids[keep], pos[keep]))
        return out

    def _count_dmas(self, lists, name: str) -> None:
        n = self.programs.dma_count(lists, name)
        self.last_dmas[name] = n
        self.dmas[name] += n

    def _load_pass(self, kv_caches, part: Sequence[LoadChunk], at):
        lists = self._block_lists(part, at)
        self._host_to_staging([x.slot for x in part], at, [self._chunks_moved(pos) for _, pos in lists])
        caches, done = self.programs.scatter()(tuple(kv_caches), self.staging,
                                               *self.programs.block_args(lists, "scatter"))
        self._count_dmas(lists, "scatter")
        return list(caches), done

    def _store_pass(self, kv_caches, part: Sequence[StoreChunk], at):
        lists = self._block_lists(part, at)
        self.staging = self.programs.gather()(tuple(kv_caches), self.staging,
                                              *self.programs.block_args(lists, "gather"))
        self._count_dmas(lists, "gather")
        return self._staging_to_host([x.slot for x in part], at, [self._chunks_moved(pos) for _, pos in lists])

    def _chunks_moved(self, positions) -> np.ndarray:
        """Which staging chunks a group moves at all."""
        return np.unique(np.asarray(positions, dtype=np.int64) // self.bpc)

    def _host_to_staging(self, slots: Sequence[int], at, moved: Sequence[np.ndarray]) -> None:
        """Slot ``slots[i]`` into staging chunk ``at[i]``, by this engine's host path; group g only
        for the staging chunks in ``moved[g]``."""
        if self.path == "device_put":
            self._device_put_load(slots, at, moved)
            return None
        dones = []
        for k, pos, rows in self._by_slab(slots):
            pos = np.asarray(at)[pos]
            sel = [np.isin(pos, chunks) for chunks in moved]
            args, cross = self.programs.load_args(k, [rows[m] for m in sel], [pos[m] for m in sel])
            self.staging, done = self.programs.load(self.programs.slab_rows[k], cross)(
                self.staging, tuple(g[k] for g in self.slabs), *args)
            dones.append(done)
        return Done(dones)

    def _device_put_load(self, slots: Sequence[int], at, moved: Sequence[np.ndarray]) -> None:
        """device_put path: every chunk the pass needs, checked first (nothing donated before a refusal),
        then one batched host-to-device transfer and one program per group that moves any."""
        slots = dict(zip(np.asarray(at).tolist(), slots))  # by staging chunk
        want = [(int(i), gi) for gi, chunks in enumerate(moved) for i in chunks]
        sources = []
        for i, gi in want:
            host = self.host[slots[i]]
            if host is None or host[gi] is None:
                if not (jax.process_count() > 1 and not self.valid[slots[i]]):
                    raise RuntimeError(f"host slot {slots[i]} holds nothing for layer group {gi}")
                # Several hosts: one that lost a chunk its peers hold still launches what they launch
                # (its caller reports the chunk's blocks as errors); zeros stand in for its bytes.
                sources.append(self._blank(gi))
            else:
                sources.append(host[gi])
        got = transfer(sources, [self.programs.chunk_sh[gi] for _, gi in want])  # H2D, queued by the runtime
        staging, k = list(self.staging), self.staging_chunks
        for gi in range(len(moved)):
            mine = [(i, a) for (i, g), a in zip(want, got) if g == gi]
            if not mine:
                continue
            mine += [mine[0]] * (k - len(mine))  # a shorter pass rewrites its first chunk
            staging[gi] = self.programs.put_chunks(gi)(staging[gi], tuple(a for _, a in mine),
                                                       ints([i for i, _ in mine], k, 0))
            self.staging = tuple(staging)  # each group's new staging as soon as it exists (the old is donated)

    def _staging_to_host(self, slots: Sequence[int], at, moved: Sequence[np.ndarray]) -> Done:
        """Staging chunk ``at[i]`` into slot ``slots[i]``, by this engine's host path; group g only for
        the staging chunks in ``moved[g]`` (a slot's other groups keep bytes no load will ask for)."""
        dones = []
        at = np.asarray(at)
        if self.path == "device_put":  # one program and one batched transfer per pass
            chunks = self.programs.take_chunks()(self.staging)
            want = [(i, gi) for i in range(len(slots)) for gi, m in enumerate(moved) if at[i] in m]
            sent = transfer([chunks[gi][at[i]] for i, gi in want],  # D2H, outside any program
                            [self.programs.host_chunk_sh[gi] for _, gi in want])
            host = [[None] * len(moved) for _ in slots]
            for (i, gi), a in zip(want, sent):
                host[i][gi] = a
            for i, slot in enumerate(slots):
                self.host[slot] = tuple(host[i])
            dones.extend(sent)
            return Done(dones)
        for k, pos, rows in self._by_slab(slots):
            pos = at[pos]
            sel = [np.isin(pos, chunks) for chunks in moved]
            new, done = self.programs.store(self.programs.slab_rows[k])(
                tuple(g[k] for g in self.slabs), self.staging,
                *self.programs.store_args(k, [rows[m] for m in sel], [pos[m] for m in sel]))
            self._set_slab(k, new)
            dones.append(done)
        return Done(dones)

    def _blank(self, group: int):
        """A host chunk of zeros for ``group``, made once (stands in for a chunk this host lost)."""
        if group not in self._blanks:
            self._blanks[group] = _zeros(self.programs.host_chunk_avals()[group])
        return self._blanks[group]

    def _checksum(self, slot: int) -> int:
        if self.path == "device_put":
            return hostview.views_checksum(self.row_views(slot))
        (k,), (row,) = self._rows([slot])
        return hostview.row_checksum([per_group[k] for per_group in self.slabs], int(row))


def transfer(arrays: Sequence[jax.Array], shardings: Sequence) -> list[jax.Array]:
    """One batched runtime transfer of each array to its sharding (the same devices and layout, another
    memory kind): no program is compiled or launched.

    With several JAX processes, ``jax.device_put`` of an array that is not fully addressable is a jitted
    reshard, a program: it compiles on first use, serializes with the forward, and every host must launch it
    alike. So each process sends only its own shards (single-device transfers) and assembles the global
    arrays from them, as one process does for all of them."""
    if all(a.is_fully_addressable for a in arrays):
        return jax.device_put(list(arrays), list(shardings))
    shards = [list(a.addressable_shards) for a in arrays]
    moved = jax.device_put([s.data for per in shards for s in per],
                           [jax.sharding.SingleDeviceSharding(s.device, memory_kind=sh.memory_kind)
                            for per, sh in zip(shards, shardings) for s in per])
    out, k = [], 0
    for a, sh, per in zip(arrays, shardings, shards):
        out.append(jax.make_array_from_single_device_arrays(a.shape, sh, moved[k:k + len(per)]))
        k += len(per)
    return out


def _zeros(aval) -> jax.Array:
    """Zeros of ``aval`` (its sharding), made shard by shard on this process's devices: no program."""
    return jax.make_array_from_callback(aval.shape, aval.sharding,
                                        lambda idx: np.broadcast_to(np.zeros((), aval.dtype), aval.shape)[idx])


def _split(items: Sequence, n: int):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _local_fraction(layout: KVLayout) -> float:
    """Share of every buffer that lives in this process (its addressable devices; on a compile-only
    topology, host 0's)."""
    total = layout.mesh.devices.size
    me = jax.process_index() if jax.process_count() > 1 else min(d.process_index for d in layout.mesh.devices.flat)
    local = sum(1 for d in layout.mesh.devices.flat if d.process_index == me)
    return local / total if total else 1.0
