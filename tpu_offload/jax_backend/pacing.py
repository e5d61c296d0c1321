"""Host copies in pieces, after the forward, within bytes in flight and a byte budget per step.

TPU7x runs a TensorCore's DMAs and program launches through one in-order queue (google/tpu-sync): a
forward queued behind 1 GiB of host copies waits ~19 ms, behind 16 MiB ~0.5 ms. The engine hands
each store or load to a ``Pacer`` as pieces; the worker pumps it after the step's forward.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np


class StagingBusy(RuntimeError):
    """Paced transfers still hold the staging chunks a new one needs: it is refused, nothing dispatched."""


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
    """Host copies in pieces, few in flight, a byte budget per step and direction (config: transfer pacing).

    TPU7x runs a TensorCore's DMAs and program launches through one in-order queue, so the forward waits
    for every copy queued before it. Each store/load is cut into pieces of at most ``piece_bytes``
    (per device); ``pump`` (called after the step's forward is dispatched) sends pieces in order while
    the bytes dispatched and not landed stay within ``inflight_bytes`` and this step's direction budget
    (``step_bytes``); the rest waits for a later step. Nothing here waits. ``log`` records every dispatch
    (kind, bytes, bytes in flight after it) for tests and figures."""

    def __init__(self, piece_bytes: int, inflight_bytes: int, step_bytes: int, log_size: int = 4096):
        self.piece_bytes = max(1, int(piece_bytes))
        self.inflight_bytes = max(1, int(inflight_bytes))
        self.step_bytes = max(1, int(step_bytes))
        self.queue: list[_Piece] = []
        self.flying: list[_Piece] = []
        self.sent = {"store": 0, "load": 0}  # this step's bytes per direction
        self.log: list[tuple] = []
        self._log_size = log_size
        self.on_land: Callable[[_Piece], None] | None = None
        self.on_send: Callable[[_Piece], None] | None = None  # a recorder (tests)

    @property
    def in_flight(self) -> int:
        return sum(p.nbytes for p in self.flying)

    def new_step(self) -> None:
        self.sent = {"store": 0, "load": 0}

    def poll(self) -> None:
        still = []
        for p in self.flying:
            if p.done is None or p.done.is_ready():
                if self.on_land is not None:
                    self.on_land(p)
            else:
                still.append(p)
        self.flying = still

    def pump(self, force: bool = False, only: Paced | None = None) -> int:
        """Dispatch queued pieces within the bounds. ``force``: the next one regardless, after waiting
        for what flies (a caller that must wait: shutdown, a slot about to be overwritten). ``only``:
        every piece of that transfer now, unbounded (a load the next forward needs). Returns the
        pieces dispatched."""
        self.poll()
        if only is not None:
            mine = [p for p in self.queue if p.owner is only]
            self.queue = [p for p in self.queue if p.owner is not only]
            for p in mine:
                self._send(p)
            return len(mine)
        n = 0
        while self.queue:
            p = self.queue[0]
            if not force:
                direction = "load" if p.kind == "scatter" else p.kind
                if self.flying and self.in_flight + p.nbytes > self.inflight_bytes:
                    break
                if self.sent[direction] and self.sent[direction] + p.nbytes > self.step_bytes:
                    break
            else:
                for q in self.flying:
                    if q.done is not None:
                        q.done.block_until_ready()
                self.poll()
            self.queue.pop(0)
            self._send(p)
            n += 1
            if force:
                break
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
        self.sent["load" if p.kind == "scatter" else p.kind] += p.nbytes
        if len(self.log) < self._log_size:
            self.log.append((p.kind, p.nbytes, self.in_flight))
        if self.on_send is not None:
            self.on_send(p)
