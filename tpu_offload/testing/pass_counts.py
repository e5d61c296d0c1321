"""What one pass of B blocks dispatches, how many steps it spans, and how often the step thread waits, per
host path: the counting ``benchmarks/bench_tpu_aot.py`` prints and ``tests/tpu_compiler`` checks.

A compiled program's figures (scratch, bytes accessed) say nothing about how many of them a pass launches,
nor about the runtime transfers and blocking waits around them; those are counted here, per pass and
direction, for:

* ours, each path as the engine plans it. The per-step budget (``core/step_budget.py``) cuts a pass into
  per-step parts (the scheduler admits at most ``step_blocks`` blocks per step and direction); each part
  is handed to the engine, whose own planning code says what it launches: the direct kernel one call per
  (layer group, slab) a part touches (``TransferEngine._direct_calls``); the staging path one gather (or
  scatter) per part plus, per pacer piece (``TransferEngine._pieces``), one host-copy program per slab the
  piece touches (``TransferEngine._by_slab``). The block-id operands travel with the call that takes them
  (numpy arguments of one compiled call), so they are not separate dispatches. Nothing waits on the step
  thread: a pass returns done arrays that are polled.
* tpu-inference 0.32's ``TPUOffloadConnector``, as its worker runs (``tpu_inference/offload/``):

  - save, ``tpu_offload_connector.py:TPUOffloadConnectorWorker.start_save_kv`` (and ``_start_batched_save_kv``):
    ``_bucketed_stack_kv_caches`` runs one ``stack_kv_cache_cross_layers`` program per bucket of
    ``_decompose_into_buckets`` (greedy over ``TPU_OFFLOAD_BLOCK_SIZE_BUCKETS``, 1..64), each after a
    ``jnp.array`` of its block ids (one host-to-device transfer per bucket; one in all when B is itself a
    bucket); then one ``jax.device_put`` per block (per layer group) to host, on the step thread. Its
    ``jax.block_until_ready`` runs in the save executor's thread (``_transfer_and_register_cpu_chunks``),
    not the step thread's.
  - load, ``TPUOffloadConnectorWorker.start_load_kv``: one ``jax.device_put`` per block to HBM, then
    ``jax.block_until_ready`` on them (step thread); per bucket (``_bucketed_update_kv_caches``)
    ``utils.update_kv_caches_one``: ``pre_update_kv_caches`` builds four index arrays (``jnp.arange`` and
    ``jnp.ones``: two programs; two ``jnp.array``: two transfers) and ``jax.device_put``-s each to the
    replicated sharding (four transfers), then the ``update_kv_caches`` program; finally
    ``jax.block_until_ready(self.runner.kv_caches)`` (step thread). Under DP attention
    (``pure_jax_update_kv_caches_one``, one jitted program) the index work is inside the program.
  - no per-step budget: a pass goes out in the step that schedules it (its staging buffer caps what its
    scheduler admits, not the bytes per step).
* the floor: one contiguous copy, one program, one step, no wait.

Imports JAX and the engine's planning code (no vLLM).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Sequence

import numpy as np

from tpu_offload.core import step_budget
from tpu_offload.jax_backend.engine import LoadChunk, StoreChunk, TransferEngine

THEIR_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tpu-inference 0.32's TPU_OFFLOAD_BLOCK_SIZE_BUCKETS default


@dataclasses.dataclass(frozen=True)
class PassCount:
    """One pass, one direction, one path."""

    programs: int  # compiled programs launched
    transfers: int  # runtime transfers outside any program (device_put, jnp.array)
    steps: int  # engine steps the pass spans under its per-step budget
    waits: int  # blocking waits on the step thread
    pieces: int  # parts it is dispatched in (ours: per-step parts; tpu-inference: buckets)

    @property
    def dispatches(self) -> int:
        return self.programs + self.transfers

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), dispatches=self.dispatches)


def their_buckets(n: int) -> list[int]:
    """tpu-inference's ``_decompose_into_buckets``: greedy, largest bucket first (1,000 = 15 x 64 + 32 + 8)."""
    out = []
    for b in sorted(THEIR_BUCKETS, reverse=True):
        while n >= b:
            out.append(b)
            n -= b
    return out


def theirs(n: int, direction: str, *, layer_groups: int = 1, attn_dp: bool = False) -> PassCount:
    """tpu-inference 0.32's ``TPUOffloadConnector`` moving ``n`` blocks (see the module docstring)."""
    parts = their_buckets(n)
    per_block = n * layer_groups  # one device_put per block (a list of them per block with layer groups)
    if direction == "store":
        ids = 1 if n in THEIR_BUCKETS else len(parts)
        return PassCount(programs=len(parts), transfers=ids + per_block, steps=1, waits=0, pieces=len(parts))
    if attn_dp:
        return PassCount(programs=len(parts), transfers=per_block, steps=1, waits=2, pieces=len(parts))
    return PassCount(programs=3 * len(parts), transfers=per_block + 6 * len(parts), steps=1, waits=2,
                     pieces=len(parts))


def floor() -> PassCount:
    """One contiguous copy of the pass: one program, no transfer, no wait."""
    return PassCount(programs=1, transfers=0, steps=1, waits=0, pieces=1)


def pass_chunks(direction: str, n: int, kind: str, *, num_slots: int, num_blocks: int, bpc: int = 1) -> list:
    """The chunks of a pass of ``n`` blocks: ``adjacent``, consecutive cache blocks into consecutive slots from
    slot 0; ``scattered``, every other cache block into slots spread evenly over the whole tier (so the
    pass touches as many slabs as it can)."""
    chunks = -(-n // bpc)
    if kind == "adjacent":
        blocks, slots = np.arange(chunks * bpc), np.arange(chunks)
    elif kind == "scattered":
        blocks = (np.arange(chunks * bpc) * 2) % num_blocks
        slots = (np.arange(chunks) * max(1, num_slots // chunks)) % num_slots
    else:
        raise ValueError(f"pass kind {kind!r}: expected 'adjacent' or 'scattered'")
    make = StoreChunk if direction == "store" else LoadChunk
    return [make(int(s), [int(b) for b in blocks[i * bpc:(i + 1) * bpc]]) for i, s in enumerate(slots)]


class Ours:
    """Our engine's planning code for one deployment, nothing allocated: a ``TransferEngine`` with only what
    its planning methods read (``_direct_calls``, ``_by_slab``, ``_pieces``)."""

    def __init__(self, plan, *, num_slots: int, blocks_per_chunk: int, step_budget_bytes: int,
                 piece_bytes: int, direct=None):
        e = object.__new__(TransferEngine)
        e.layout, e.bpc, e.num_slots = plan.programs.layout, blocks_per_chunk, num_slots
        e.programs, e.rows_per_slab, e.direct = plan.programs, plan.rows_per_slab, direct
        e.staging_blocks = plan.staging_blocks
        e.staging_chunks = plan.staging_blocks // blocks_per_chunk
        e.pacer = types.SimpleNamespace(piece_bytes=piece_bytes)
        self.engine = e
        self.num_slots = num_slots
        self.bpc = blocks_per_chunk
        # the scheduler's per-step budget in blocks (connector/settings.py: the same call)
        self.step_blocks = step_budget.blocks(step_budget_bytes, e.layout.device_block_bytes(), blocks_per_chunk,
                                              plan.staging_blocks)

    def chunks(self, direction: str, n: int, kind: str) -> list:
        return pass_chunks(direction, n, kind, num_slots=self.num_slots, num_blocks=self.engine.layout.num_blocks,
                           bpc=self.bpc)

    def steps(self, chunks: Sequence) -> list[list]:
        """The per-step parts the scheduler admits: at most ``step_blocks`` blocks each, in order."""
        per = max(1, self.step_blocks // self.bpc)
        return [list(chunks[i:i + per]) for i in range(0, len(chunks), per)]

    def direct_calls(self, part: Sequence) -> list:
        """The direct kernel's calls for one step's part: (group, slab, blocks, rows, cols) each."""
        return list(self.engine._direct_calls(part))

    def direct(self, direction: str, n: int, kind: str) -> PassCount:
        steps = self.steps(self.chunks(direction, n, kind))
        calls = sum(len(self.direct_calls(p)) for p in steps)
        return PassCount(programs=calls, transfers=0, steps=len(steps), waits=0, pieces=len(steps))

    def staging(self, direction: str, n: int, kind: str, paced: bool = True) -> PassCount:
        """The staging (``program``) path: per step's part, one gather (store) or scatter (load), and per pacer
        piece one host-copy program per slab it touches (``paced=False``, as under attention DP or several
        processes: one host-copy program per slab the part touches)."""
        e = self.engine
        steps = self.steps(self.chunks(direction, n, kind))
        programs = pieces = 0
        for part in steps:
            for sub in [part[i:i + e.staging_chunks] for i in range(0, len(part), e.staging_chunks)]:
                programs += 1  # the gather or the scatter of this pass through staging
                for sl in (e._pieces(sub) if paced else [slice(None)]):
                    pieces += 1
                    programs += len(e._by_slab([c.slot for c in sub[sl]]))
        return PassCount(programs=programs, transfers=0, steps=len(steps), waits=0, pieces=pieces)
