"""Host copies in pieces, after the forward, within a byte budget per step and direction.

TPU7x runs a TensorCore's DMAs and program launches through one in-order queue (google/tpu-sync): a
forward queued behind 1 GiB of host copies waits ~19 ms, behind 16 MiB ~0.5 ms. The engine hands
each store or load to a ``Pacer`` as pieces; the worker pumps it after the step's forward, and it
sends up to the step's budget (core/step_budget.py), the same bytes the scheduler admits per step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np


class Paced:
    """A store or load whose host copies go out in pieces (``Pacer``): ready once every piece was
    dispatched and has landed. ``block_until_ready`` dispatches what is left first (shutdown, a slot
    about to be overwritten): the only place a paced transfer is waited for."""

    def __init__(self, pacer: "Pacer"):
        self.pacer = pacer
        self.left = 0  # pieces not dispatched yet
        self.dones: list = []
        self.failed = False

    def is_ready(self) -> bool:
        return self.left == 0 and all(d.is_ready() for d in self.dones)

    def block_until_ready(self):
        while self.left:
            self.pacer.pump(force=True)
        for d in self.dones:
            d.block_until_ready()
        if self.failed:
            raise RuntimeError("a piece of this transfer failed to dispatch")
        return self


@dataclasses.dataclass
class _Piece:
    kind: str  # "store" | "load" (host copies) | "scatter" (staging -> caches, no link bytes)
    nbytes: int  # per device, over the host link
    run: Callable[[], object]  # dispatches; returns its done array
    owner: Paced
    free: np.ndarray  # staging chunks this piece frees once landed
    done: object = None


class Pacer:
    """Host copies in pieces, a byte budget per step and direction (config: the per-step budget).

    TPU7x runs a TensorCore's DMAs and program launches through one in-order queue, so the forward waits
    for every copy queued before it. Each store/load is cut into pieces of at most ``piece_bytes``
    (per device); ``pump`` (called after the step's forward is dispatched) sends queued pieces in order
    while this step's bytes in their direction stay within ``step_bytes`` (the first piece of a step always
    goes). A direction that meets its budget stops there (its later pieces keep their order); the other goes
    on. The decision depends only on bytes and steps, never on what has landed, so every process that is
    given the same transfers sends the same pieces. Nothing here waits. ``log`` records every dispatch
    (kind, bytes, bytes sent and not yet seen landed after it) for tests and figures.

    A piece's staging chunks are free once it is sent (``on_send``): JAX orders a later program that
    writes staging after every dispatched one that reads it."""

    def __init__(self, piece_bytes: int, step_bytes: int, log_size: int = 4096):
        self.piece_bytes = max(1, int(piece_bytes))
        self.step_bytes = max(1, int(step_bytes))
        self.queue: list[_Piece] = []
        self.flying: list[_Piece] = []
        self.sent = {"store": 0, "load": 0}  # this step's bytes per direction
        self.log: list[tuple] = []
        self._log_size = log_size
        self.on_send: list[Callable[[_Piece], None]] = []  # the engine (staging), recorders (tests)

    @property
    def in_flight(self) -> int:
        return sum(p.nbytes for p in self.flying)

    def new_step(self) -> None:
        self.sent = {"store": 0, "load": 0}

    def poll(self) -> None:
        """Forget pieces that have landed (``in_flight``, the log's figure; no dispatch depends on it)."""
        self.flying = [p for p in self.flying if p.done is not None and not p.done.is_ready()]

    def pump(self, force: bool = False, only: Paced | None = None) -> int:
        """Dispatch queued pieces within this step's budgets. ``force``: the next one regardless, after
        waiting for what flies (a caller that must wait: shutdown, a slot about to be overwritten).
        ``only``: every piece of that transfer now, unbounded (a load the next forward needs). Returns
        the pieces dispatched."""
        self.poll()
        if only is not None:
            mine = [p for p in self.queue if p.owner is only]
            self.queue = [p for p in self.queue if p.owner is not only]
            for p in mine:
                self._send(p)
            return len(mine)
        if force:
            if not self.queue:
                return 0
            for q in self.flying:
                if q.done is not None:
                    q.done.block_until_ready()
            self.poll()
            self._send(self.queue.pop(0))
            return 1
        n, stopped, keep = 0, set(), []
        for p in self.queue:
            d = _direction(p)
            if d in stopped or (self.sent[d] and self.sent[d] + p.nbytes > self.step_bytes):
                stopped.add(d)
                keep.append(p)
                continue
            self._send(p)
            n += 1
        self.queue = keep
        return n

    def send_all(self) -> int:
        """Every queued piece now, past the budget (the engine, when staging is short: see ``_claim``)."""
        n = len(self.queue)
        queue, self.queue = self.queue, []
        for p in queue:
            self._send(p)
        return n

    def _send(self, p: _Piece) -> None:
        try:
            p.done = p.run()
        except Exception:
            logging.getLogger(__name__).exception("tpu_offload: a %s piece failed to dispatch", p.kind)
            p.owner.failed = True
            p.done = None
        p.owner.left -= 1
        if p.done is not None:
            p.owner.dones.append(p.done)
        self.flying.append(p)
        self.sent[_direction(p)] += p.nbytes
        if len(self.log) < self._log_size:
            self.log.append((p.kind, p.nbytes, self.in_flight))
        for f in self.on_send:
            f(p)


def _direction(p: _Piece) -> str:
    return "load" if p.kind == "scatter" else p.kind
