"""SlotAllocator and HostChunkPool: no slot handed out twice, page-aligned rows, bounded memory."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tpu_offload.core.pool import PAGE, HostChunkPool
from tpu_offload.core.slots import SlotAllocator


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 12))
    def init(self, n):
        self.alloc = SlotAllocator(n)
        self.n = n
        self.held: set[int] = set()

    @rule(k=st.integers(0, 14))
    def allocate(self, k):
        if k > self.n - len(self.held):
            with pytest.raises(MemoryError):
                self.alloc.allocate(k)
            return
        got = self.alloc.allocate(k)
        assert got.dtype == np.int64 and len(got) == k
        got = [int(s) for s in got]
        assert len(set(got)) == k and self.held.isdisjoint(got), "a slot was handed out twice"
        assert all(0 <= s < self.n for s in got)
        self.held.update(got)

    @rule()
    def allocate_one(self):
        if len(self.held) == self.n:
            with pytest.raises(MemoryError):
                self.alloc.allocate_one()
            return
        s = self.alloc.allocate_one()
        assert isinstance(s, int) and s not in self.held and 0 <= s < self.n
        self.held.add(s)

    @rule(data=st.data())
    def free(self, data):
        if not self.held:
            return
        s = data.draw(st.sampled_from(sorted(self.held)))
        self.alloc.free(np.int64(s) if data.draw(st.booleans()) else s)
        self.held.discard(s)

    @rule(s=st.integers(-2, 14))
    def bad_free(self, s):
        if s in self.held:
            return
        before = self.alloc.free_count
        with pytest.raises(ValueError):  # double free, never handed out, or out of range
            self.alloc.free(s)
        assert self.alloc.free_count == before

    @rule()
    def reset(self):
        self.alloc.reset()
        self.held.clear()

    @invariant()
    def counts(self):
        assert self.alloc.free_count == self.n - len(self.held)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_first_slots_in_order():
    a = SlotAllocator(5)
    assert a.allocate(3).tolist() == [0, 1, 2]
    assert a.allocate_one() == 3
    with pytest.raises(ValueError):
        SlotAllocator(0)


@settings(max_examples=40, deadline=None)
@given(num_slots=st.integers(1, 9), chunk_bytes=st.integers(1, 3 * PAGE + 17))
def test_pool_rows_page_aligned_and_disjoint(num_slots, chunk_bytes):
    pool = HostChunkPool(num_slots, chunk_bytes)
    assert pool.stride % PAGE == 0 and chunk_bytes <= pool.stride < chunk_bytes + PAGE
    assert pool.slab.ctypes.data % PAGE == 0
    assert pool.nbytes == num_slots * pool.stride
    for s in range(num_slots):
        row = pool.row(s)
        assert row.shape == (chunk_bytes,) and row.dtype == np.uint8
        assert row.ctypes.data % PAGE == 0
        row[:] = s + 1  # write every row; no row may overlap another
    for s in range(num_slots):
        assert (pool.row(s) == s + 1).all()
    got = pool.rows(np.arange(num_slots)[::-1])
    assert got.shape == (num_slots, chunk_bytes) and (got[:, 0] == np.arange(num_slots, 0, -1)).all()
    assert pool.valid.dtype == bool and pool.valid.shape == (num_slots,) and not pool.valid.any()


def test_pool_zero_and_errors():
    assert not HostChunkPool(3, 100, zero=True).slab.any()
    for bad in ((0, 10), (3, 0), (-1, 10)):
        with pytest.raises(ValueError):
            HostChunkPool(*bad)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 64 * PAGE), chunk_bytes=st.integers(1, 5 * PAGE))
def test_from_budget_bound(budget, chunk_bytes):
    stride = -(-chunk_bytes // PAGE) * PAGE
    if budget < stride:
        with pytest.raises(ValueError, match="holds no chunk"):
            HostChunkPool.from_budget(budget, chunk_bytes)
        return
    pool = HostChunkPool.from_budget(budget, chunk_bytes)
    assert pool.nbytes <= budget < pool.nbytes + pool.stride, "as many slots as fit, padding counted"
    assert pool.num_slots == budget // stride
