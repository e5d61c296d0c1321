"""Paced transfers inside the real tpu-inference engine (TP 1): the dispatch order, recorded.

Settings small enough for the tiny model that a store of the workload's blocks needs several pieces
and several steps (the per-step budget binds). Recorded per step: the connector's bind, the forward
(``runner.model_fn``), every gather and every piece sent to the link. Asserts: no piece exceeds
``transfer_piece_bytes``; no step sends more than its budget per direction (a step's first piece always
goes); every gather and piece follows its step's forward; and the tokens equal the no-connector
baseline, stored and then loaded back.
"""

from __future__ import annotations

import pytest

from tpu_offload.testing.engine_run import kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, SETUPS, delta, hit_tokens, settle, totals, wrk
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine
KIB = 1 << 10
PACING = dict(transfer_pacing="on", transfer_piece_bytes=256 * KIB, transfer_bandwidth_gbps=0.02,
              transfer_stall_ms=20, devices_per_chip=1)  # 400 KB per step and direction


class Recorder:
    def __init__(self, run):
        self.events: list[tuple] = []
        w, runner = wrk(run), run.runner
        conn = run.worker_connector
        self._undo = []

        def wrap(obj, name, make):
            orig = getattr(obj, name)
            setattr(obj, name, make(orig))
            self._undo.append((obj, name, orig))

        wrap(conn, "bind_connector_metadata", lambda f: lambda *a, **k: (self.events.append(("bind",)), f(*a, **k))[1])
        wrap(runner, "model_fn", lambda f: lambda *a, **k: (self.events.append(("forward",)), f(*a, **k))[1])
        wrap(w.engine, "_store_paced", lambda f: lambda *a, **k: (self.events.append(("gather",)), f(*a, **k))[1])
        def piece(p):
            self.events.append(("piece", p.kind, p.nbytes))

        w.pacer.on_send.append(piece)
        self._remove = lambda: w.pacer.on_send.remove(piece)

    def close(self):
        self._remove()
        for obj, name, orig in reversed(self._undo):
            setattr(obj, name, orig)


@pytest.fixture(scope="module")
def paced(engines):
    setup = SETUPS["tp1-bf16-bs16"]
    w = ROUNDTRIP[setup.block_size]
    base = engines.baseline(setup, w)
    run = engines.get(("ours-paced", setup), setup, kv_transfer_config("offload.json", **OURS, **PACING))
    return setup, w, base, run


def test_pieces_follow_the_forward_within_their_bounds(paced):
    setup, w, base, run = paced
    worker = wrk(run)
    block = worker.engine.layout.device_block_bytes()
    assert worker.pacer is not None and block <= PACING["transfer_piece_bytes"], block  # a chunk fits a piece
    rec = Recorder(run)
    try:
        t0 = totals(run)
        assert w.run(run) == base
        settle(run)
        t1 = totals(run)
        run.reset_prefix_cache()
        assert w.run(run) == base  # loaded back from our tier, paced the same way
        settle(run)
        t2 = totals(run)
    finally:
        rec.close()
    stored = sum(len(p) // setup.block_size for p in w.prompts)
    assert delta(t1, t0, "stored_chunks") == stored
    assert delta(t2, t1, "hit_tokens") == sum(hit_tokens(len(p), setup.block_size) for p in w.prompts)
    assert delta(t2, t1, "load_errors") == 0

    ev = rec.events
    pieces = [e for e in ev if e[0] == "piece"]
    kinds = {e[1] for e in pieces}
    assert {"store", "load", "scatter"} <= kinds, kinds
    assert all(e[2] <= PACING["transfer_piece_bytes"] for e in pieces)  # no piece exceeds the setting
    assert worker.pacer.step_bytes == worker.s.step_budget_bytes == 400_000  # the scheduler's figure
    assert max(e[2] for e in pieces) > block  # pieces of several chunks: the setting, not one per chunk
    # the store needed several steps: the bounds deferred pieces to later steps rather than waiting
    # Per step (bind to bind): no forward after any transfer, i.e. every transfer follows the step's
    # forward (a step without a forward, while requests wait for their loads, has none to stall)
    steps, step = [], []
    for e in ev:
        if e[0] == "bind" and step:
            steps.append(step)
            step = []
        step.append(e)
    steps.append(step)
    for st in steps:
        moved = [i for i, e in enumerate(st) if e[0] in ("gather", "piece")]
        forwards = [i for i, e in enumerate(st) if e[0] == "forward"]
        assert not moved or not forwards or min(moved) > max(forwards), st
        for d in ("store", "load"):  # within the step's budget per direction (its first piece always goes)
            sent = [e[2] for e in st if e[:2] == ("piece", d) and e[2]]  # (a scatter moves no link bytes)
            assert len(sent) <= 1 or sum(sent) <= worker.pacer.step_bytes, (d, sent)
    assert sum(any(e[:2] == ("piece", "store") for e in st) for st in steps) >= 2, ev  # spread over steps
    assert any(e[0] == "forward" for e in ev) and sum(e[0] == "bind" for e in ev) == len(steps)
    assert sum(e[2] for e in pieces if e[1] == "store") == stored * block
