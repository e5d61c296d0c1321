"""No exception of the connector reaches vLLM's engine step: what each path does instead.

vLLM calls the connector inside its scheduler and model-runner steps, where
an exception ends the engine (and the server with it). Every entry point of
``TPUOffloadConnector`` runs through a ``Guard``; on an exception:

* a store is dropped: its slots are reported failed, so the scheduler frees
  them and the chunks are simply not in the tier (counted in
  ``tpu_offload_dropped_store_chunks``); a finished request's blocks are
  still released once its other stores are done;
* a load fails: its blocks (or, with several KV-cache groups, its request)
  are reported to vLLM, which recomputes them, and an asynchronous load is
  still reported finished so the request does not wait forever;
* the error is logged once per path and exception type, with its traceback;
  every one is counted in ``tpu_offload_connector_errors{path}``.

The recoveries touch the halves' bookkeeping directly (they are the only
code that knows which part of a step got through), and are themselves
guarded: a recovery that fails is logged and the step goes on.
"""

from __future__ import annotations

import collections
import logging
import time

from tpu_offload.connector import compat
from tpu_offload.connector.loads import LoadPlan, settle_store
from tpu_offload.connector.metadata import OffloadMetadata

log = logging.getLogger(__name__)


class Guard:
    def __init__(self, metrics):
        self.metrics = metrics
        self.counts: collections.Counter[str] = collections.Counter()  # path -> errors caught (tests, debugging)
        self._logged: set[tuple[str, str]] = set()
        # Requests whose load this guard failed on the scheduler side: their next lookups answer no hit, or
        # vLLM's retry (a load failed at the first block frees the request and schedules it anew) would hit
        # and fail again, forever. Worker-side failures need none: their slots come back quarantined.
        self.no_hits: set[str] = set()

    def caught(self, path: str, exc: BaseException) -> None:
        self.counts[path] += 1
        try:
            self.metrics.errors.labels(path=path).inc()
        except Exception:  # metrics must not be the next failure
            pass
        key = (path, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.error("tpu_offload: %s failed: %s: %s. The engine goes on (stores dropped, loads recomputed); "
                      "later %s errors here are only counted (tpu_offload_connector_errors)",
                      path, type(exc).__name__, exc, type(exc).__name__, exc_info=exc)

    def _recover(self, path: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.caught(path + ".recovery", e)

    # ---- worker half ----------------------------------------------------------
    def early_save(self, worker, meta) -> None:
        """exclusive's eviction copies (``bind_connector_metadata``): on an error they are dropped
        like any store, and the chunks are lost as an eviction without a copy would lose them."""
        try:
            worker.dispatch_early_stores(meta)
        except Exception as e:
            self.caught("early_stores", e)
            if isinstance(meta, OffloadMetadata) and worker._early_meta is meta:
                self._recover("early_stores", self._drop_ops, worker, meta.early_stores)

    def start_load(self, worker, meta) -> None:
        self.early_save(worker, meta)  # no-op if bind_connector_metadata did it; never inside the load's recovery
        try:
            worker.start_load_kv(meta)
        except Exception as e:
            self.caught("start_load_kv", e)
            self._recover("start_load_kv", self._fail_loads, worker, meta)

    def _fail_loads(self, worker, meta) -> None:
        from tpu_offload.connector.worker import _Flight

        if not isinstance(meta, OffloadMetadata):
            return
        reported = {p[0] for p in worker._report.promotes}
        for op in meta.promotes:  # never registered: report them failed (registered ones finish on their own)
            if op.op_id not in worker._promoting and op.op_id not in reported:
                _invalidate(worker, op.slots)
                worker._report.promotes.append((op.op_id, worker._pidx, list(op.slots)))
        sent = {op.op_id for f in worker._flights if f.kind == "load" for op in f.ops}
        ops = [op for op in meta.loads if op.op_id not in sent]
        if ops:
            bad: dict[int, list[int]] = {}
            worker._fail_loads(ops, bad)  # the blocks (or requests) vLLM recomputes
            worker._flights.append(_Flight(None, "load", ops, bad, 0, time.perf_counter()))  # reported next poll

    def save(self, worker, meta) -> None:
        try:
            worker.wait_for_save(meta)
        except Exception as e:
            self.caught("wait_for_save", e)
            self._recover("wait_for_save", self._drop_stores, worker, meta)

    def _drop_stores(self, worker, meta) -> None:
        if not isinstance(meta, OffloadMetadata) or worker._saved_meta is not meta:
            return  # not taken in: the scheduler never learns of it (cannot happen past the isinstance check)
        worker._releasing.update(meta.release)  # finished requests: released once their stores are done
        self._drop_ops(worker, meta.stores)

    def _drop_ops(self, worker, stores) -> None:
        from tpu_offload.connector.worker import _Flight

        sent = {op.op_id for f in worker._flights if f.kind == "store" for op in f.ops}
        reported = {s[0] for s in worker._report.stores}
        ops = [op for op in stores if op.op_id not in sent and op.op_id not in reported]
        if ops:
            _invalidate(worker, [s for op in ops for s in op.slots])
            self.metrics.dropped_stores.inc(sum(len(op.slots) for op in ops))
            worker._add("dropped_store_chunks", sum(len(op.slots) for op in ops))
            bad = {op.op_id: list(op.slots) for op in ops}
            flight = _Flight(None, "store", ops, bad, 0, time.perf_counter())  # reported next poll
            flight.dropped = True  # counted here, not again if its completion fails too
            worker._flights.append(flight)

    def flight_failed(self, worker, flight, exc: BaseException) -> None:
        """A transfer's completion raised: report what it had not reported yet as failed."""
        self.caught(f"complete_{flight.kind}", exc)
        self._recover(f"complete_{flight.kind}", self._fail_flight, worker, flight)

    def _fail_flight(self, worker, f) -> None:
        pidx = worker._pidx
        if f.kind == "store":
            done = {s[0] for s in worker._report.stores}
            for op in f.ops:
                if op.op_id in done:
                    continue
                _invalidate(worker, op.slots)
                worker._report.stores.append((op.op_id, pidx, list(op.slots)))
                if not getattr(f, "dropped", False):
                    self.metrics.dropped_stores.inc(len(op.slots))
                    worker._add("dropped_store_chunks", len(op.slots))
                left = worker._store_ops_left.get(op.req_id, 0) - 1
                if left > 0:
                    worker._store_ops_left[op.req_id] = left
                else:
                    worker._store_ops_left.pop(op.req_id, None)
            return
        done = {s[0] for s in worker._report.loads}
        ops = [op for op in f.ops if op.op_id not in done]
        worker._fail_loads(ops, {})
        for op in ops:
            worker._report.loads.append((op.op_id, pidx, list(op.slots)))
            if op.last and op.async_load:
                worker._finished_recving.add(op.req_id)

    def finished(self, worker):
        try:
            return worker.get_finished()
        except Exception as e:
            self.caught("get_finished", e)
            for req_id in [r for r in worker._releasing if r not in worker._store_ops_left]:  # as _maybe_release
                worker._releasing.discard(req_id)
                worker._finished_sending.add(req_id)
            sending, recving = worker._finished_sending, worker._finished_recving
            worker._finished_sending, worker._finished_recving = set(), set()
            return sending or None, recving or None

    def load_errors(self, worker) -> set[int]:
        try:
            return worker.get_block_ids_with_load_errors()
        except Exception as e:  # never lose them: vLLM would take failed blocks for loaded ones
            self.caught("get_block_ids_with_load_errors", e)
            errors, worker._load_errors = worker._load_errors, set()
            return errors

    def report(self, worker):
        try:
            return worker.take_report()
        except Exception as e:  # never lose it: the scheduler would keep those slots pinned or pending
            self.caught("take_report", e)
            from tpu_offload.connector.metadata import OffloadReport

            report, worker._report = worker._report, OffloadReport(process_count=worker._report.process_count)
            return None if report.is_empty() else report

    def call(self, path: str, fn, *args, default=None):
        """Any other hook: its safe answer on an exception."""
        try:
            return fn(*args)
        except Exception as e:
            self.caught(path, e)
            return default

    # ---- scheduler half --------------------------------------------------------
    def lookup(self, sched, request, num_computed_tokens: int):
        if request.request_id in self.no_hits:
            return 0, False
        try:
            return sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as e:
            self.caught("get_num_new_matched_tokens", e)
            return 0, False  # no hit: the request computes

    def after_alloc(self, sched, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        load_async = sched._load_async.get(rid, sched.async_load)
        try:
            sched.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as e:
            self.caught("update_state_after_alloc", e)
            if num_external_tokens > 0:
                self.no_hits.add(rid)
            if num_external_tokens > 0 and rid not in sched.loads.plans:
                self._recover("update_state_after_alloc", self._failed_plan, sched, rid, blocks, load_async)

    @staticmethod
    def _failed_plan(sched, rid: str, blocks, load_async: bool) -> None:
        """vLLM counts on a load we could not plan: one that fails every block the request holds, so
        vLLM recomputes it (an asynchronous one is still reported finished)."""
        ids = list(compat.block_ids_by_group(blocks)[sched.s.full_group])
        bpc = sched.bpc
        n = max(1, -(-len(ids) // bpc))
        ids += [-1] * (n * bpc - len(ids))
        sched.loads.add(LoadPlan(rid, load_async, [b""] * n, [-1] * n, ids, [True] * n))

    def build_meta(self, sched, so) -> OffloadMetadata:
        meta = OffloadMetadata(restored_id=sched.restored_id, snapshot_id=sched.snapshot_id,
                               reset_salt=sched.reset_salt)
        before = (set(sched._store_orders), set(sched.loads.load_orders), set(sched.loads.promote_orders),
                  set(sched.loads.hbm_orders))
        try:
            return sched.build_connector_meta(so, meta)
        except Exception as e:
            self.caught("build_connector_meta", e)
            self._recover("build_connector_meta", self._salvage, sched, meta, before)
            return meta

    def _salvage(self, sched, meta: OffloadMetadata, before) -> None:
        """Keep what the step's metadata got (its orders are consistent); void orders that never made it
        into it, release finished requests' blocks (their stores not yet planned are dropped), and fail
        every load not yet sent (vLLM recomputes them): a failure that repeats every step must not keep
        a request waiting or its blocks held."""
        sent = {op.op_id for op in meta.stores}
        for op_id in set(sched._store_orders) - before[0] - sent:
            order = sched._store_orders.pop(op_id)
            settle_store(sched.manager, order, set(order.slots))
            self.metrics.dropped_stores.inc(len(order.slots))
        sent = {op.op_id for op in meta.loads}
        for op_id in set(sched.loads.load_orders) - before[1] - sent:
            sched.manager.complete_load(sched.loads.load_orders.pop(op_id).keys)
        for op_id in set(sched.loads.hbm_orders) - before[3] - sent:  # copies never sent: sources back to vLLM
            sched._unpin_hbm(sched.loads.hbm_orders.pop(op_id).items)
        sent = {op.op_id for op in meta.promotes}
        for op_id in set(sched.loads.promote_orders) - before[2] - sent:
            order = sched.loads.promote_orders.pop(op_id)
            sched.loads.promoted(order, set(order.slots))
        for rid in [r for r, st in sched._reqs.items() if st.finishing]:  # their blocks go back to vLLM now
            meta.release.append(rid)  # reported finished once their stores already sent are done
            del sched._reqs[rid]
        self.no_hits.update(sched.loads.plans)
        sched.loads.invalidate()
        sched.loads.emit(meta, 1 << 62, lambda n: None)

    def request_finished(self, sched, request, block_ids):
        self.no_hits.discard(request.request_id)
        try:
            return sched.request_finished(request, block_ids)
        except Exception as e:
            self.caught("request_finished", e)
            sched._reqs.pop(request.request_id, None)  # nothing more is stored from blocks vLLM now frees
            return False, None


def _invalidate(worker, slots) -> None:
    valid = getattr(worker.engine, "valid", None)
    if valid is None:
        return
    for s in slots:
        if 0 <= s < len(valid):
            valid[s] = False
