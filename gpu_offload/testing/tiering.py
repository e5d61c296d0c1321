"""Drive vLLM's scheduler-side ``TieringOffloadingManager`` without an engine or a GPU.

vLLM's GPU<->primary copies need CUDA tensors, so on CPU the tests and
``benchmarks/bench_vllm_tiers.py`` play the worker's part: a store writes
the chunk's bytes into the primary rows ``prepare_store`` allocated, then
calls ``complete_store`` (which cascades to every secondary tier); a load
calls ``lookup`` step by step (RETRY while a tier's async lookup runs,
HIT_PENDING while a promotion runs) until HIT or MISS, and reads the rows
``prepare_load`` names. Everything between (cascades, promotions, the
secondary tiers' jobs, back-pressure) is vLLM's own code.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Sequence

import numpy as np

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from gpu_offload.testing.hooks import offloading_config

_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_REQ = itertools.count()


def tiering_spec(tiers: list[dict], *, bytes_per_block: int, cpu_bytes: int, engine_id: str | None = None,
                 events: bool = False, **extra) -> TieringOffloadingSpec:
    """vLLM's ``TieringOffloadingSpec`` over ``tiers`` (its ``secondary_tiers``), one block per chunk."""
    cfg = offloading_config({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                             "secondary_tiers": [dict(t) for t in tiers], **extra}, bytes_per_block=bytes_per_block)
    cfg = dataclasses.replace(cfg, engine_id=engine_id or f"t{uuid.uuid4().hex[:12]}", enable_kv_cache_events=events)
    return TieringOffloadingSpec(cfg)


def new_keys(n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(np.random.bytes(32), group) for _ in range(n)]


class Engine:
    """One "engine": a spec's scheduler-side manager and its primary rows."""

    def __init__(self, spec: TieringOffloadingSpec):
        self.spec = spec
        self.manager = spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.row_bytes = view.strides[0]
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, self.row_bytes)

    @property
    def secondary(self):
        return self.manager.secondary_tiers

    def step(self) -> None:
        self.manager.on_schedule_end(_STEP)

    def settle(self, timeout: float = 60.0) -> None:
        """Step until no secondary-tier job is in flight."""
        end = time.monotonic() + timeout
        while self.manager.has_pending_work():
            if time.monotonic() > end:
                raise TimeoutError("secondary-tier jobs still in flight")
            self.step()
            time.sleep(0.0005)
        self.step()

    def store(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], settle: bool = True,
              params: dict | None = None) -> int:
        """Store chunks as the worker would (into primary rows), cascading to the secondary tiers; stored count.
        ``params``: the request's ``kv_transfer_params``; the keys are its prefix, in order."""
        ctx = ReqContext(req_id=f"s{next(_REQ)}", kv_transfer_params=params)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, i + 1)
        m = self.manager
        m.on_new_request(ctx)
        out = m.prepare_store(list(keys), ctx)
        n = 0
        if out is not None:
            by_key = dict(zip(keys, payloads))
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.rows[int(cid)][:] = by_key[key]
                n += 1
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        if settle:
            self.settle()
        return n

    def load(self, keys: Sequence[bytes], timeout: float = 60.0) -> dict[bytes, np.ndarray | None]:
        """Each key's bytes as the GPU would get them, or None on a MISS."""
        ctx = ReqContext(req_id=f"l{next(_REQ)}")
        m = self.manager
        m.on_new_request(ctx)
        got: dict[bytes, np.ndarray | None] = {}
        pending = list(keys)
        end = time.monotonic() + timeout
        while pending:
            if time.monotonic() > end:
                raise TimeoutError(f"{len(pending)} lookups unresolved")
            left = []
            for key in pending:
                r = m.lookup(key, ctx)
                if r is LookupResult.HIT:
                    spec = m.prepare_load([key], ctx)
                    got[key] = self.rows[int(spec.chunk_ids[0])].copy()
                    m.complete_load([key], ctx)
                elif r is LookupResult.MISS:
                    got[key] = None
                else:
                    left.append(key)
            pending = left
            self.step()
            if pending:
                time.sleep(0.0005)
        m.on_request_finished(ctx)
        self.settle()
        return got

    def drop_primary(self) -> None:
        """Empty the CPU primary tier (vLLM's ``reset_cache``): later hits must come from a secondary tier."""
        self.manager.reset_cache()

    def close(self) -> None:
        self.rows = None  # a view of the primary buffer: vLLM cannot close it while one is held
        self.manager.shutdown()
