"""Scheduler half: decides what to load and store; owns the chunk index.

Invariants this file keeps (each one a defect of the upstream connector):

* ``get_num_new_matched_tokens`` has no side effects: vLLM calls it again
  for every retry of a waiting request. Pins, plans and metrics happen in
  ``update_state_after_alloc``, once the blocks exist.
* Hits are whole chunks. A full-prompt hit reports N-1 tokens (vLLM must
  compute at least one); all chunks are still loaded.
* Every newly full chunk is stored the step it completes (prompt chunks
  always, decode chunks with ``decode_save``), including chunks the request
  got from the HBM prefix cache that the host tier no longer holds
  (planned in ``connector/stores.py``).
* One budget per step and direction (``core/step_budget.py``: a chip's link x
  the accepted stall, bytes per device, in whole chunks) bounds the loads and
  the stores each step sends, and this step's loads and stores together fit
  staging; the worker's pacer sends the same bytes per step, so it never has
  to refuse or drop what it is given. The rest waits for later steps, counted
  (``tpu_offload_deferred_bytes_total``); nothing is dropped.
* No store reads a freed block: ``request_finished`` keeps the blocks (returns
  True) while the request still has chunks to store, and the worker reports
  the request in ``finished_sending`` after the last one lands.
* A chunk becomes loadable only when every worker process has stored its
  shards (completions are counted per order and process).
* With a shared filesystem (``fs``), a prefix may continue with chunks that
  only exist as files; they are promoted into host slots, then loaded. Files
  are looked up, named and signed with the request's ``cache_salt``
  (``request_salt``; per-tenant keys with the tier's secret), and the salt
  travels with every store, promotion and write-back order to the workers.
* Sliding-window layers in "window" mode (``connector/windows.py``,
  ``connector/tails.py``): a store carries their blocks only in the tails a
  later request can read, and a hit ends only where its tail holds them.
* Load or recompute (``load_decision``, core/costs.py): a hit is offered
  only as far as its load is expected to finish before recomputing it would
  (per tier, from the times between sending each load or promotion and its
  completion report; prefill time per token from each step's scheduling to
  the report that echoes its id, so async scheduling's pipelined steps are
  timed by their compute, not their dispatch; under DP, where workers echo
  no id, from the intervals between ``build_connector_meta`` calls). The lookup
  fixes the decision; the allocation uses that one, so the two agree. A
  promotion carries its hedge (``PromoteOp.budget_s``, the loaded tokens'
  recompute time): reads not done by then fail, and the tokens are recomputed
  as any failed load's are. The file tier is probed at start and when idle.
* Interleaved lookups (``interleaved_lookups``, connector/interleave.py):
  past vLLM's own hit, a chunk HBM's prefix cache still holds is copied on
  the device (preferred), one the tiers hold is loaded; the hit ends where
  neither has the chunk. Source blocks stay pinned in vLLM's pool until the
  worker reports the copy.
* A chunk is loaded asynchronously for one request at a time: a request
  whose load would include a chunk another request is loading waits (its
  lookup returns ``None``) until vLLM has cached that request's blocks, then
  hits vLLM's own prefix cache. The wait ends when that load is reported in
  ``finished_recving``, its request finishes, or the tier is reset. A request
  that waited loads the rest of its hit inside its step when that fits the
  staging budget (an asynchronous load would add two steps to its wait).
* Session leases (core/leases.py): a request whose ``kv_transfer_params``
  carry a lease hint renews its session's lease when it is allocated, and
  leases its prefix's chunks to the session when it finishes; the host tier
  then evicts them only after its unleased chunks, until the lease expires.
  The file tier lives in the workers: the renewals and leases of each step
  travel to them in its metadata (``fs_renews``, ``fs_leases``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from typing import Any

from tpu_offload.connector import compat, dp
from tpu_offload.connector.events import EventTranslator
from tpu_offload.connector.exclusive import ExclusiveStores
from tpu_offload.connector.interleave import HBM_SLOT, HbmHits
from tpu_offload.connector.loads import InFlight, LoadPlan, LoadPlanner, Order, settle_store
from tpu_offload.connector.lookups import TierLookups
from tpu_offload.connector.metadata import OffloadMetadata, OffloadReport
from tpu_offload.connector.metrics import ConnectorMetrics
from tpu_offload.connector.settings import Settings
from tpu_offload.connector.stats import OffloadStats
from tpu_offload.connector.stores import StorePlanner
from tpu_offload.connector.tails import Tails
from tpu_offload.core import costs, leases
from tpu_offload.core.keys import ChunkKey, make_chunk_key
from tpu_offload.core.lru import LRUChunkManager

log = logging.getLogger(__name__)


def request_salt(request) -> bytes:
    """The request's ``cache_salt`` as the file tier takes it (as gpu_offload's manager does); b"" if none."""
    salt = getattr(request, "cache_salt", None)
    return str(salt).encode() if salt else b""


@dataclasses.dataclass
class _Req:
    request: Any
    cursor: int = 0  # chunks [0, cursor) are stored, in flight, or known present
    looked_up: bool = False  # lookup metrics recorded
    finishing: bool = False  # request_finished returned True: blocks are ours
    final_blocks: tuple[list[int], ...] | None = None  # per KV-cache group
    keys: list[ChunkKey] = dataclasses.field(default_factory=list)
    stale: bool = False  # holds KV computed before a reset (old weights): never stored


class OffloadScheduler:
    def __init__(self, settings: Settings, metrics: ConnectorMetrics | None = None, fs=None, fingerprint=None):
        s = self.s = settings
        cfg = settings.config
        self.bpc = s.blocks_per_chunk
        self.chunk_tokens = s.chunk_tokens
        self.manager = LRUChunkManager(s.num_slots, s.chunk_bytes, enable_events=cfg.enable_events,
                                       leases=leases.table_for(cfg.lease_max_fraction, cfg.lease_max_sessions,
                                                               s.num_slots))
        self.tails = Tails(s)  # sliding-window layers: which chunks hold them, ids per layer class
        self.async_load = not cfg.sync_load
        self.decode_save = cfg.decode_save
        self.events = EventTranslator(s.block_size, s.blocks_per_chunk)
        self.metrics = metrics or ConnectorMetrics.get()
        self.metrics.core.add_tier("cpu", self.manager.stats)
        self._staging_used = 0  # before set_gauges: under PROMETHEUS_MULTIPROC_DIR a gauge is read at once
        self.metrics.set_gauges(lambda: self.manager.stats().used_bytes, lambda: self._staging_used, s.staging_blocks)
        self.stats = OffloadStats()  # drained by vLLM every step
        self.totals: dict[str, float] = {}  # the same counters since start (tests, debugging)
        self.kv_cache_manager = None  # bound by vLLM (bind_kv_cache_manager)
        self._reqs: dict[str, _Req] = {}
        self._ids = itertools.count(dp.first_op_id(s.dp))  # DP ranks: their own ranges (connector/dp.py)
        self.loads = LoadPlanner(self.manager, self.bpc, lambda: next(self._ids))
        self.loading = InFlight()  # async loads vLLM waits for: their chunks are not loaded twice
        self._waited: set[str] = set()  # requests held back for another's load
        self._load_async: dict[str, bool] = {}  # what the last lookup told vLLM, per request
        self._sync_blocks_left = s.step_budget_blocks  # this step's budget for loads inside the step
        self._store_orders: dict[int, Order] = {}
        self.fs = fs if self.async_load else None  # file hits are always loaded asynchronously
        self.write_through = fs is not None and cfg.fs_write_mode == "write_through"
        self.write_back = fs is not None and not self.write_through
        self._slot_of: dict[ChunkKey, int] = {}  # for write-back: the slot an evicted chunk leaves
        self._salt_of: dict[ChunkKey, bytes] = {}  # ... and its request's cache_salt (absent: b"")
        self._fs_bad: set[ChunkKey] = set()  # files that failed to promote: not offered until we publish ours
        self._fs_off: set[int] = set()  # worker processes whose file tier is off: no file hits meanwhile
        self._file_events = cfg.enable_events
        self._procs = 1  # worker processes that must report each order (learned from reports)
        self.expected_procs: int | None = None  # what get_finished_count told vLLM's aggregator
        self._quarantine: set[ChunkKey] = set()  # present in the index but proved bad: never served
        self._fp = fingerprint
        # store_policy=exclusive: chunks HBM caches are watched, stored when vLLM reuses their blocks
        self.exclusive = ExclusiveStores(self) if cfg.store_policy == "exclusive" else None
        self.stores = StorePlanner(self)  # which chunks each step stores (connector/stores.py)
        self.lookups = TierLookups(self)  # which leading chunks the tiers can serve (connector/lookups.py)
        self._start: dict[str, int] = {}  # exclusive: the chunk a request's host lookup started at
        self.costs = costs.CostModel(cfg.load_decision, cfg.load_decision_bias)
        self._step_id = 0  # numbers each step's metadata; workers echo it (the step's timing, core/costs.py)
        self._decided: dict[str, tuple[int, costs.Decision]] = {}  # the last lookup's (chunks, decision)
        self.shared = None  # DP attention: the other ranks' chunks (connector/dp.py SharedIndex)
        self.hbm = HbmHits(self) if cfg.interleaved_lookups else None
        self.loads.unpin_hbm = self._unpin_hbm
        self._walked: dict[str, tuple[int, int]] = {}  # interleaved: the last lookup's (first chunk, chunks offered)
        self._fs_lookup = fs  # also when loads are synchronous (it learns resets)
        # Session leases for the workers' file tier (it evicts only with a budget): this step's, sent in its metadata
        self._lease_files = fs is not None and cfg.lease_max_fraction > 0 and cfg.fs_capacity_bytes is not None
        self._fs_renews: list[tuple[str, float]] = []
        self._fs_leases: list[tuple[str, float, list[bytes], bytes]] = []
        self.probe = None  # load_decision auto: the file tier's timed probe reads (core/fs/probe.py)
        if self.fs is not None and cfg.load_decision == "auto":
            from tpu_offload.core.fs.probe import ReadProbe

            self.probe = ReadProbe(lambda: self._fs_lookup.ns_dir, self.costs.tiers[costs.FILE]).start()
        self.reset_salt = ""  # see reset_cache
        self.restored_id = self.snapshot_id = ""  # warm restart: see connector/snapshot.py
        if cfg.snapshot_path and fingerprint is not None:
            from tpu_offload.connector.snapshot import new_id, restore_scheduler

            self.restored_id = restore_scheduler(cfg.snapshot_path, fingerprint, self.manager, cfg.fs_secret)
            self.snapshot_id = new_id()
            self._slot_of.update(self.manager.items_lru_order())

    # ---- keys and lookups (pure) -----------------------------------------
    def _keys(self, request, n: int | None = None) -> list[ChunkKey]:
        hashes = request.block_hashes
        count = len(hashes) // self.bpc if n is None else min(n, len(hashes) // self.bpc)
        return [make_chunk_key(bytes(hashes[(i + 1) * self.bpc - 1])) for i in range(count)]

    def _req_keys(self, st: _Req, n: int) -> list[ChunkKey]:
        hashes = st.request.block_hashes
        while len(st.keys) < min(n, len(hashes) // self.bpc):
            i = len(st.keys)
            st.keys.append(make_chunk_key(bytes(hashes[(i + 1) * self.bpc - 1])))
        return st.keys

    def _interleaved(self) -> bool:
        return self.hbm is not None and self.shared is None and self.hbm.active()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens any tier can serve beyond what vLLM computed; no side effects."""
        keys = self._keys(request)
        rid = request.request_id
        self._walked.pop(rid, None)
        src: list = []
        if self._interleaved():
            first = num_computed_tokens // self.chunk_tokens
            n_hit, on_fs, src = self.lookups.walk(request, keys, request_salt(request), first)
        else:
            start = num_computed_tokens // self.chunk_tokens if self.exclusive is not None else 0
            if self.exclusive is not None:
                self._start[rid] = start
            n_hit, on_fs = self.lookups.prefix(keys, request_salt(request), start)
        n_hit = self._decide(rid, n_hit, on_fs, num_computed_tokens, src)
        if src:
            self._walked[rid] = (num_computed_tokens // self.chunk_tokens, n_hit)
        hit_tokens = n_hit * self.chunk_tokens
        report = min(hit_tokens, request.num_tokens - 1)  # a full hit still computes one token
        n = max(0, report - num_computed_tokens) if hit_tokens > num_computed_tokens else 0
        if not (n and self.async_load):
            return n, False
        rid = request.request_id
        first = num_computed_tokens // self.chunk_tokens
        if len(self.loading) and self._hbm_caching():
            if self.loading.busy(keys[first:n_hit], rid):  # worth waiting for: _decide weighed the same load
                self._waited.add(rid)
                return None, False  # vLLM asks again next step, when the blocks may be cached
        load_async = not self._sync_after_wait(rid, n, on_fs[first:n_hit])
        self._load_async[rid] = load_async
        return n, load_async

    def _decide(self, req_id: str, n_hit: int, on_fs: list[bool], computed: int, src=()) -> int:
        """Cut the hit to the prefix worth loading (core/costs.py); remembered for the allocation.
        ``src``: per chunk, HBM source blocks (interleaved lookups: a device copy, near free) or None."""
        first = computed // self.chunk_tokens
        self._decided.pop(req_id, None)
        if n_hit <= first or self.costs.mode == "always":
            return n_hit
        tiers = [costs.HBM if src and src[c] else costs.FILE if on_fs[c] else costs.HOST
                 for c in range(first, n_hit)]
        d = self.costs.decide(tiers, self.s.chunk_bytes, self.chunk_tokens, computed - first * self.chunk_tokens)
        self._decided[req_id] = (first + d.load, d)
        return first + d.load

    def _sync_after_wait(self, req_id: str, n: int, on_fs: list[bool]) -> bool:
        """Whether a request that waited for another's load loads its rest inside this step.

        It already paid the wait; an asynchronous load of its (short) rest would
        add two more steps before its first token. Only host chunks (a file
        needs a promotion first), and only within this step's load budget, so
        the step's stall stays as bounded as an asynchronous part's.
        """
        if req_id not in self._waited or self.s.failures_by_request:  # failures reported per request need async loads
            return False
        blocks = -(-n // self.s.block_size)
        if blocks > self._sync_blocks_left or any(on_fs):
            return False
        self._sync_blocks_left -= blocks
        return True

    def _hbm_caching(self) -> bool:
        """Whether vLLM caches loaded blocks (waiting for another load is only worth it then)."""
        return getattr(self.kv_cache_manager, "enable_caching", True) is not False

    # ---- admission -------------------------------------------------------
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None)
        hint = leases.renew_from(self.manager.leases, params)
        if self._lease_files and leases.has_hint(params):
            hint = hint or leases.parse_hint(params)
            if hint is not None:
                self._fs_renews.append((hint.session, hint.ttl_s))
        self.loading.release(request.request_id)  # a new allocation: any earlier load is over
        self._waited.discard(request.request_id)
        load_async = self._load_async.pop(request.request_id, self.async_load)
        start = self._start.pop(request.request_id, 0)
        walked = self._walked.pop(request.request_id, None)
        decided, decision = self._decided.pop(request.request_id, (None, None))
        if decision is not None:  # once per allocation: the lookup that admitted it
            self.metrics.core.record_decision(decision, self.chunk_tokens)
            self._add("recomputed_hit_tokens", decision.recomputed * self.chunk_tokens)
        if self.exclusive is not None:
            self.exclusive.handed_out(blocks)
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request=request)
        st.request = request
        if num_external_tokens <= 0:
            if not st.looked_up:
                st.looked_up = True
                queried = request.num_tokens - request.num_computed_tokens
                self.metrics.lookup(queried, 0, 0)
                self._add("lookup_tokens", queried)
            return
        keys = self._keys(request)
        salt = request_salt(request)
        by_group = compat.block_ids_by_group(blocks)
        block_ids = by_group[self.s.full_group]
        src: list = []
        if walked is not None:  # interleaved: what the lookup offered, each chunk from where it is now
            n_hit, on_fs, src = self.lookups.walk(request, keys, salt, walked[0], limit=walked[1],
                                           exclude=frozenset(block_ids))
        else:
            n_hit, on_fs = self.lookups.prefix(keys, salt, start)
        if decided is not None:  # what the lookup offered (the tier may only have grown since)
            n_hit = min(n_hit, decided)
        hit_tokens = n_hit * self.chunk_tokens
        local = hit_tokens - num_external_tokens - (1 if hit_tokens >= request.num_tokens else 0)
        if local < 0 or local % self.s.block_size or hit_tokens <= local:
            raise RuntimeError(
                f"request {request.request_id}: {num_external_tokens} external tokens do not match the "
                f"{n_hit} ready chunks; the tier changed between lookup and allocation"
            )
        first = local // self.chunk_tokens
        skip = local // self.s.block_size  # blocks already computed locally
        load_keys = keys[first:n_hit]
        hbm_src: list[list[int] | None] = list(src[first:n_hit]) if src else []
        fs_idx = [i for i in range(len(load_keys)) if on_fs[first + i] and not (hbm_src and hbm_src[i] is not None)]
        host_idx = [i for i in range(len(load_keys)) if not on_fs[first + i]
                    and not (hbm_src and hbm_src[i] is not None)]
        slots = [-1] * len(load_keys)
        ready = [False] * len(load_keys)
        for i, ids in enumerate(hbm_src):
            if ids is not None:  # from HBM ([]: left it since the lookup, a load error)
                ready[i] = True
                if ids:
                    slots[i] = HBM_SLOT
                    self.hbm.pin(ids)  # vLLM neither reuses nor frees them until the copy is reported
        if self.shared is not None:  # chunks of other DP ranks: loaded straight from their slots
            host_idx = self.shared.place(self.manager, load_keys, host_idx, slots, ready)
        for i, slot in zip(host_idx, self.manager.prepare_load([load_keys[i] for i in host_idx])):
            slots[i], ready[i] = int(slot), True  # pinned until the worker reports the load
        evict: list[tuple[int, bytes]] = []
        if fs_idx and not load_async:  # left the host tier since the lookup: too late to promote
            for i in fs_idx:
                ready[i] = True  # slot -1: a load error, recomputed
            fs_idx = []
        if fs_idx:
            alloc = self.manager.prepare_store([load_keys[i] for i in fs_idx])
            if alloc is None:  # no host slot to promote into: those blocks become load errors
                for i in fs_idx:
                    ready[i] = True
                fs_idx = []
            else:
                evict = self._allocated(alloc, salt)
                slot_of = dict(zip(alloc.keys, (int(x) for x in alloc.slots)))
                for i in fs_idx:
                    slots[i] = slot_of[load_keys[i]]
                    self.tails.held[load_keys[i]] = False  # a file does not say whether it holds them
                    self.events.record(load_keys[i], request, first + i)
        dst: list[int] = []
        for c in range(first, n_hit):
            for b in range(c * self.bpc, (c + 1) * self.bpc):
                dst.append(block_ids[b] if b >= skip else -1)
        groups: list[list[int]] = [[] for _ in self.tails.classes()]
        tail = self.tails.start(n_hit)
        for c in range(first, n_hit):
            span = [b for b in range(c * self.bpc, (c + 1) * self.bpc)]
            per_class = self.tails.chunk_ids(by_group, span, in_tail=c >= tail)
            for lst, ids in zip(groups, per_class):
                lst.extend(i if b >= skip else -1 for b, i in zip(span, ids))
        restart = next(b for b in dst if b >= 0) if groups and not self.s.hybrid else -1
        self.loads.add(LoadPlan(request.request_id, load_async, load_keys, slots, dst, ready,
                                to_promote=fs_idx, evict=evict, salt=salt, groups=groups, restart=restart,
                                src=[ids or None for ids in hbm_src],
                                budget_s=self.costs.hedge_s(num_external_tokens) if fs_idx else 0.0))
        if load_async:
            self.loading.add(request.request_id, load_keys)
        if not st.looked_up:
            st.looked_up = True
            queried = request.num_tokens - local
            n_hbm = sum(1 for ids in hbm_src if ids)
            self.metrics.lookup(queried, num_external_tokens, len(load_keys), len(fs_idx), self.chunk_tokens,
                                hbm_chunks=n_hbm)
            self._add("lookup_tokens", queried)
            self._add("hit_tokens", num_external_tokens)
            if n_hbm:
                self._add("hbm_hit_chunks", n_hbm)

    # ---- per step --------------------------------------------------------
    def build_connector_meta(self, so, meta: OffloadMetadata | None = None) -> OffloadMetadata:
        """``meta``: fill this one (connector/guard.py keeps what got in when a step fails)."""
        if meta is None:
            meta = OffloadMetadata(restored_id=self.restored_id, snapshot_id=self.snapshot_id,
                                   reset_salt=self.reset_salt)
        meta.step, self._step_id = self._step_id, self._step_id + 1
        # One budget per direction and step (core/step_budget.py), the bytes the worker's pacer sends per step.
        # Loads: sync ones whole (the forward needs them now), async ones within it: a larger hit spreads over
        # steps. Stores: within it and what staging has left after this step's loads (a paced transfer holds
        # its staging chunks until its pieces are sent).
        step = self.s.step_budget_blocks
        loaded = step - self.loads.emit(meta, step, lambda n: self._defer("load", n))
        store_total = max(0, min(step, self.s.staging_blocks - loaded))
        store_budget = store_total
        if self.exclusive is not None:  # chunks whose HBM blocks this step reuses: copied first or lost
            store_budget = self.exclusive.emit(meta, so, store_budget)
        store_budget = self.stores.emit(meta, so, store_budget)
        self._staging_used = max(0, loaded) + store_total - max(store_budget, 0)
        self._sync_blocks_left = step  # lookups after this belong to the next step
        if self.fs is not None:
            self.fs.new_step()
        self.metrics.core.record_leases(self.manager.leases)
        if self._fs_renews or self._fs_leases:
            meta.fs_renews, self._fs_renews = meta.fs_renews + self._fs_renews, []
            meta.fs_leases, self._fs_leases = meta.fs_leases + self._fs_leases, []
        self._time_orders(meta, so)
        return meta

    def _time_orders(self, meta: OffloadMetadata, so) -> None:
        """Start the clocks the cost model learns from: this step's transfers, and the step itself."""
        tiers = self.costs.tiers
        for op in meta.loads:
            if op.op_id in self.loads.load_orders:
                tiers[costs.HOST].start(op.op_id)
        for op in meta.promotes:
            tiers[costs.FILE].start(op.op_id)
        for op in (*meta.stores, *meta.early_stores):
            if op.op_id in self._store_orders:
                tiers[costs.PENDING].start(op.op_id)
        self.costs.prefill.scheduled(meta.step, getattr(so, "total_num_scheduled_tokens", 0) or 0)

    def _defer(self, direction: str, blocks: int) -> None:
        self.metrics.core.record_deferred(direction, blocks, blocks * self.s.chunk_bytes // self.bpc)
        self._add(f"deferred_{direction}_blocks", blocks)

    def _allocated(self, alloc, salt: bytes = b"") -> list[tuple[int, bytes, bytes]]:
        """Book a successful prepare_store of a request with ``salt``; returns (slot, key, salt) of
        evicted chunks to write back (a chunk restored from a snapshot has no known salt: b"")."""
        self.metrics.core.record_evictions(len(alloc.evicted))
        evict = []
        for k in alloc.evicted:
            slot = self._slot_of.pop(k, None)
            ksalt = self._salt_of.pop(k, b"")
            if slot is not None and self.write_back:
                evict.append((slot, bytes(k), ksalt))
        self._slot_of.update(zip(alloc.keys, (int(x) for x in alloc.slots)))
        if salt and self.write_back:
            self._salt_of.update((k, salt) for k in alloc.keys)
        return evict

    def _store_salt(self, request) -> bytes:
        """The salt a store order carries: the request's where a file tier names chunks by it, else b""."""
        return request_salt(request) if self._fs_lookup is not None else b""

    # ---- feedback ----------------------------------------------------------
    def update_connector_output(self, output) -> None:
        for req_id in getattr(output, "finished_recving", None) or ():
            self.loading.release(req_id)  # vLLM caches its blocks before it asks about waiting requests
        raw = compat.extract_report(output)
        if raw is None:
            return
        self._apply_report(raw)
        self.metrics.core.refresh()  # completions change the tier gauges (mirrored under PROMETHEUS_MULTIPROC_DIR)

    def _apply_report(self, raw) -> None:
        report = OffloadReport.coerce(raw)
        if report.process_count > self._procs and self.expected_procs not in (None, report.process_count):
            log.error("tpu_offload: %d worker processes report, but vLLM's aggregator was told to wait for %d "
                      "per request: finished requests will be miscounted", report.process_count, self.expected_procs)
        self._procs = max(self._procs, report.process_count)
        if report.steps:
            self.costs.prefill.completed(report.steps)
        for proc, state in report.fs_states:
            (self._fs_off.add if state == "off" else self._fs_off.discard)(proc)
        if report.fs_published or report.fs_removed:
            if self._file_events:
                self.events.files(report.fs_published, report.fs_removed)
            self._fs_bad.difference_update(report.fs_published)  # our own copy is back: offer it again
        cb = self.s.chunk_bytes
        for order, failed in self._complete(self._store_orders, report.stores):
            self.costs.tiers[costs.PENDING].finish(order.op_id, len(order.keys) * cb)
            for k in settle_store(self.manager, order, failed):
                self.events.forget(k)
                self._slot_of.pop(k, None)
                self._salt_of.pop(k, None)
        for order, failed in self._complete(self.loads.promote_orders, report.promotes):
            # a failed read (its hedge or fs_io_timeout_s gave up on it) took at least that long
            self.costs.tiers[costs.FILE].finish(order.op_id, len(order.keys) * cb, censored=bool(failed))
            for k in self.loads.promoted(order, failed):
                self.events.forget(k)
                self._slot_of.pop(k, None)
                self._salt_of.pop(k, None)
                self._fs_bad.add(k)
            if failed:
                self.metrics.core.record_load_errors(len(failed), tier="fs")
        for order, _ in self._complete(self.loads.hbm_orders, report.loads):
            self._unpin_hbm(order.items)  # the copy is done (or failed): vLLM may reuse the source blocks
        for order, failed in self._complete(self.loads.load_orders, report.loads):
            self.costs.tiers[costs.HOST].finish(order.op_id, len(order.keys) * cb)
            self.manager.complete_load(order.keys)
            for k, s in zip(order.keys, order.slots):
                if s in failed:
                    self._quarantine.add(k)
            if failed:
                self.metrics.core.record_load_errors(len(failed))

    def _complete(self, orders: dict[int, Order], entries):
        """Orders every worker process has now reported, with the union of their bad slots."""
        for op_id, proc, bad in entries:
            order = orders.get(op_id)
            if order is None:
                continue
            order.reports[proc] = bad
            if len(order.reports) >= self._procs:
                del orders[op_id]
                order.op_id = op_id
                yield order, set().union(*order.reports.values())

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        # Finished while its asynchronous load is outstanding (aborted): vLLM frees its blocks when the
        # load is reported, whatever we answer, and blocks whose load was never sent (or an HBM copy
        # still on its way) hold no KV: nothing of it is stored.
        waiting = self.loading.has(req_id)
        self.loads.cancel(req_id)  # aborted while its load waited: release what was never sent
        self.loading.release(req_id)  # its blocks will not be cached: others load for themselves
        self._waited.discard(req_id)
        self._load_async.pop(req_id, None)
        self._start.pop(req_id, None)
        self._walked.pop(req_id, None)
        self._decided.pop(req_id, None)
        params = getattr(request, "kv_transfer_params", None)
        if leases.has_hint(params) and (self.manager.leases is not None or self._lease_files):
            keys = self._keys(request)
            leases.lease_from(self.manager.leases, params, keys)
            hint = leases.parse_hint(params) if self._lease_files else None
            if hint is not None:
                self._fs_leases.append((hint.session, hint.ttl_s, [bytes(k) for k in keys], request_salt(request)))
        st = self._reqs.get(req_id)
        if st is None:
            return False, None
        st.request = request
        if waiting:
            st.stale = True
        if self.stores.unstored(st, block_ids):
            st.finishing = True
            st.final_blocks = compat.block_ids_by_group(block_ids)
            return True, None
        del self._reqs[req_id]
        return False, None

    def file_hit_tokens(self, req_id: str) -> int:
        """Tokens of the request's planned load that come from the filesystem tier."""
        plan = self.loads.plans.get(req_id)
        return 0 if plan is None else len(plan.to_promote) * self.chunk_tokens

    def hbm_hit_tokens(self, req_id: str) -> int:
        """Tokens of the request's planned load copied from HBM blocks (interleaved lookups)."""
        plan = self.loads.plans.get(req_id)
        return 0 if plan is None else sum(1 for ids in plan.src if ids) * self.chunk_tokens

    def _unpin_hbm(self, ids) -> None:
        if self.hbm is not None:
            self.hbm.release(ids)

    # ---- housekeeping -------------------------------------------------------
    def has_pending_work(self) -> bool:
        return bool(self._store_orders) or self.loads.pending()

    def take_events(self) -> list:
        return self.events.translate(self.manager.take_events())

    def _add(self, key: str, value: float) -> None:
        self.stats.add(key, value)
        self.totals[key] = self.totals.get(key, 0) + value

    def get_stats(self) -> OffloadStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, e.g. after an RL weight update.

        Nothing computed before it may come back, from any tier: the host
        index is dropped (in-flight transfers finish into doomed slots), loads
        not yet sent become load errors (recomputed), requests that already
        hold computed KV never store again (a preempted request recomputes
        from zero and stores normally), the file tier moves to a namespace
        salted for this reset on both sides, and no warm-restart snapshot is
        saved (it would pair the new weights' KV with whatever weights the
        next start loads).
        """
        self.manager.reset()
        if self.exclusive is not None:
            self.exclusive.reset()
        self._quarantine.clear()
        self.tails.held.clear()
        self._slot_of.clear()
        self._salt_of.clear()
        self._fs_bad.clear()
        self.events.reset()
        self.loads.invalidate()
        self.loading.clear()  # nothing the tier held before may be served: no one waits for it
        for tier in self.costs.tiers.values():
            tier.forget_open()  # their orders will never be reported
        for st in self._reqs.values():
            st.cursor = 0
            st.keys.clear()
            if st.request.num_computed_tokens > 0 or st.finishing:
                st.stale = True
        from tpu_offload.connector.fs import reset_salt

        self.reset_salt = reset_salt(self.s.config, self.reset_salt) if self._fs_lookup is not None \
            else uuid.uuid4().hex
        if self._fs_lookup is not None:
            self._fs_lookup.reset(self.reset_salt)
        if self.snapshot_id:
            log.warning("tpu_offload: reset_cache after start: no warm-restart snapshot will be saved")
            self.snapshot_id = ""
        return True

    def shutdown(self) -> None:
        """Save the index for a warm restart (``snapshot_path``); never raises."""
        if self.probe is not None:
            self.probe.stop()
        cfg = self.s.config
        if not cfg.snapshot_path or self._fp is None or not self.snapshot_id:
            return
        from tpu_offload.connector.snapshot import save_index

        try:
            n = save_index(cfg.snapshot_path, self.snapshot_id, self._fp, self.manager, self._quarantine,
                           secret=cfg.fs_secret)
            log.info("tpu_offload: saved the index of %d host chunks to %s", n, cfg.snapshot_path)
        except Exception:
            log.exception("tpu_offload: could not save the host-tier index to %s", cfg.snapshot_path)
        self.snapshot_id = ""  # once

    def pinned_chunks(self) -> int:
        return self.manager.stats().pinned_chunks
