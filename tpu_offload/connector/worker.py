"""Worker half: runs the scheduler's orders on the JAX data path.

tpu-inference calls ``register_runner`` (never ``register_kv_caches``) and
rebinds ``runner.kv_caches`` every step, so the caches are read from the
runner at the moment of use and the arrays a donating program returns are
written back to it.

Nothing here waits on a transfer: each step dispatches its loads (before or
after the forward, as vLLM decides) and its stores (after the forward), then
polls the "done" arrays of earlier transfers. A load that cannot be served
(slot not valid in this process, checksum mismatch, failed dispatch or
transfer) is reported as invalid blocks so vLLM recomputes them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any, Sequence

import jax

from tpu_offload.connector.exit_hook import ExitHook, register_at_exit
from tpu_offload.connector.guard import Guard
from tpu_offload.connector.hbm import HbmInFlight
from tpu_offload.connector.metadata import LoadOp, OffloadMetadata, OffloadReport
from tpu_offload.core.fs.journal import PUBLISHED, REMOVED
from tpu_offload.connector.metrics import ConnectorMetrics
from tpu_offload.connector.registration import build_engine, start_up_round_trip
from tpu_offload.connector.settings import Settings
from tpu_offload.connector.stats import OffloadStats
from tpu_offload.core.config import ConfigError
from tpu_offload.connector import budget
from tpu_offload.connector.interleave import HBM_SLOT
from tpu_offload.jax_backend.engine import CopyChunk, Done, LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.pacing import Paced, Pacer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Flight:
    done: Any  # jax.Array that becomes ready when the transfer finished (None: nothing sent)
    kind: str  # "store" | "load"
    ops: list
    bad: dict[int, list[int]]  # op_id -> slots refused or failed
    nbytes: int
    started: float
    dispatched: float = 0.0  # loads: before the dispatch (started: after it)
    hbm: int = 0  # HBM per device it holds until it lands (connector/hbm.py)
    copied: int = 0  # loads: chunks copied between HBM blocks (interleaved lookups), bytes: copy_bytes
    copy_bytes: int = 0


def transfer_path(cfg, devices, ranks: int = 1) -> str:
    """``auto``: the program path, which registration turns into the direct kernel's on a TPU where that can
    serve the cache (registration.pick_path). On TPU its gather/scatter are DMA kernels and its host copies
    write preallocated slabs in place, so every program a pass runs moves that pass's blocks, nothing
    more (tests/tpu_compiler). ``device_put`` is an opt-in whose two wrapper programs touch the whole
    staging buffer on every pass (8,000 MiB per device at Qwen3-32B TP 8 on TPU7x, whatever the pass
    moves) and which allocates one host array per stored chunk and device."""
    if cfg.transfer_path == "device_put" and ranks > 1:
        raise ConfigError(f"transfer_path='device_put' with {ranks} attention-DP ranks: each rank keeps its chunks "
                          "in its own devices' host memory, which only the program path writes; set "
                          "transfer_path to 'program' or 'auto' (TPU_OFFLOAD_TRANSFER_PATH)")
    return "program" if cfg.transfer_path == "auto" else cfg.transfer_path


class OffloadWorker:
    def __init__(self, settings: Settings, metrics: ConnectorMetrics | None = None, *,
                 free_hbm_bytes: int | None = None, hbm_limit_bytes: int | None = None,
                 free_host_bytes: int | None = None,
                 max_slab_bytes: int | None = None, fs_fingerprint=None):
        self.s = settings
        self._fs_fp = fs_fingerprint
        self.fs = None  # FsMover, when shared_storage_path is set
        self.metrics = metrics or ConnectorMetrics.get()
        self.stats = OffloadStats()  # drained by vLLM every step
        self.totals: dict[str, float] = {}  # the same counters since start (tests, debugging)
        self.runner = None
        self.engine: TransferEngine | None = None
        self.chunk_bytes = 0  # distinct KV bytes of one chunk, all layers and devices (set at registration)
        self._free_hbm = free_hbm_bytes  # override the allocator's figures (tests, CPU)
        self._hbm_limit = hbm_limit_bytes
        self._free_host = free_host_bytes
        self._max_slab_bytes = max_slab_bytes
        self._flights: list[_Flight] = []
        self.hbm = HbmInFlight(0)  # bounded at registration by what the HBM check counted
        self._store_ops_left: dict[str, int] = {}  # req -> store ops not yet completed
        self._releasing: set[str] = set()  # finished reqs to report once their stores are done
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()  # hybrid KV-cache groups: failed loads, per request
        self._load_errors: set[int] = set()
        self._report = OffloadReport()
        self._pidx = 0  # set at registration, once JAX (and jax.distributed) is initialized
        self._loaded_meta = None
        self._early_meta = None
        self._saved_meta = None
        self._to_read: collections.deque = collections.deque()  # (op_id, key, slot, salt) waiting for a buffer
        self._promoting: dict[int, tuple[set[int], list[int]]] = {}  # op_id -> (slots left, failed slots)
        self._hedge_end: dict[int, float] = {}  # op_id -> when its reads are given up (load_decision auto)
        self._restored_id: str | None = None  # id of the restored slabs (warm restart)
        self._snapshot_id = ""  # id to save under, from the scheduler
        self._snapshot_checked = False
        self._reset_salt = ""  # the scheduler's latest reset (see OffloadScheduler.reset_cache)
        self._at_exit = None  # registered with atexit while file writes or a snapshot could be lost
        self._windowed = False  # sliding-window layers stored by their window only (set at registration)
        self.guard = Guard(self.metrics)  # the connector routes through it too (one log-once set per half)

    # ---- setup -------------------------------------------------------------
    def register_runner(self, runner) -> None:
        cfg = self.s.config
        self.runner = runner
        self._pidx = jax.process_index()
        self._report = OffloadReport(process_count=jax.process_count())
        build = lambda direct=True: build_engine(  # noqa: E731
            self.s, runner, self._pidx, transfer_path, free_hbm_bytes=self._free_hbm, hbm_limit_bytes=self._hbm_limit,
            free_host_bytes=self._free_host, max_slab_bytes=self._max_slab_bytes, direct=direct)
        self.engine = start_up_round_trip(build(), runner, lambda: build(False))
        self._windowed = self.engine.layout.kv_groups > 1
        path = self.engine.path
        staging_per_device = self.engine.staging_device_bytes
        self.hbm = HbmInFlight(self.engine.in_flight_device_bytes)
        self.pacer = None
        # Host copies in pieces after the forward, up to the per-step budget the scheduler admits (the same
        # figure: core/step_budget.py). The pacer decides by bytes and steps only, but it stays off with
        # several JAX processes (multi-host) and attention-DP ranks: their staging is split per rank and their
        # waits (a slot overwritten, shutdown) follow local readiness. There the scheduler's budget still
        # bounds each step, and each step's copies go out at once.
        device = self.engine.layout.mesh.devices.flat[0]
        pace = cfg.transfer_pacing == "on" or (cfg.transfer_pacing == "auto" and device.platform == "tpu")
        if device.platform == "tpu" and budget.devices_per_chip(getattr(device, "device_kind", "")) \
                != cfg.devices_per_chip:
            log.warning("tpu_offload: devices_per_chip=%d, but %s has %d devices per chip: the per-step budget "
                        "per device is off by that ratio; set devices_per_chip (TPU_OFFLOAD_DEVICES_PER_CHIP)",
                        cfg.devices_per_chip, device.device_kind,
                        budget.devices_per_chip(device.device_kind))
        if pace and path == "program" and self.engine.layout.ranks == 1 and jax.process_count() == 1:
            self.pacer = Pacer(cfg.transfer_piece_bytes, self.s.step_budget_bytes)
            self.engine.pace(self.pacer)
        self.chunk_bytes = self.engine.chunk_bytes  # what one chunk costs on the host and on the wire
        if cfg.shared_storage_path:
            from tpu_offload.connector.fs import FsMover

            self.fs = FsMover(cfg, self._fs_fp, self.engine, self.metrics.core)
        if cfg.snapshot_path and self._fs_fp is not None:
            from tpu_offload.connector.snapshot import HOST_DIR
            from tpu_offload.jax_backend.snapshot import restore_slabs

            restored: dict = {}
            self._restored_id = restore_slabs(self.engine, os.path.join(cfg.snapshot_path, HOST_DIR),
                                              self._fs_fp.digest().hex(), cfg.fs_secret, restored,
                                              timeout_s=cfg.multihost_timeout_s)
            self.totals["snapshot_dropped"] = restored.get("dropped", 0)  # slots failing their MAC/checksum
        if (self.fs is not None or cfg.snapshot_path) and self._at_exit is None:
            # tpu-inference never shuts a worker down (TPUWorker has no shutdown; a multi-host replica's
            # Ray workers just exit): at process exit, land queued file writes and save the snapshot.
            # The handler holds the worker until its shutdown: one dropped without a shutdown still flushes.
            self._at_exit = ExitHook(self)
            register_at_exit(self._at_exit)
        if not cfg.skip_precompile:
            t0 = time.perf_counter()
            self.engine.precompile()
            log.info("tpu_offload: compiled %d transfer programs in %.1fs", self.engine.programs.compiles,
                     time.perf_counter() - t0)
        log.info("tpu_offload: %d host chunks x %d blocks (%.2f GiB, %s, %s path), staging %d blocks (%.2f GiB "
                 "per device)", self.s.num_slots, self.s.blocks_per_chunk, self.engine.slab_bytes / (1 << 30),
                 cfg.host_memory_kind, path, self.s.staging_blocks, staging_per_device / (1 << 30))

    # ---- per step ----------------------------------------------------------
    def dispatch_early_stores(self, meta: OffloadMetadata) -> None:
        """exclusive: gather chunks whose blocks this step's forward or loads overwrite, before both.

        Called from ``bind_connector_metadata``: vLLM's runner mixin binds the
        metadata before the forward, but starts asynchronous loads (our
        ``start_load_kv``) only after the forward is launched."""
        if not isinstance(meta, OffloadMetadata) or meta is self._early_meta or self.engine is None:
            return
        self._early_meta = meta
        if self.pacer is not None:
            self.pacer.new_step()  # this step's byte budgets
        if meta.early_stores:
            self._count_stores(meta.early_stores)  # first, as in wait_for_save
            self._check_snapshot(meta)
            t0 = time.perf_counter()
            self._dispatch_stores(meta.early_stores)
            self._add("evict_copy_steps", 1)
            self._add("evict_copy_dispatch_seconds", time.perf_counter() - t0)

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        if not isinstance(meta, OffloadMetadata) or meta is self._loaded_meta:
            return
        self._loaded_meta = meta
        self._check_snapshot(meta)
        self.dispatch_early_stores(meta)  # no-op if bind_connector_metadata did it
        for op in meta.promotes:
            self._write_back(op.evict)
            if self.fs is not None:
                self.fs.overwrite(op.slots)  # queued writes of these slots go out now or are dropped
            self._promoting[op.op_id] = (set(op.slots), [])
            if getattr(op, "budget_s", 0) > 0:  # the hedge: past its recompute time the load cannot win
                self._hedge_end[op.op_id] = time.monotonic() + op.budget_s
            for slot, key in zip(op.slots, op.keys):
                self.engine.valid[slot] = False
                self._to_read.append((op.op_id, key, slot, op.salt))
        if meta.promotes:
            self._poll_fs()
        if not meta.loads:
            return
        chunks: list[LoadChunk] = []
        copies: list[CopyChunk] = []
        copy_ops: list[tuple[LoadOp, list[int]]] = []
        bad: dict[int, list[int]] = {}
        bpc = self.s.blocks_per_chunk
        lockstep = jax.process_count() > 1  # every host must launch the same programs on the same lists
        for op in meta.loads:
            for i, slot in enumerate(op.slots):
                blocks = op.blocks[i * bpc : (i + 1) * bpc]
                if slot == HBM_SLOT:  # interleaved lookup: copied from HBM blocks vLLM keeps for it
                    src = op.src[i * bpc : (i + 1) * bpc]
                    if len(src) == bpc and all(s >= 0 for s, d in zip(src, blocks) if d >= 0):
                        copies.append(CopyChunk(src, blocks))
                        copy_ops.append((op, blocks))
                    else:
                        bad.setdefault(op.op_id, []).append(slot)
                        self._load_failed(op, blocks)
                    continue
                ok = slot >= 0 and self.engine.check_loadable(slot)
                if ok or (lockstep and slot >= 0):
                    # A host that cannot serve a chunk still loads it (and reports its blocks as
                    # errors, so they are recomputed): a host that skipped it alone would launch a
                    # different program than its peers and stall their collectives.
                    chunks.append(LoadChunk(slot, blocks, self._by_class(op, i)))
                if not ok:
                    bad.setdefault(op.op_id, []).append(slot)
                    self._load_failed(op, blocks)
        nbytes = self.engine.moved_bytes(chunks)
        done = cdone = None
        t0 = time.perf_counter()  # dispatch: the ready histogram counts from here
        if copies:
            try:  # device to device: no host link, no HBM beyond staging
                self.runner.kv_caches, cdone = self.engine.copy(self.runner.kv_caches, copies,
                                                                on_pass=self._hand_back,
                                                                current=lambda: self.runner.kv_caches)
            except Exception:
                log.exception("tpu_offload: HBM copy dispatch failed; %d chunks will be recomputed", len(copies))
                for op, blocks in copy_ops:
                    bad.setdefault(op.op_id, []).append(HBM_SLOT)
                    self._load_failed(op, blocks)
                cdone, copies = None, []
        hbm = self._wait_for_hbm(self.engine.device_moved_bytes(chunks), "load") if self.hbm.enabled and chunks else 0
        if chunks:
            try:
                # Each pass donates the caches it is given: the runner holds every pass's output
                # at once, so a later pass that fails leaves it with live caches, never donated ones.
                # Paced: queued (copies from host in pieces, then the scatter into the runner's caches
                # of the step that sends it).
                self.runner.kv_caches, done = self.engine.load(self.runner.kv_caches, chunks,
                                                               on_pass=self._hand_back,
                                                               current=lambda: self.runner.kv_caches)
            except Exception:  # dispatch failed: nothing was written
                log.exception("tpu_offload: load dispatch failed; %d chunks will be recomputed", len(chunks))
                self._fail_loads(meta.loads, bad)
                done = None
        copied = len(copies) if cdone is not None else 0
        flight = _Flight(done, "load", list(meta.loads), bad, nbytes, time.perf_counter(), t0,
                         hbm if done is not None else self._untake(hbm), copied,
                         self.engine.moved_bytes([c.target() for c in copies]) if copied else 0)
        if cdone is not None:
            flight.done = cdone if done is None else Done((cdone, done))
        self._flights.append(flight)
        paced = [d for d in (cdone, done) if isinstance(d, Paced)]
        if paced:
            if any(not op.async_load for op in meta.loads):  # the forward needs it now: sent before it, unpaced
                for p in paced:
                    self.pacer.pump(only=p)
            else:  # vLLM starts asynchronous loads after the forward is launched
                self._pump()

    @property
    def sliding_classes(self) -> set[int]:
        """The layer classes that move only their window (``LayerGroup.kv_group`` values)."""
        if self.s.hybrid:
            return {g for g, w in enumerate(self.s.group_windows) if w is not None}
        return {1} if self._windowed else set()

    def _by_class(self, op, i: int):
        """Chunk ``i`` of ``op``'s ids per layer class (``LoadOp.groups``); None: ``blocks`` for every layer."""
        if not self._windowed or not op.groups:
            return None
        bpc = self.s.blocks_per_chunk
        return tuple(g[i * bpc : (i + 1) * bpc] for g in op.groups)

    def _hand_back(self, caches: list) -> None:
        self.runner.kv_caches = caches

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        if not isinstance(meta, OffloadMetadata) or meta is self._saved_meta:
            return
        self._saved_meta = meta
        self._count_stores(meta.stores)  # first: a caught error after this drops them exactly (connector/guard.py)
        if meta.step >= 0:  # echoed: the scheduler times the step to its output's return (core/costs.py)
            self._report.steps.append(meta.step)
        self._check_snapshot(meta)
        if self.fs is not None and (meta.fs_renews or meta.fs_leases):  # session leases (core/leases.py)
            self.fs.lease(meta.fs_renews, meta.fs_leases)
        self._releasing.update(meta.release)
        self._dispatch_stores(meta.stores)
        self._pump()  # after the step's forward (vLLM calls this once the forward is launched)
        self._poll()

    def _pump(self) -> None:
        """Send queued host-copy pieces within the step's budget (pacing.Pacer); only ever after the forward."""
        if self.pacer is not None:
            self.pacer.pump()
            over, self.engine.staging_overdrawn = self.engine.staging_overdrawn, 0
            if over:  # handed more than a step's budget sends (should not happen: the scheduler's admission)
                self._add("staging_overdrawn_pieces", over)

    def _count_stores(self, stores) -> None:
        for op in stores:
            self._store_ops_left[op.req_id] = self._store_ops_left.get(op.req_id, 0) + 1

    def _dispatch_stores(self, stores) -> None:
        for op in stores:
            self._write_back(op.evict)  # before the slots get new bytes
        if stores:
            bpc = self.s.blocks_per_chunk
            chunks = [StoreChunk(slot, op.blocks[i * bpc : (i + 1) * bpc], self._by_class(op, i))
                      for op in stores for i, slot in enumerate(op.slots)]
            if self.fs is not None:
                self.fs.overwrite([c.slot for c in chunks])  # never write a slot's next bytes under this key
            bad: dict[int, list[int]] = {}
            hbm = self._wait_for_hbm(self.engine.device_moved_bytes(chunks), "store") if self.hbm.enabled else 0
            try:
                done = self.engine.store(self.runner.kv_caches, chunks, current=lambda: self.runner.kv_caches)
            except Exception:
                log.exception("tpu_offload: store dispatch failed; %d chunks not stored", len(chunks))
                done = None
                bad = {op.op_id: list(op.slots) for op in stores}
            self._flights.append(_Flight(done, "store", list(stores), bad,
                                         self.engine.moved_bytes(chunks), time.perf_counter(),
                                         hbm=hbm if done is not None else self._untake(hbm)))

    def _wait_for_hbm(self, nbytes: int, direction: str) -> int:
        """Before a dispatch: wait for the oldest transfers to land until its HBM fits the bound (a transfer
        alone always goes). Returns the bytes it takes."""
        self._poll()
        waited = False
        while not self.hbm.fits(nbytes):
            f = next((f for f in self._flights if f.hbm), None)
            if f is None:
                break
            waited = True
            self._land(f)
        if waited:
            self._add(f"hbm_waited_{direction}s", 1)
            self.metrics.hbm_deferred.labels(direction=direction).inc()
        return self.hbm.take(nbytes)

    def _untake(self, nbytes: int) -> int:
        self.hbm.release(nbytes)
        return 0

    def _land(self, f: _Flight) -> None:
        """Wait for one transfer and complete it."""
        self._flights.remove(f)
        self._finish(f)

    def _finish(self, f: _Flight) -> None:
        """Wait for ``f`` (already out of ``_flights``) and complete it, failed if its transfer raised."""
        ok = True
        if f.done is not None:
            try:
                jax.block_until_ready(f.done)
            except Exception:
                log.exception("tpu_offload: a %s transfer failed", f.kind)
                ok = False
        try:
            self._complete(f, ok)
        except Exception as e:  # reported failed, never left in flight: connector/guard.py
            self.guard.flight_failed(self, f, e)

    def _check_snapshot(self, meta: OffloadMetadata) -> None:
        """Follow the scheduler's snapshot ids (slabs of another index are dropped) and its resets."""
        if not self._snapshot_checked:
            self._snapshot_checked = True
            if self._restored_id is not None and meta.restored_id != self._restored_id:
                log.warning("tpu_offload: restored host slabs (snapshot %s) do not belong to the scheduler's "
                            "index (snapshot %r); dropping them", self._restored_id, meta.restored_id)
                self.engine.valid[:] = False
        if meta.reset_salt != self._reset_salt:
            self._on_reset(meta.reset_salt)
        if meta.snapshot_id and not self._reset_salt:
            self._snapshot_id = meta.snapshot_id

    def _on_reset(self, salt: str) -> None:
        """The scheduler reset the tiers (weights changed): old KV must not reach the file tier or a snapshot."""
        self._reset_salt = salt
        self._snapshot_id = ""
        for f in self._flights:  # stores of old KV still in flight: no write-through when they land
            if f.kind == "store":
                for op in f.ops:
                    op.keys = []
        if self.fs is not None:
            self.fs.reset(salt)
        log.info("tpu_offload: cache reset: file tier namespace salted %s, no snapshot at shutdown", salt[:8])

    def _fail_loads(self, ops: Sequence[LoadOp], bad: dict[int, list[int]]) -> None:
        for op in ops:
            bad[op.op_id] = list(op.slots)
            self._load_failed(op, op.blocks)

    def _load_failed(self, op: LoadOp, blocks) -> None:
        """Tell vLLM what to recompute: the blocks (and, with windowed layers, the request's first
        loaded one), or with several KV-cache groups, whose block ids vLLM cannot map back to
        requests, the request (it then recomputes the request from its start)."""
        if self.s.failures_by_request:
            self._failed_recving.add(op.req_id)
            return
        self._load_errors.update(b for b in blocks if b >= 0)
        if op.restart >= 0:
            self._load_errors.add(op.restart)

    def _write_back(self, evict) -> None:
        if self.fs is None or not evict:
            return
        slots = {e[0] for e in evict}
        if any(not self.engine.valid[s] for s in slots):  # a small tier evicts a chunk whose store is in flight
            pending = [f for f in self._flights if f.kind == "store" and f.done is not None
                       and any(s in slots for op in f.ops for s in op.slots)]
            for f in pending:  # a transfer, never the filesystem: its bytes must be copied before the overwrite
                try:
                    jax.block_until_ready(f.done)
                except Exception:
                    pass  # _poll completes it as failed
            if pending:
                self._poll()
        for slot, key, *salt in evict:  # (slot, key, the evicted chunk's request salt)
            if self.engine.valid[slot]:
                self.fs.evicted(key, slot, salt[0] if salt else b"")  # unless the lag wrote it
            else:  # its store failed: nothing to write
                self.fs.count_drop("store_failed")

    def _poll_fs(self) -> None:
        """Start queued file reads, land finished ones in their slots, report done promotions."""
        if self.fs is None:
            for op_id, _key, slot, _salt in self._to_read:  # no tier (should not happen): fail them
                self._promoting[op_id][1].append(slot)
                self._promoting[op_id][0].discard(slot)
            self._to_read.clear()
        while self._to_read:
            op_id, key, slot, salt = self._to_read[0]
            end = self._hedge_end.get(op_id)
            left_s = None if end is None else end - time.monotonic()
            if left_s is not None and left_s <= 0:  # its hedge passed while it waited for a buffer: recomputed
                self._to_read.popleft()
                self.engine.complete_store([slot], False)
                self._promoting[op_id][0].discard(slot)
                self._promoting[op_id][1].append(slot)
                continue
            if not self.fs.read(op_id, key, slot, salt, deadline_s=left_s):
                break  # every buffer busy: the rest start on a later poll
            self._to_read.popleft()
        if self.fs is not None:
            for op_id, slot, ok in self.fs.finished_reads():
                self.engine.complete_store([slot], ok)
                left, failed = self._promoting[op_id]
                left.discard(slot)
                if not ok:
                    failed.append(slot)
        for op_id in [o for o, (left, _) in self._promoting.items() if not left]:
            _, failed = self._promoting.pop(op_id)
            self._hedge_end.pop(op_id, None)
            self._report.promotes.append((op_id, self._pidx, failed))

    def _poll(self, wait: bool = False) -> None:
        if self._promoting:
            self._poll_fs()
        still = []
        for f in self._flights:
            if f.done is not None and not wait and not f.done.is_ready():
                still.append(f)
                continue
            self._finish(f)
        self._flights = still
        if self.fs is not None:
            self.fs.pump()  # write-throughs waiting for a buffer
            self._count_fs_drops()
        self._maybe_release()

    def _count_fs_drops(self) -> None:
        n = self.fs.take_drops()
        if n:
            self._add("fs_dropped_writes", n)

    def _complete(self, f: _Flight, ok: bool) -> None:
        seconds = time.perf_counter() - f.started
        self.hbm.release(f.hbm)
        f.hbm = 0
        if f.kind == "store":
            for op in f.ops:
                failed = list(op.slots) if not ok else f.bad.get(op.op_id, [])
                good = [s for s in op.slots if s not in set(failed)]
                self.engine.complete_store(good, True)
                self.engine.complete_store(failed, False)
                if self.fs is not None and op.keys:  # write-through now, write-back within the lag
                    for slot, key in zip(op.slots, op.keys):
                        if slot in good:
                            self.fs.stored(key, slot, op.salt)
                self._report.stores.append((op.op_id, self._pidx, failed))
                self._store_ops_left[op.req_id] -= 1
                if not self._store_ops_left[op.req_id]:
                    del self._store_ops_left[op.req_id]
                self._add("store_errors", len(failed))
            if ok and f.done is not None:
                n = sum(len(op.slots) for op in f.ops)
                self._add("store_bytes", f.nbytes)
                self._add("store_seconds", seconds)
                self._add("stored_chunks", n)
                self.metrics.transfer("store", f.nbytes, seconds, n)
            return
        if not ok:
            self._fail_loads(f.ops, f.bad)
        for op in f.ops:
            bad = sorted(set(f.bad.get(op.op_id, [])))
            self._report.loads.append((op.op_id, self._pidx, bad))
            self._add("load_errors", len(bad))
            if op.last and op.async_load:
                self._finished_recving.add(op.req_id)
        if ok and f.done is not None:
            n = (sum(1 for op in f.ops for s in op.slots if s != HBM_SLOT)
                 - sum(1 for v in f.bad.values() for s in v if s != HBM_SLOT))
            if n or not f.copied:
                self._add("load_bytes", f.nbytes)
                self._add("load_seconds", seconds)
                self._add("loaded_chunks", n)
                self.metrics.transfer("load", f.nbytes, seconds, n)
            if f.copied:  # interleaved lookups: counted apart, tier "hbm" (no host link involved)
                self._add("hbm_copied_chunks", f.copied)
                self._add("hbm_copy_bytes", f.copy_bytes)
                self.metrics.core.record_transfer("load", f.copy_bytes, seconds, f.copied, tier="hbm")
            self.metrics.load_ready.observe(time.perf_counter() - f.dispatched)

    def _maybe_release(self) -> None:
        for req_id in list(self._releasing):
            if req_id not in self._store_ops_left:
                self._releasing.discard(req_id)
                self._finished_sending.add(req_id)

    # ---- results -----------------------------------------------------------
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), set()
        return sending or None, recving or None

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> OffloadReport | None:
        if self.fs is not None:  # the scheduler offers no file hits while this process's tier is off
            state = self.fs.tier.state.value
            if state != getattr(self, "_fs_state_sent", "rw"):
                self._fs_state_sent = state
                self._report.fs_states.append((self._pidx, state))
        journal = self.fs.tier.journal if self.fs is not None else None
        if journal is not None:
            for kind, key in journal.take():
                if kind == PUBLISHED:
                    self._report.fs_published.append(key)
                elif kind == REMOVED:
                    self._report.fs_removed.append(key)
        if self._report.is_empty():
            return None
        report, self._report = self._report, OffloadReport(process_count=jax.process_count())
        return report

    def _add(self, key: str, value: float) -> None:
        self.stats.add(key, value)
        self.totals[key] = self.totals.get(key, 0) + value

    def get_stats(self) -> OffloadStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._at_exit is not None:
            self._at_exit.worker = None  # shut down: nothing left for the exit hook
            self._at_exit = None
        deadline = time.monotonic() + timeout_s
        while self._flights and time.monotonic() < deadline:
            if self.pacer is not None:
                self.pacer.new_step()
            self._pump()
            self._poll()
            time.sleep(0.001)
        if self._flights:
            log.warning("tpu_offload: %d transfers still in flight at shutdown", len(self._flights))
        self._flights.clear()
        self.hbm.held = 0
        self._save_snapshot()
        if self.fs is not None:
            self.fs.close(timeout=max(1.0, deadline - time.monotonic()))
            self._count_fs_drops()
            self.fs = None
        self.engine = None
        self.runner = None

    def _save_snapshot(self) -> None:
        cfg = self.s.config
        if not cfg.snapshot_path or self.engine is None or self._fs_fp is None or not self._snapshot_id:
            return
        from tpu_offload.connector.snapshot import HOST_DIR
        from tpu_offload.jax_backend.snapshot import save_slabs

        if self._promoting:  # reads still landing: those slots are not valid
            self.engine.valid[[s for left, _ in self._promoting.values() for s in left]] = False
        try:
            t0 = time.perf_counter()
            n = save_slabs(self.engine, os.path.join(cfg.snapshot_path, HOST_DIR), self._snapshot_id,
                           self._fs_fp.digest().hex(), cfg.fs_secret, timeout_s=cfg.multihost_timeout_s)
            log.info("tpu_offload: saved %d host chunks to %s in %.1fs", n, cfg.snapshot_path,
                     time.perf_counter() - t0)
        except Exception:
            log.exception("tpu_offload: could not save the host slabs to %s", cfg.snapshot_path)

    def pending(self) -> int:
        return len(self._flights)
