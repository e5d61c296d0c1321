"""Paced host copies (pacing.Pacer): pieces of at most ``piece_bytes`` per device, a byte budget per step
and direction; the rest waits for a later pump, nothing waits, and nothing is refused. Bytes still arrive
bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from test_tpu_roundtrip import bits, make_caches
from tpu_offload.jax_backend import KVLayout, LoadChunk, StoreChunk, TransferEngine
from tpu_offload.jax_backend.pacing import Pacer

pytestmark = pytest.mark.jax


def engine(piece_blocks: int, step_blocks: int = 10**6, staging: int = 16):
    mesh = make_mesh("auto", (1, 8))
    caches = make_caches(mesh, jnp.bfloat16, seed=5, layers=2)
    eng = TransferEngine(KVLayout.from_caches(caches), num_slots=32, blocks_per_chunk=1, staging_blocks=staging)
    b = eng.layout.device_block_bytes()
    pacer = Pacer(piece_blocks * b, step_blocks * b)
    eng.pace(pacer)
    return eng, caches, pacer, b


def drain(pacer, owner, steps=1000):
    """Pump step after step (as the worker does after each forward) until ``owner`` has landed."""
    for _ in range(steps):
        pacer.new_step()
        pacer.pump()
        for p in pacer.flying:
            if p.done is not None:
                p.done.block_until_ready()  # the device finishing its copies between two steps
        pacer.poll()
        if owner.is_ready():
            return
    raise AssertionError("never landed")


def test_pieces_and_bytes():
    eng, caches, pacer, b = engine(piece_blocks=2, step_blocks=4)
    ref = [bits(c) for c in caches]
    src = [3, 9, 4, 17, 30, 31, 2, 11, 12]
    st = eng.store(caches, [StoreChunk(i, [x]) for i, x in enumerate(src)])
    assert not st.is_ready() and pacer.log == []  # the gather ran; the host copies wait for a pump
    drain(pacer, st)
    eng.complete_store(range(len(src)), True)
    stores = [e for e in pacer.log if e[0] == "store"]
    assert len(stores) == 5 and all(n <= 2 * b for _, n, _ in stores)  # 9 chunks in pieces of <= 2
    state = {"caches": caches}
    ld = eng.load_paced([LoadChunk(i, [39 - i]) for i in range(len(src))], lambda: state["caches"],
                        lambda c: state.update(caches=c))
    drain(pacer, ld)
    got = [bits(c) for c in state["caches"]]
    for layer in range(len(ref)):
        for i, x in enumerate(src):
            assert np.array_equal(got[layer][39 - i], ref[layer][x]), (layer, i)
    kinds = [k for k, *_ in pacer.log]
    assert kinds[-1] == "scatter" and kinds.count("load") == 5  # the scatter after the last copy from host
    assert all(n <= 2 * b for _, n, _ in pacer.log)
    assert not eng._busy.any()  # every staging chunk free again


def test_step_budget_defers_to_later_steps_whatever_has_landed():
    """Bytes and steps decide, never local readiness: nothing landed, the next step still sends its budget."""
    eng, caches, pacer, b = engine(piece_blocks=1, step_blocks=3, staging=8)
    st = eng.store(caches, [StoreChunk(i, [i]) for i in range(6)])
    pacer.new_step()
    assert pacer.pump() == 3  # this step's budget: 3 blocks; the rest waits, nothing blocks
    pacer.poll = lambda: None  # as if nothing had landed
    pacer.new_step()
    assert pacer.pump() == 3
    drain(pacer, st)
    assert [k for k, *_ in pacer.log] == ["store"] * 6


def test_directions_have_their_own_budget():
    """A store that meets its budget does not hold back a load queued behind it."""
    eng, caches, pacer, b = engine(piece_blocks=1, step_blocks=2, staging=8)
    eng.store(caches, [StoreChunk(i, [i]) for i in range(4)])
    state = {"caches": caches}
    eng.load_paced([LoadChunk(i, [20 + i]) for i in range(2)], lambda: state["caches"],
                   lambda c: state.update(caches=c))
    pacer.new_step()
    pacer.pump()
    assert [k for k, *_ in pacer.log] == ["store", "store", "load", "load", "scatter"]


def test_short_staging_sends_what_holds_it_never_refuses():
    """More handed over than staging holds (what the scheduler's admission prevents): the queued pieces that
    hold staging go out now, counted; the new store is taken, nothing is refused or dropped."""
    eng, caches, pacer, b = engine(piece_blocks=1, step_blocks=3, staging=8)
    ref = [bits(c) for c in caches]
    first = eng.store(caches, [StoreChunk(i, [i]) for i in range(6)])
    pacer.new_step()
    assert pacer.pump() == 3  # 3 sent (their staging chunks free again), 3 queued still hold theirs
    second = eng.store(caches, [StoreChunk(10 + i, [20 + i]) for i in range(6)])  # needs 6 of 5 free
    assert eng.staging_overdrawn == 3
    drain(pacer, first)
    drain(pacer, second)
    eng.complete_store(list(range(6)) + list(range(10, 16)), True)
    state = {"caches": caches}
    ld = eng.load_paced([LoadChunk(10 + i, [30 + i]) for i in range(6)], lambda: state["caches"],
                        lambda c: state.update(caches=c))
    drain(pacer, ld)
    got = [bits(c) for c in state["caches"]]
    for layer in range(len(ref)):
        for i in range(6):
            assert np.array_equal(got[layer][30 + i], ref[layer][20 + i]), (layer, i)


def test_a_claim_that_sends_a_queued_scatter_hands_back_its_caches():
    """A load whose claim finds staging short sends the queued load's scatter, which replaces the caches:
    the caller gets those, never the donated ones."""
    eng, caches, pacer, b = engine(piece_blocks=1, staging=8)
    ref = [bits(c) for c in caches]
    st = eng.store(caches, [StoreChunk(i, [i]) for i in range(8)])
    drain(pacer, st)
    eng.complete_store(range(8), True)
    state = {"caches": caches}
    cur, back = (lambda: state["caches"]), (lambda c: state.update(caches=c))
    state["caches"], first = eng.load(cur(), [LoadChunk(i, [20 + i]) for i in range(5)], on_pass=back, current=cur)
    second_chunks = [LoadChunk(5 + i, [30 + i]) for i in range(3)] + [LoadChunk(0, [35]), LoadChunk(1, [36])]
    state["caches"], second = eng.load(cur(), second_chunks, on_pass=back, current=cur)  # 5 of 3 free
    assert eng.staging_overdrawn > 0 and first.left == 0  # the first load went out whole, past the budget
    assert not any(c.is_deleted() for c in state["caches"])
    drain(pacer, second)
    got = [bits(c) for c in state["caches"]]
    for layer in range(len(ref)):
        for c in [LoadChunk(i, [20 + i]) for i in range(5)] + second_chunks:
            assert np.array_equal(got[layer][c.blocks[0]], ref[layer][c.slot]), (layer, c)
