"""Transfer engine: engine KV blocks <-> slots of a host ``HostChunkPool``.

One instance per worker rank; ``gpu_offload.vllm.worker`` makes it vLLM's
``OffloadingWorker`` (this module imports no vLLM, so a benchmark on a bare
CUDA box needs only torch). On CUDA, transfers are asynchronous on
per-direction streams (``cuda_lane``); on CPU tensors (vLLM's CPU platform)
they are plain synchronous copies, so the whole path runs in CI.

Failure contract. A failed transfer must become a recompute, never wrong KV
and never a crash. Every job is reported finished (``JobResult.ok`` says
whether it moved its bytes); a failed load keeps the engine block ids it
could not fill, and ``take_load_errors`` hands them and the job ids to the
adapter in the same step the job is reported. A failed store leaves its
slots marked invalid in ``pool.valid``, so any later load from them is a
load error too.

With a file tier attached (``attach_files``), ``fs_link`` does the file I/O: a load whose spec promotes chunks waits (off the engine
thread) for their file reads, then runs as a normal load; loads touching
those slots wait behind it, in order.

Device sources. A load spec may say, per chunk, the engine blocks it is
copied from (``device_blocks``: the engine's own prefix cache holds it);
those pages move engine block to engine block on the same lane, inside the
job. Such a job is run from ``get_finished``, after the step's forward: its
source may be a block that very forward writes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import torch

from gpu_offload._log import get_logger
from gpu_offload.torch_backend import fused_gather
from gpu_offload.torch_backend.copy_ops import DevicePageCopier, DirectCopier, StagedCopier
from gpu_offload.torch_backend.fs_link import FileLink, Promotion
from gpu_offload.torch_backend.layout import HostLayout, PagedRows
from gpu_offload.torch_backend.plan import TransferPlan, TransferPlanner
from tpu_offload.core.pool import PAGE, HostChunkPool

logger = get_logger(__name__)


def _device_positions(src_spec) -> np.ndarray | None:
    """Per spec position, whether its chunk is copied from the device's own cache (None: no such chunk)."""
    blocks = getattr(src_spec, "device_blocks", None)
    if not blocks:
        return None
    mask = np.fromiter((b is not None for b in blocks), dtype=bool, count=len(blocks))
    return mask if mask.any() else None


class InjectedFailure(RuntimeError):
    """Raised inside a transfer by the test hooks in ``gpu_offload.testing``."""


@dataclasses.dataclass
class JobResult:
    """One finished job. ``ok``: its bytes moved (a load may still have left
    some blocks unfilled: they are in ``take_load_errors``)."""

    job_id: int
    ok: bool
    nbytes: int | None = None
    seconds: float | None = None


@dataclasses.dataclass
class _Job:
    job_id: int
    is_store: bool
    engine_blocks: np.ndarray  # every engine block of the job (load: reported if it fails)
    slots: np.ndarray | None = None  # store: slots to mark valid on success
    keys: list | None = None  # store: chunk key per slot (file tier)
    failed: list[int] = dataclasses.field(default_factory=list)  # load: blocks left unfilled
    failed_keys: list | None = None  # load: chunk keys of the slots that were not valid (None: all/unknown)
    hits: dict | None = None  # load: {tier: (chunks, tokens)} it moves, counted once it lands
    nbytes: int = 0  # between the device and host RAM (what vLLM's transfer metrics count)
    device_nbytes: int = 0  # load: copied device block to device block
    seconds: float | None = None
    error: BaseException | None = None
    events: Any = None


@dataclasses.dataclass
class EngineStats:
    """Monotonic counters of one engine (read by tests, the demo and benchmarks)."""

    store_jobs: int = 0
    load_jobs: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    stored_pages: int = 0
    loaded_pages: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    store_failures: int = 0  # jobs whose slots stayed invalid
    load_error_jobs: int = 0
    load_error_blocks: int = 0
    loaded_tokens: int = 0  # tokens whose KV loads landed (partial chunks count their part)
    device_copied_bytes: int = 0  # loaded from the device's own prefix cache, block to block


@dataclasses.dataclass
class _DeferredLoad:
    """A load waiting for file reads (its own, or an earlier job's on its slots)."""

    job_id: int
    src_spec: Any
    dst_spec: Any
    expedited: bool
    promotion: Promotion | None
    filed_slots: frozenset = frozenset()  # slots of this job filled from files (hit tier "fs")


class _SyncLane:
    """CPU: a transfer completes inside submit."""

    def __init__(self, copier, device_copier: DevicePageCopier):
        self.copier = copier
        self.device_copier = device_copier

    def submit(self, job: _Job, plan: TransferPlan, to_host: bool, device_pages=()) -> int:
        t0 = time.perf_counter()
        nbytes = self.copier.copy(plan, to_host) if plan.num_pages else 0
        if device_pages:
            job.device_nbytes = self.device_copier.copy(device_pages)
        job.seconds = time.perf_counter() - t0
        return nbytes


def _prefault(slab: np.ndarray) -> None:
    """Touch every page now: the budget is claimed at startup (fail fast) and
    the first stores do not pay page faults. ``cudaHostRegister`` does this
    itself when it pins the slab."""
    slab.reshape(-1)[::PAGE] = 0


def _as_pages(tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """The canonical tensor as int8 ``(num_blocks, page_bytes)`` without copying."""
    t = tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)
    if t.dim() != 2:
        t = t.view(t.shape[0], -1)
    if t.shape[1] != page_bytes:
        raise ValueError(f"canonical KV tensor rows are {t.shape[1]} B, page size is {page_bytes} B")
    return t


class HostTransferEngine:
    """Moves chunks between engine blocks and a preallocated host slab.

    ``strategy``: ``"direct"`` (same-device page copies; the CPU default),
    ``"staged"`` (device gather + whole-row DMA; the CUDA default, also
    runnable on CPU for tests) or ``"auto"``. ``tokens_per_block``: per KV
    group, for counting the tokens a load actually moved (``hits``).
    ``gather`` (staged only): ``"index"`` (a gather and a copy per KV tensor per
    piece), ``"fused"`` (one launch per piece for all tensors, ``fused_gather``:
    Triton on CUDA, falling back to ``"index"`` without it; memmove on CPU) or
    ``"auto"`` (fused on CUDA from ``fused_gather.FUSED_MIN_TENSORS`` tensors up).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        page_bytes: Sequence[int],
        group_tensors: Sequence[tuple[int, ...]],
        num_slots: int,
        blocks_per_chunk: int,
        *,
        staging_blocks: int = 128,
        strategy: str = "auto",
        pin: bool = True,
        zero_pool: bool = False,
        tokens_per_block: Sequence[int] | None = None,
        piece_rows: int | None = None,
        gather: str = "auto",
    ):
        if gather not in fused_gather.GATHERS:
            raise ValueError(f"gather {gather!r} is not one of {', '.join(fused_gather.GATHERS)}")
        self.layout = HostLayout.build(page_bytes, blocks_per_chunk)
        self.engine = [_as_pages(t, p) for t, p in zip(tensors, page_bytes)]
        self.gather = fused_gather.auto_gather(self.engine) if gather == "auto" else gather
        nblocks = {t.shape[0] for t in self.engine}
        if len(nblocks) != 1:
            raise ValueError(f"canonical KV tensors disagree on num_blocks: {sorted(nblocks)}")
        self.num_engine_blocks = nblocks.pop()
        self.device = self.engine[0].device
        self.is_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if strategy == "auto":
            strategy = "staged" if self.is_cuda else "direct"
        if strategy not in ("direct", "staged") or (strategy == "direct" and self.device.type != "cpu"):
            raise ValueError(f"strategy {strategy!r} is not available on device {self.device}")
        self.strategy = strategy
        self.tokens_per_block = tuple(tokens_per_block) if tokens_per_block else (0,) * len(group_tensors)
        if len(self.tokens_per_block) != len(group_tensors):
            raise ValueError(f"tokens_per_block has {len(self.tokens_per_block)} entries for "
                             f"{len(group_tensors)} KV groups")
        self.pool = HostChunkPool(num_slots, self.layout.chunk_bytes, zero=zero_pool)
        self.host_rows = torch.from_numpy(self.pool.slab).view(torch.int8)
        self.planner = TransferPlanner(blocks_per_chunk, group_tensors, self.num_engine_blocks, num_slots)
        self.stats = EngineStats()
        self.hits = {"cpu": [0, 0], "fs": [0, 0], "hbm": [0, 0]}  # tier -> [chunks, tokens] of loads that landed
        self.closed = False
        self._done: list[_Job] = []
        self._load_errors: set[int] = set()
        self._failed_load_jobs: set[int] = set()
        self._failed_load_keys: dict[int, list | None] = {}  # job id -> keys that failed (None: unknown)
        self._forced_load_failures = 0  # test hooks (gpu_offload.testing)
        self._forced_store_failures = 0
        self._registered: list = []
        self._piece_rows = piece_rows  # copies never cross a multiple of it (registration pieces)
        self.fs: FileLink | None = None
        self._deferred: list[_DeferredLoad] = []
        self._promoting_slots: set[int] = set()
        self._after_forward: list[tuple] = []  # loads with device sources, run from get_finished
        self._running_after_forward = False
        if self.is_cuda and pin:
            from gpu_offload.torch_backend import cuda_lane

            self._registered, pinned_rows = cuda_lane.register_host_rows(self.host_rows)
            if pinned_rows is not None:
                self._piece_rows = pinned_rows
        if not self._registered:
            _prefault(self.pool.slab)
        # Whether DMA reads the slab pinned: None off CUDA (nothing to pin), False if registration failed.
        self.pinned: bool | None = bool(self._registered) if self.is_cuda else None
        staging_slots = max(1, staging_blocks // blocks_per_chunk)
        self.device_bytes = 0  # device memory we allocate (outside vLLM's gpu_memory_utilization)
        self._store_lane, self._load_lane, self._make_expedited = self._lanes(staging_slots)
        self._expedited_lane = None
        logger.info(
            "host tier worker: %d slots x %d B (%.1f MiB), %d tensors, %d blocks/chunk, %s on %s%s",
            num_slots, self.layout.chunk_bytes, self.pool.nbytes / 2**20, self.layout.num_tensors,
            blocks_per_chunk, strategy, self.device, ", pinned" if self._registered else "",
        )
        if self.is_cuda:
            logger.info(
                "host tier worker: %.1f MiB of device memory for staging and index buffers (up to "
                "%.1f MiB once the expedited lane starts), outside gpu_memory_utilization: leave "
                "that headroom", self.device_bytes / 2**20, 1.5 * self.device_bytes / 2**20,
            )

    @property
    def gather_used(self) -> str:
        """What moves pages on the device: "direct" (no staging), "index" or "fused" (after any fallback)."""
        if self.strategy == "direct":
            return "direct"
        return "fused" if getattr(self._store_lane.copier, "mover", None) is not None else "index"

    @classmethod
    def from_canonical(cls, kv_caches, num_slots: int, blocks_per_chunk: int, **kw) -> "HostTransferEngine":
        """From vLLM's ``CanonicalKVCaches`` (duck-typed: no vLLM import)."""
        tensors = [ct.tensor for ct in kv_caches.tensors]
        pages = [ct.page_size_bytes for ct in kv_caches.tensors]
        groups = [tuple(sorted({r.tensor_idx for r in refs})) for refs in kv_caches.group_data_refs]
        return cls(tensors, pages, groups, num_slots, blocks_per_chunk, **kw)

    def owns(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are the engine KV tensors this engine was built on."""
        mine = [(t.device, t.data_ptr()) for t in self.engine]
        return len(tensors) == len(mine) and all(
            (t.device, t.data_ptr()) == m for t, m in zip(tensors, mine))

    def attach_files(self, tier, write_mode: str = "write_through", ring_slots: int | None = None,
                     write_back_lag_s: float | None = None, make_tier=None) -> FileLink:
        """Put a ``FileTier`` under this worker's host slab (see ``fs_link``).

        ``make_tier(epoch)``: the tier of a reset epoch's namespace (without it, resets keep the tier).
        """
        self.fs = FileLink(tier, self.pool, write_mode, ring_slots, write_back_lag_s=write_back_lag_s,
                           make_tier=make_tier)
        return self.fs

    # ---- jobs ------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        job = _Job(job_id, True, np.asarray(src_spec.block_ids))
        try:
            plan = self.planner.plan(src_spec.block_ids, src_spec.group_sizes,
                                     src_spec.block_indices, dst_spec.block_ids)
            job.slots = plan.slots.copy()
            if self.fs is not None:
                job.keys = getattr(dst_spec, "keys", None)
                self.fs.follow_epoch(getattr(dst_spec, "epoch", ""))
                self.fs.before_overwrite(job.slots.tolist(), job.keys, getattr(dst_spec, "evicted", ()),
                                         getattr(dst_spec, "salt", b""))
            self.pool.valid[plan.slots] = False  # stale until this write completes
            if self._forced_store_failures > 0:
                self._forced_store_failures -= 1
                raise InjectedFailure(f"injected failure of store job {job_id} (test hook)")
            self.stats.stored_pages += plan.num_pages
            job.nbytes = self._store_lane.submit(job, plan, to_host=True)
        except Exception as e:
            job.error = e
            self._settle(self._store_lane)
        if job.events is None:
            self._done.append(job)
        return True

    def submit_load(self, job_id: int, src_spec, dst_spec, expedited: bool = False) -> bool:
        on_device = _device_positions(src_spec)
        if on_device is not None and not self._running_after_forward:
            self._after_forward.append((job_id, src_spec, dst_spec, expedited))
            return True
        if self.fs is not None:
            self.fs.follow_epoch(getattr(src_spec, "epoch", ""))
            promote = getattr(src_spec, "promote", None)
            slots = np.asarray(src_spec.block_ids)
            if on_device is not None:
                slots = slots[~on_device]
            if promote is not None and promote.any() and slots.min(initial=0) >= 0:
                idx = np.flatnonzero(promote)
                p = self.fs.start_promotion(slots[idx].tolist(), [src_spec.keys[i] for i in idx],
                                            getattr(src_spec, "evicted", ()), getattr(src_spec, "salt", b""),
                                            budget_s=getattr(src_spec, "budget_s", 0.0))
                self._promoting_slots.update(p.slots)
                self._deferred.append(_DeferredLoad(job_id, src_spec, dst_spec, expedited, p))
                return True
            if self._promoting_slots and not self._promoting_slots.isdisjoint(slots.tolist()):
                self._deferred.append(_DeferredLoad(job_id, src_spec, dst_spec, expedited, None))
                return True
        return self._submit_load_now(job_id, src_spec, dst_spec, expedited)

    def _submit_load_now(self, job_id: int, src_spec, dst_spec, expedited: bool,
                         filed_slots: frozenset = frozenset()) -> bool:
        job = _Job(job_id, False, np.asarray(dst_spec.block_ids))
        try:
            if self._forced_load_failures > 0:
                self._forced_load_failures -= 1
                raise InjectedFailure(f"injected failure of load job {job_id} (test hook)")
            slots = np.asarray(src_spec.block_ids)
            on_device = _device_positions(src_spec)
            if on_device is not None:  # those positions never touch the host: any in-range slot plans them
                slots = np.where(on_device, 0, slots)
            plan = self.planner.plan(dst_spec.block_ids, dst_spec.group_sizes,
                                     dst_spec.block_indices, slots)
            device_pages, device_hits = [], None
            if on_device is not None:
                plan, device_pages, device_hits = self._split_device(plan, on_device, src_spec.device_blocks)
            plan = self._drop_invalid(plan, job)
            if job.failed:  # which chunks: the spec's keys of the slots that are not valid
                keys = getattr(src_spec, "keys", None)
                if keys is not None and len(keys) == len(slots):
                    job.failed_keys = [k for i, (k, s) in enumerate(zip(keys, slots.tolist()))
                                       if (on_device is None or not on_device[i]) and
                                       (s < 0 or not self.pool.valid[s])]
            job.hits = self._hits_of(plan, filed_slots)
            if device_hits:
                job.hits["hbm"] = device_hits
            self.stats.loaded_pages += plan.num_pages
            lane = self._lane_for(expedited)
            job.nbytes = lane.submit(job, plan, to_host=False, device_pages=device_pages) \
                if plan.num_pages or device_pages else 0
        except Exception as e:
            job.error = e
            self._settle(self._lane_for(expedited))
        if job.events is None:
            self._done.append(job)
        return True

    def get_finished(self) -> list[JobResult]:
        if self._after_forward:
            self._run_after_forward()
        if self._deferred:
            self._run_ready_loads()
        done, self._done = self._done, []
        if self.is_cuda:
            lanes = {id(x): x for x in (self._store_lane, self._load_lane, self._expedited_lane) if x}
            for lane in lanes.values():
                done += lane.poll()
        return [self._finish(job) for job in done]

    def wait(self, job_ids: set[int]) -> None:
        if self._after_forward and any(a[0] in job_ids for a in self._after_forward):
            self._run_after_forward()
        if self._deferred and any(d.job_id in job_ids for d in self._deferred):
            last = max(i for i, d in enumerate(self._deferred) if d.job_id in job_ids)
            for d in self._deferred[: last + 1]:
                if d.promotion is not None:
                    d.promotion.wait()
            self._run_ready_loads()
        if self.is_cuda:
            for lane in (self._store_lane, self._load_lane, self._expedited_lane):
                if lane is not None:
                    lane.wait(job_ids)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.is_cuda:
            for lane in (self._store_lane, self._load_lane, self._expedited_lane):
                if lane is not None:
                    try:
                        lane.drain()
                    except Exception:
                        logger.exception("draining a transfer lane failed")
            from gpu_offload.torch_backend import cuda_lane

            if self._registered:
                cuda_lane.unregister_host(self._registered)
        if self.fs is not None:
            try:
                self.fs.close()  # drains write-back, lets queued writes finish: files are complete or absent
            except Exception:
                logger.exception("closing the file tier failed")
        logger.debug("host tier worker shut down: %s", self.stats)

    # ---- load errors -----------------------------------------------------------
    def take_load_errors(self) -> tuple[set[int], set[int]]:
        """(engine blocks not filled, ids of the load jobs they belong to) of
        the jobs finished since the last call; cleared on read."""
        blocks, failures = self.take_load_failures()
        return blocks, set(failures)

    def take_load_failures(self) -> tuple[set[int], dict[int, list | None]]:
        """Like ``take_load_errors``, with each failed job's chunk keys that failed
        (None: the whole job, e.g. a failed copy), so the scheduler can hide just those."""
        out = (self._load_errors, {j: self._failed_load_keys.get(j) for j in self._failed_load_jobs})
        self._load_errors, self._failed_load_jobs, self._failed_load_keys = set(), set(), {}
        return out

    def take_load_error_blocks(self) -> set[int]:
        return self.take_load_errors()[0]

    # ---- internals -------------------------------------------------------------
    def _run_after_forward(self) -> None:
        """Submit the loads with device sources queued this step (their sources are written by now)."""
        todo, self._after_forward = self._after_forward, []
        self._running_after_forward = True
        try:
            for job_id, src_spec, dst_spec, expedited in todo:
                self.submit_load(job_id, src_spec, dst_spec, expedited)
        finally:
            self._running_after_forward = False

    def _split_device(self, plan: TransferPlan, on_device: np.ndarray, device_blocks) -> tuple:
        """(the plan's host pages, [(tensors, source blocks, destination blocks)] of its device pages,
        (chunks, tokens) they move). Raises ValueError on a malformed source (the job fails)."""
        k = self.planner.k
        groups, pages, tokens, chunks = [], [], 0, set()
        for g in plan.groups:
            m = on_device[g.pos]
            if not m.any():
                groups.append(g)
                continue
            pos, sub = g.pos[m], g.sub[m]
            src = np.empty(len(pos), dtype=np.int64)
            for i, (p, j) in enumerate(zip(pos.tolist(), sub.tolist())):
                blocks = device_blocks[p]
                if len(blocks) != k:
                    raise ValueError(f"device source of chunk {p} has {len(blocks)} blocks, a chunk has {k}")
                src[i] = blocks[j]
            if src.min() < 0 or src.max() >= self.num_engine_blocks:
                raise ValueError(f"device source block out of range [0, {self.num_engine_blocks})")
            pages.append((g.tensors, src, g.gpu[m].copy()))
            tokens = max(tokens, len(src) * self.tokens_per_block[g.index])
            chunks.update(pos.tolist())
            if not m.all():
                groups.append(g.select(~m))
        return TransferPlan(groups, plan.slots), pages, (len(chunks), tokens) if chunks else None

    def _run_ready_loads(self) -> None:
        """Submit deferred loads in order, up to the first whose reads are not in."""
        while self._deferred:
            d = self._deferred[0]
            filed: frozenset = frozenset()
            if d.promotion is not None:
                if not d.promotion.ready():
                    return
                self.fs.finish_promotion(d.promotion)
                self._promoting_slots.difference_update(d.promotion.slots)
                filed = frozenset(s for s, ok in zip(d.promotion.slots, d.promotion.ok) if ok)
            self._deferred.pop(0)
            self._submit_load_now(d.job_id, d.src_spec, d.dst_spec, d.expedited, filed)

    def _lanes(self, staging_slots: int):
        """(store lane, load lane, factory of the expedited-load lane)."""
        if self.is_cuda:
            from gpu_offload.torch_backend import cuda_lane

            def lane(priority: int = 0):
                return cuda_lane.CudaLane(self.engine, self.host_rows, self.layout, staging_slots,
                                          index_capacity=4 * self.num_engine_blocks, priority=priority,
                                          piece_rows=self._piece_rows, gather=self.gather)

            store, load = lane(), lane()
            self.device_bytes = store.device_bytes + load.device_bytes
            return store, load, lambda: lane(-1)  # expedited: higher stream priority
        if self.strategy == "direct":
            copier = DirectCopier(self.engine, PagedRows(self.host_rows, self.layout))
        else:
            staging = torch.empty((staging_slots, self.pool.stride), dtype=torch.int8, device=self.device)
            copier = StagedCopier(self.engine, self.host_rows, PagedRows(staging, self.layout),
                                  upload=torch.from_numpy, non_blocking=False, piece_rows=self._piece_rows,
                                  buffers=2,  # the halves as on CUDA, in call order
                                  make_mover=self._make_mover(self.device))
        sync = _SyncLane(copier, DevicePageCopier(self.engine, self.layout.page_bytes,
                                                  upload=None if self.strategy == "direct" else torch.from_numpy))
        return sync, sync, lambda: sync

    def _make_mover(self, device: torch.device):
        """``StagedCopier``'s mover factory for the chosen gather (None: the index path)."""
        if self.gather != "fused":
            return None
        return lambda addresses: fused_gather.make_mover(addresses, device)

    def _lane_for(self, expedited: bool):
        if not expedited:
            return self._load_lane
        if self._expedited_lane is None:
            self._expedited_lane = self._make_expedited()
        return self._expedited_lane

    def _settle(self, lane) -> None:
        """After a failed submit, let any half-queued copies land before the
        blocks are recomputed (error path only: a host sync is fine here)."""
        if self.is_cuda:
            try:
                lane.drain()
            except Exception:
                logger.exception("draining a transfer lane after a failed submit")

    def _drop_invalid(self, plan: TransferPlan, job: _Job) -> TransferPlan:
        """Pages from slots that never completed a store are load errors."""
        if self.pool.valid[plan.slots].all():
            return plan
        groups = []
        for g in plan.groups:
            ok = self.pool.valid[g.slot]
            job.failed += g.gpu[~ok].tolist()
            groups.append(g.select(ok))
        return TransferPlan(groups, plan.slots)

    def _hits_of(self, plan: TransferPlan, filed_slots: frozenset) -> dict:
        """{tier: (chunks, tokens)} this plan moves. Tokens: the deepest group
        (pages x its block size), so a load that enters a chunk mid-way counts
        only its own blocks; chunks: distinct slots with a page moved."""
        out = {}
        filed = np.fromiter(filed_slots, dtype=np.int64) if filed_slots else None
        for tier in ("cpu", "fs"):
            tokens, slots = 0, set()
            for g in plan.groups:
                if filed is None:
                    mask = None if tier == "cpu" else np.zeros(g.num_pages, bool)
                else:
                    mask = np.isin(g.slot, filed)
                    if tier == "cpu":
                        mask = ~mask
                sl = g.slot if mask is None else g.slot[mask]
                tpb = self.tokens_per_block[g.index]
                tokens = max(tokens, len(sl) * tpb)
                slots.update(np.unique(sl).tolist())
            if slots:
                out[tier] = (len(slots), tokens)
        return out

    def _finish(self, job: _Job) -> JobResult:
        s = self.stats
        if job.error is not None:
            logger.error("%s job %d failed: %r", "store" if job.is_store else "load", job.job_id, job.error)
            if job.is_store:
                s.store_failures += 1
            else:
                job.failed = job.engine_blocks.tolist()
        if job.is_store:
            s.store_jobs += 1
            if job.error is None:
                self.pool.valid[job.slots] = True
                if self.fs is not None:
                    self.fs.after_store(job.slots.tolist())
                s.stored_bytes += job.nbytes
                s.store_seconds += job.seconds or 0.0
        else:
            s.load_jobs += 1
            if job.failed:
                s.load_error_jobs += 1
                s.load_error_blocks += len(job.failed)
                self._load_errors.update(job.failed)
                self._failed_load_jobs.add(job.job_id)
                if job.error is None and job.failed_keys:
                    self._failed_load_keys[job.job_id] = job.failed_keys
            if job.error is None:
                s.loaded_bytes += job.nbytes
                s.device_copied_bytes += job.device_nbytes
                s.load_seconds += job.seconds or 0.0
                for tier, (chunks, tokens) in (job.hits or {}).items():
                    self.hits[tier][0] += chunks
                    self.hits[tier][1] += tokens
                    s.loaded_tokens += tokens
        ok = job.error is None
        return JobResult(job.job_id, ok, job.nbytes if ok else None, job.seconds if ok else None)
