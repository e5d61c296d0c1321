"""vLLM ``OffloadingManager`` over the shared core ``LRUChunkManager``.

Runs in the scheduler process. Slots handed out here index the host slab of
every worker (all workers hold the same slot layout for their own shard).

Reset: vLLM's scheduler never calls ``complete_load`` / ``complete_store``
for jobs issued before ``reset_cache`` (it fences them by job id and flushes
the workers), so a reset drops every chunk at once, pinned and in-flight
ones included, by starting a fresh index. Completions that still arrive for
keys the index does not know are ignored with a warning instead of crashing
the engine.

Failed loads: ``forget_chunks`` hides chunks a load failed on. They read as
misses (so vLLM recomputes instead of reloading them forever) and are never
loaded from that slot again; when the recompute stores the chunk, the old
slot is dropped and a fresh one stored (so its file is rewritten, over a
forged one if that was why the load failed); otherwise their slots return
when the LRU evicts them. Done here, over the core index's public API.

Tenants: with the file tier's secret, files are named and signed with keys
derived from the request's ``cache_salt`` (``hooks`` puts it in the
``ReqContext``); it travels to the workers in the specs (``salt``).

File tier (``files``, a read-only ``FileView``): a lookup falls through from
host to files. ``prepare_load`` gives a file-resident chunk a host slot
(store + complete + pin in the core index, so it is pinned like any load)
and marks it ``promote`` in the spec; the worker fills the slot from the
file, then copies it to the device. The manager never reads or writes a file.

Load or recompute (``load_decision``, core/costs.py): a lookup outside
the prefix its request's decision keeps reads as a miss (recomputed); the
decisions, one per scan of a request's keys, are ``decisions.LoadDecisions``. A load that promotes files carries
its hedge (``HostLoadSpec.budget_s``, the recompute time of its chunks): the
workers give up reads not done by then, so its blocks are load errors and
vLLM recomputes them. The file tier is probed at start and when idle
(``core/fs/probe.py``). A chunk whose store is in flight
(``HIT_PENDING``: vLLM makes the request wait) is offered only when waiting
for it pays. Costs are learned here from ``prepare_load`` → ``complete_load``
and ``prepare_store`` → ``complete_store``, and the prefill time per token
from each step's scheduling (``step_sent``) to the worker report that echoes
its id (``steps_done``), both called by ``hooks``: with async scheduling the
next step is scheduled when one is dispatched, so intervals between
schedules would time dispatches.

Device sources (``device_source``): once ``hooks`` binds vLLM's device
block pool (``bind_device``), a chunk whose blocks the device still caches
is a hit copied from there, taken before any tier (see that module); its
spec position carries the source block ids (``HostLoadSpec.device_blocks``)
and no slot. The load decision counts it as tier ``hbm``, near free (a device copy is
never slower).

Session leases (core/leases.py): a request whose ``kv_transfer_params``
carry a lease hint renews its session's lease when vLLM first sees it
(``on_new_request``) and leases its keys (the positions vLLM recorded in its
``ReqContext``, head first) to the session when it finishes; the host index
then evicts them only after its unleased chunks, until the lease expires.
The table outlives a reset (emptied), so its counters stay monotonic.

Hits: ``hit_chunks`` / ``fs_hit_chunks`` / ``device_hit_chunks`` count chunks handed to loads here
(tests and the demo read them). The exported ``tpu_offload_hit_*`` series
come from the worker instead (``gpu_offload.vllm.worker``): it knows which
blocks actually landed, including loads that cover only part of a chunk.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Collection, Iterable

import numpy as np

from tpu_offload.core import costs, leases

from tpu_offload.core.lru import LRUChunkManager
from tpu_offload.core.manager import Lookup

from gpu_offload._log import get_logger
from gpu_offload.vllm import metrics
from gpu_offload.vllm.compat import (
    DEVICE_HIT_SOURCE,
    DISK_HIT_SOURCE,
    HOST_HIT_SOURCE,
    CPULoadStoreSpec,
    LookupResult,
    ManagerCompat,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
    make_event,
)
from gpu_offload.vllm.decisions import LoadDecisions
from gpu_offload.vllm.device_source import DEVICE, DeviceSource
from gpu_offload.vllm.fs_specs import HostLoadSpec, HostStoreSpec

if TYPE_CHECKING:
    from gpu_offload.vllm.file_events import FileEvents
    from gpu_offload.vllm.fs_specs import FileView

logger = get_logger(__name__)

_LOOKUP = {Lookup.MISS: LookupResult.MISS, Lookup.HIT: LookupResult.HIT, Lookup.PENDING: LookupResult.HIT_PENDING}


class HostTierManager(ManagerCompat, OffloadingManager):
    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        blocks_per_chunk: int = 1,
        tokens_per_block: int = 0,
        enable_events: bool = False,
        files: "FileView | None" = None,
        file_events: "FileEvents | None" = None,
        write_back: bool = False,
        reset_epoch_file: str | None = None,
        load_decision: str = "auto",
        load_decision_bias: float = 1.0,
        lease_max_fraction: float = 0.5,
        lease_max_sessions: int = 4096,
        lease_files: bool = False,
    ):
        """``chunk_bytes``: host bytes of one chunk summed over all workers.
        ``file_events``: the file tier's KV events (``file_events``), with events on.
        ``reset_epoch_file``: ``fs_reset_epoch_file`` (the file tier's namespace after a reset)."""
        self.files = files
        self._epoch_file = reset_epoch_file
        self.epoch = ""  # the file tier's reset epoch: sent to the workers in every spec
        self.file_events = file_events if enable_events else None
        self.write_back = write_back
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_chunk = blocks_per_chunk * tokens_per_block
        self.enable_events = enable_events
        self.leases = leases.table_for(lease_max_fraction, lease_max_sessions, num_chunks)
        # The workers' file tiers lease too (``lease_files``: a file tier with a byte budget and a lease share):
        # the hints reach them on the step's metadata (hooks), bounded here if no step takes them.
        self._lease_files = lease_files
        self._fs_renews: collections.deque = collections.deque(maxlen=lease_max_sessions)
        self._fs_leases: collections.deque = collections.deque(maxlen=lease_max_sessions)
        self._lru = self._new_index()
        # Monotonic, across resets (read by tests and the demo).
        self.hit_chunks = 0  # loaded from host RAM
        self.fs_hit_chunks = 0  # promoted from files, then loaded
        self.device_hit_chunks = 0  # copied from the device's own prefix cache
        self.device: DeviceSource | None = None  # bind_device
        self.unplaced_chunks = 0  # file hits with no free host slot: failed loads, recomputed
        self.stored_chunks = 0
        self.resets = 0
        self.ignored_completions = 0
        self.forgotten_chunks = 0  # hidden after a failed load
        self._forgotten: set = set()  # still in the index, never served again
        self._removal_announced: set = set()  # forgotten keys already reported removed
        self._extra_events: list = []
        self._promoting: dict = {}  # key -> in-flight loads that promote it (get_load_source)
        self._unplaced: dict = {}  # key -> in-flight loads it could not be placed in
        # Since the last get_stats.
        self._pending_stored = 0
        self._evictions_seen = 0
        self._alloc_sizes: list[int] = []
        self.decisions = LoadDecisions(load_decision, load_decision_bias, chunk_bytes=chunk_bytes,
                                       tokens_per_chunk=self.tokens_per_chunk, tier_of=self._tier,
                                       salt_of=request_salt)
        self.costs = self.decisions.costs  # taught here, by completed loads and stores
        self._load_t0: dict = {}  # key -> (start, from a file) of its in-flight load
        self._worker_stats = None  # the workers' metrics since the last get_stats (note_worker_stats)
        self.closed = False
        self.probe = None  # auto: the file tier's timed probe reads (core/fs/probe.py)
        if files is not None and load_decision == "auto" and getattr(files, "ns_dirs", None):
            from tpu_offload.core.fs.probe import ReadProbe

            self.probe = ReadProbe(lambda: self.files.ns_dirs[0], self.costs.tiers[costs.FILE]).start()

    def shutdown(self) -> None:
        self.closed = True
        if self.probe is not None:
            self.probe.stop()

    def _new_index(self) -> LRUChunkManager:
        if self.leases is not None:
            self.leases.clear()  # nothing the old index held comes back
        return LRUChunkManager(self.num_chunks, self.chunk_bytes, enable_events=self.enable_events,
                               leases=self.leases)

    @property
    def index(self) -> LRUChunkManager:
        return self._lru

    @property
    def decision_tokens(self) -> dict[tuple[str, str, str], int]:
        """Tokens by (action, reason, tier) the load decisions counted, since start (tests, the demo)."""
        return self.decisions.decision_tokens

    def bind_device(self, device: DeviceSource | None) -> None:
        """vLLM's device block pool, as a load source (``hooks``, when the engine's KV layout allows)."""
        self.device = device

    # ---- lookups and loads ----------------------------------------------------
    def lookup(self, key, req_context) -> LookupResult:
        on_device = self.device.cached(key, req_context) if self.device is not None else None
        if key in self._forgotten and on_device is None:
            return LookupResult.MISS
        if self.costs.mode != "always" and not self.decisions.worth_loading(key, req_context):
            return LookupResult.MISS  # recomputed: its load would finish later than its recompute
        if on_device is not None:
            self.device.pin(req_context.req_id, key, on_device)
            return LookupResult.HIT
        state = self._lru.lookup(key)
        if state is Lookup.MISS and self.files is not None and self.files.contains(key, request_salt(req_context)):
            return LookupResult.HIT  # prepare_load promotes it
        return _LOOKUP[state]

    def _tier(self, key, salt: bytes, req_context=None) -> str | None:
        if self.device is not None and req_context is not None and self.device.cached(key, req_context):
            return DEVICE
        if key in self._forgotten:
            return None
        state = self._lru.lookup(key)
        if state is Lookup.HIT:
            return costs.HOST
        if state is Lookup.PENDING:
            return costs.PENDING
        if self.files is not None and self.files.contains(key, salt):
            return costs.FILE
        return None

    def on_schedule_end(self, context) -> None:
        """Requests admitted this step: count their load decisions once."""
        self.decisions.admitted(getattr(context, "new_req_ids", ()))
        parent = getattr(super(), "on_schedule_end", None)
        if parent is not None:
            parent(context)

    def on_request_finished(self, req_context) -> None:
        params = getattr(req_context, "kv_transfer_params", None)
        if (self.leases is not None or self._lease_files) and leases.has_hint(params):
            positions = getattr(req_context, "_offload_key_positions", {})
            ordered = sorted(positions, key=positions.__getitem__)  # head first: every later turn needs it
            leases.lease_from(self.leases, params, ordered)
            hint = leases.parse_hint(params) if self._lease_files else None
            if hint is not None:
                self._fs_leases.append((hint.session, hint.ttl_s, [bytes(k) for k in ordered],
                                        request_salt(req_context)))
        if self.device is not None:
            self.device.finished(req_context.req_id)
        self.decisions.finished(req_context.req_id)
        parent = getattr(super(), "on_request_finished", None)
        if parent is not None:
            parent(req_context)

    def step_sent(self, tokens: int) -> int:
        """A step was scheduled (hooks): its id, which the workers echo when its output is back (``steps_done``).
        The engine's prefill time per token, which the decision weighs loads against, is learned from the two."""
        return self.decisions.step_sent(tokens)

    def steps_done(self, steps) -> None:
        """The workers' reports of these steps came back with their output (hooks)."""
        self.decisions.steps_done(steps)

    def get_load_source(self, key, req_context):
        if self.device is not None and DEVICE_HIT_SOURCE is not None and \
                self.device.sourced(getattr(req_context, "req_id", None), key):
            return DEVICE_HIT_SOURCE
        if key in self._promoting and DISK_HIT_SOURCE is not None:
            return DISK_HIT_SOURCE
        return HOST_HIT_SOURCE if HOST_HIT_SOURCE is not None else super().get_load_source(key, req_context)

    def prepare_load(self, keys: Collection, req_context) -> CPULoadStoreSpec:
        keys = list(keys)
        on_device = self.device.take(req_context.req_id, keys) if self.device is not None else {}
        if not on_device:
            return self._prepare_tier_load(keys, req_context)
        self.device_hit_chunks += len(on_device)
        tier_keys = [k for k in keys if k not in on_device]
        tier = self._prepare_tier_load(tier_keys, req_context) if tier_keys else None
        slots = iter(tier.block_ids.tolist() if tier is not None else ())
        promote = iter(getattr(tier, "promote", np.zeros(len(tier_keys), bool)).tolist())
        merged = [(-1, False, tuple(b.block_id for b in on_device[k])) if k in on_device
                  else (next(slots), next(promote), None) for k in keys]
        return HostLoadSpec([m[0] for m in merged], keys, [m[1] for m in merged],
                            getattr(tier, "evicted", ()), salt=request_salt(req_context), epoch=self.epoch,
                            device_blocks=[m[2] for m in merged], budget_s=getattr(tier, "budget_s", 0.0))

    def _prepare_tier_load(self, keys: list, req_context) -> CPULoadStoreSpec:
        now = time.monotonic()
        for k in keys:
            self._load_t0[k] = (now, self.files is not None and self._lru.lookup(k) is Lookup.MISS)
            self.costs.tiers[costs.HOST].start(k)
        if self.files is None:
            slots = self._lru.prepare_load(keys)
            self._count_hits(len(keys), 0)
            return CPULoadStoreSpec(slots.tolist())
        lookup = self._lru.lookup
        in_files = [lookup(k) is Lookup.MISS for k in keys]
        salt = request_salt(req_context)
        if not any(in_files):
            slots = self._lru.prepare_load(keys)
            self._count_hits(len(keys), 0)
            return HostLoadSpec(slots.tolist(), keys, in_files, salt=salt, epoch=self.epoch)
        return self._prepare_promotion(keys, in_files, salt)

    def _prepare_promotion(self, keys: list, in_files: list[bool], salt: bytes = b"") -> HostLoadSpec:
        """Pin the host chunks first (so making room cannot evict them), then
        give each file chunk a slot: allocate, mark ready, pin."""
        host_keys = [k for k, f in zip(keys, in_files) if not f]
        file_keys = [k for k, f in zip(keys, in_files) if f]
        host_slots = iter(self._lru.prepare_load(host_keys).tolist())
        alloc = self._lru.prepare_store(file_keys)
        placed: dict = {}
        evicted: list = []
        if alloc is not None:
            evicted = list(alloc.evicted)
            self._expect_write_back(evicted)
            if self._forgotten and evicted:
                self._forgotten.difference_update(evicted)
            self._lru.complete_store(alloc.keys, True)
            self._lru.prepare_load(alloc.keys)
            placed = dict(zip(alloc.keys, alloc.slots.tolist()))
        # -1: no slot could be had (host tier all pinned); the worker fails the
        # job and vLLM recomputes it.
        slots = [placed.get(k, -1) if f else next(host_slots) for k, f in zip(keys, in_files)]
        for k in placed:
            self._promoting[k] = self._promoting.get(k, 0) + 1
        for k in file_keys:
            if k not in placed:
                self._unplaced[k] = self._unplaced.get(k, 0) + 1
        if len(placed) < len(file_keys):
            self.unplaced_chunks += len(file_keys) - len(placed)
            logger.warning("file tier: no free host slot for %d chunk(s); they will be recomputed",
                           len(file_keys) - len(placed))
        self._count_hits(len(host_keys), len(placed))
        # the hedge (auto): reads not done by the time recomputing these chunks would be give up
        budget = self.costs.hedge_s(len(keys) * self.tokens_per_chunk) if placed else 0.0
        return HostLoadSpec(slots, keys, in_files, evicted, salt=salt, epoch=self.epoch, budget_s=budget)

    def _count_hits(self, host: int, files: int) -> None:
        self.hit_chunks += host
        self.fs_hit_chunks += files

    def touch(self, keys: Collection, req_context) -> None:
        if self._forgotten:
            keys = [k for k in keys if k not in self._forgotten]
        self._lru.touch(keys)

    def complete_load(self, keys: Collection, req_context) -> None:
        if self.device is not None:
            done = self.device.complete(req_context.req_id, keys)
            if done:
                keys = [k for k in keys if k not in done]
        self._learn_load(keys)
        if self._promoting or self._unplaced:
            for k in keys:
                _dec(self._promoting, k)
            keys = [k for k in keys if not _dec(self._unplaced, k)]  # never pinned
        self._complete(self._lru.complete_load, keys, Lookup.HIT, "complete_load")

    # ---- stores ------------------------------------------------------------------
    def prepare_store(self, keys: Collection, req_context) -> PrepareStoreOutput | None:
        if self._forgotten:
            # A chunk hidden after a failed load (e.g. its file failed its MAC) is stored afresh when
            # recomputed: its old slot goes first, so the workers write the file again (over a forged
            # one) and the chunk can be served again.
            stale = [k for k in keys if k in self._forgotten]
            if stale:
                self._forgotten.difference_update(self._lru.discard(stale))
        alloc = self._lru.prepare_store(list(keys))
        if alloc is None:
            return None
        if alloc.keys:
            self._alloc_sizes.append(len(alloc.keys))
        self._expect_write_back(alloc.evicted)
        if self._forgotten and alloc.evicted:
            self._forgotten.difference_update(alloc.evicted)
        if alloc.keys:
            for k in alloc.keys:  # complete_store learns from the oldest of its keys
                self.costs.tiers[costs.PENDING].start(k)
        slots = alloc.slots.tolist()
        spec = CPULoadStoreSpec(slots) if self.files is None else \
            HostStoreSpec(slots, alloc.keys, alloc.evicted, salt=request_salt(req_context), epoch=self.epoch)
        return PrepareStoreOutput(
            keys_to_store=list(alloc.keys),
            store_spec=spec,
            evicted_keys=list(alloc.evicted),
        )

    def complete_store(self, keys: Collection, req_context, success: bool = True) -> None:
        keys = list(keys)
        if keys:
            self.costs.tiers[costs.PENDING].finish_many(keys, len(keys) * self.chunk_bytes)
        done = self._complete(lambda ks: self._lru.complete_store(ks, success), keys, Lookup.PENDING,
                              "complete_store")
        if success:
            self.stored_chunks += done
            self._pending_stored += done
            if self.file_events is not None and not self.write_back:
                self.file_events.expect(keys)  # write-through: the workers write them now

    def _expect_write_back(self, evicted) -> None:
        if evicted and self.file_events is not None and self.write_back:
            self.file_events.expect(k for k in evicted if k not in self._forgotten)

    def _complete(self, fn, keys: Collection, state: Lookup, what: str) -> int:
        """Batch call for the keys in ``state``; the rest (dropped by a reset)
        are ignored. Per key only if the batch is refused."""
        keys = list(keys)
        ok = [k for k in keys if self._lru.lookup(k) is state]
        for k in keys if len(ok) != len(keys) else ():
            if self._lru.lookup(k) is not state:
                self._ignore(what, k)
        try:
            fn(ok)
            return len(ok)
        except ValueError:
            done = 0
            for k in ok:
                try:
                    fn((k,))
                    done += 1
                except ValueError:
                    self._ignore(what, k)
            return done

    # ---- requests, events, reset, stats -----------------------------------------
    def on_new_request(self, req_context) -> RequestOffloadingContext:
        params = getattr(req_context, "kv_transfer_params", None)
        hint = leases.renew_from(self.leases, params)
        if self._lease_files and leases.has_hint(params):
            hint = hint or leases.parse_hint(params)
            if hint is not None:
                self._fs_renews.append((hint.session, hint.ttl_s))
        return RequestOffloadingContext()

    def take_fs_leases(self) -> tuple[list, list] | None:
        """The workers' file-tier lease orders since the last call (hooks put them on the step's metadata):
        (renewals: (session, ttl_s); leases: (session, ttl_s, keys head first, salt)); None if there are none."""
        if not (self._fs_renews or self._fs_leases):
            return None
        out = list(self._fs_renews), list(self._fs_leases)
        self._fs_renews.clear()
        self._fs_leases.clear()
        return out

    def take_events(self) -> Iterable:
        extra, self._extra_events = self._extra_events, []
        yield from extra
        fe = self.file_events
        for ev in self._lru.take_events():
            keys = ev.keys
            if ev.removed and self._removal_announced:
                keys = [k for k in keys if k not in self._removal_announced]
                self._removal_announced.difference_update(ev.keys)
            if fe is not None:
                keys = fe.hold(keys) if ev.removed else fe.back_in_host(keys)
            if keys:
                yield make_event(keys, ev.removed)
        if fe is not None:
            yield from fe.take()

    def note_file_outcomes(self, meta) -> None:
        """The workers' file outcomes of a step (``FileTierWorkerMetadata``)."""
        if self.files is not None:
            self.files.note(meta)  # a rank's tier turned off or came back
        if self.file_events is not None:
            self.file_events.note(meta)

    def reset_cache(self) -> None:
        evictions = self._lru.evictions
        self._lru = self._new_index()
        self._lru.evictions = evictions  # keep the counter monotonic
        self._forgotten.clear()
        self._removal_announced.clear()
        self._extra_events.clear()
        self._promoting.clear()
        self._unplaced.clear()
        self._load_t0.clear()
        self.decisions.reset()
        if self.device is not None:
            self.device.reset()
        if self.file_events is not None:
            self.file_events.reset()
        if self.files is not None:  # old weights' KV must not come back from files either
            from tpu_offload.core.fs.reset import reset_salt

            self.epoch = reset_salt(self._epoch_file, self.epoch)
            self.files.reset(self.epoch)  # the workers follow at their next spec
        self.resets += 1

    def get_stats(self):
        evicted = self._lru.evictions - self._evictions_seen
        self._evictions_seen = self._lru.evictions
        out = metrics.build_stats(
            self._lru.stats(),
            stored_chunks=self._pending_stored,
            evicted_chunks=evicted,
            allocation_sizes=self._alloc_sizes,
        )
        self._pending_stored = 0
        self._alloc_sizes = []
        metrics.add_decisions(out, *self.decisions.take_pending())
        if self.leases is not None:
            metrics.add_leases(out, *self.leases.take_counts())
        if self._worker_stats is not None:
            out, self._worker_stats = self._worker_stats.aggregate(out), None
        return out

    def note_worker_stats(self, stats) -> None:
        """The workers' metrics of a step (hooks), returned with ours by the next ``get_stats``."""
        self._worker_stats = stats if self._worker_stats is None else self._worker_stats.aggregate(stats)

    def _learn_load(self, keys) -> None:
        """A load job finished: its time teaches the host tier, or the file tier when it read files."""
        t0s = [self._load_t0.pop(k, None) for k in keys]
        host = self.costs.tiers[costs.HOST]
        for k in keys:
            host.drop(k)
        t0s = [t for t in t0s if t is not None]
        if not t0s:
            return
        n = len(t0s)
        took = time.monotonic() - min(t for t, _ in t0s)
        files = sum(1 for _, f in t0s if f)
        if files:  # the file reads, less the host-to-device copy every chunk takes
            read_s = max(took - host.seconds(n * self.chunk_bytes), 1e-6)
            if self._forgotten and any(k in self._forgotten for k in keys):
                read_s *= costs.CENSORED  # failed (its hedge gave up on it): it would have taken longer
            self.costs.tiers[costs.FILE].observe(files * self.chunk_bytes, read_s)
        else:
            host.observe(n * self.chunk_bytes, took)

    def forget_chunks(self, keys: Iterable) -> int:
        """Hide chunks a load failed on; see the module docstring."""
        keys = list(keys)
        if self.device is not None:
            self.device.refuse(keys)
        fresh = [k for k in keys if k not in self._forgotten and self._lru.lookup(k) is not Lookup.MISS]
        if not fresh:
            return 0
        self._forgotten.update(fresh)
        ready = [k for k in fresh if self._lru.lookup(k) is Lookup.HIT]
        if ready and self.enable_events:
            self._removal_announced.update(ready)
            self._extra_events.append(make_event(ready, removed=True))
        self.forgotten_chunks += len(fresh)
        logger.warning("host tier: %d chunk(s) failed to load; they will be recomputed", len(fresh))
        return len(fresh)

    def config_info(self):
        return [{
            "cpu_num_chunks": self.num_chunks,
            "cpu_blocks_per_chunk": self.blocks_per_chunk,
            "cpu_kv_cache_size_bytes": self.num_chunks * self.chunk_bytes,
            "cpu_kv_cache_size_tokens": self.num_chunks * self.tokens_per_chunk,
        }]

    def _ignore(self, what: str, key: bytes) -> None:
        self.ignored_completions += 1
        logger.warning("%s for a chunk this index does not track (reset?): %s", what, bytes(key).hex()[:16])


class RequestSalt(bytes):
    """A request's ``cache_salt``, kept in its ``ReqContext`` state (``hooks``)."""


def request_salt(req_context) -> bytes:
    get = getattr(req_context, "get_state", None)
    salt = get(RequestSalt) if get is not None else None
    return bytes(salt) if salt else b""


def _dec(counts: dict, key) -> bool:
    """Take one count of ``key`` off ``counts``; whether it had one."""
    n = counts.get(key)
    if n is None:
        return False
    if n == 1:
        del counts[key]
    else:
        counts[key] = n - 1
    return True
