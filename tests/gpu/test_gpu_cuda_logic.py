"""The CUDA path's logic, on CPU: no GPU is needed for any of these.

* The index-upload pool never makes the engine thread wait: with every
  buffer still in flight (5+ requests storing in one step) it grows.
* Copies never straddle the host slab's 64 GiB registration pieces.
* A failed ``cudaHostRegister`` clears the CUDA error it leaves behind, and
  says so in one warning and a gauge (``tpu_offload_host_tier_pinned``).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from gpu_offload.torch_backend import cuda_lane, cuda_rt
from gpu_offload.torch_backend.engine import HostTransferEngine
from gpu_offload.torch_backend.plan import piece_spans


class Entry(list):
    """(host buffer, device buffer, busy flag) like the CUDA pool's entries."""

    def __init__(self, capacity: int):
        super().__init__([torch.empty(capacity, dtype=torch.int64), None, [True]])


def pool(initial=4):
    made = []

    def alloc(capacity):
        made.append(Entry(capacity))
        return made[-1]

    return cuda_lane.UploadPool(alloc, lambda e: not e[2][0], capacity=8, initial=initial), made


def test_upload_pool_grows_instead_of_waiting_when_every_buffer_is_in_flight():
    p, made = pool()
    for e in made:
        e[2][0] = False  # the four initial uploads finished
    got = []
    for _ in range(6):  # six stores in one step, none of their uploads finished yet
        got.append(p.acquire(8))
        got[-1][2][0] = True  # the upload is queued: busy until its event completes
    assert len(set(map(id, got))) == 6 and len(p.entries) == 6 and p.grown == 2
    got[0][2][0] = False  # one upload finished: it is reused, nothing new is made
    assert p.acquire(4) is got[0] and len(made) == 6


def test_upload_pool_replaces_a_free_buffer_that_is_too_small():
    p, made = pool(initial=1)
    made[0][2][0] = False
    big = p.acquire(100)
    assert entry_len(big) == 100 and [id(e) for e in p.entries] == [id(big)]


def test_upload_pool_replaces_a_too_small_buffer_that_is_not_the_first():
    """A larger upload (the fused gather's plans are larger) replaces the free entry it found, wherever it
    sits: removing it by equality compared the other entries' tensors and failed the transfer."""
    p, made = pool(initial=3)
    made[1][2][0] = False  # the second buffer's upload finished; the others are in flight
    big = p.acquire(100)
    assert entry_len(big) == 100
    assert [id(e) for e in p.entries] == [id(made[2]), id(made[0]), id(big)]


def entry_len(e) -> int:
    return e[0].numel()


@pytest.mark.parametrize("start, n, piece, want", [
    (0, 10, None, [(0, 10)]),
    (0, 6, 3, [(0, 3), (3, 3)]),
    (2, 5, 3, [(0, 1), (1, 3), (4, 1)]),
    (3, 3, 3, [(0, 3)]),
    (5, 0, 3, []),
])
def test_piece_spans_cut_at_multiples_of_the_piece(start, n, piece, want):
    assert list(piece_spans(start, n, piece)) == want


def test_staged_copies_never_straddle_registration_pieces_and_stay_bit_exact():
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-128, 128, (40, 4096), dtype=torch.int8, generator=g)
    orig = t.clone()
    w = HostTransferEngine([t], [4096], [(0,)], 16, 1, strategy="staged", staging_blocks=16, piece_rows=3)
    w._store_lane.copier.row_copies = []
    spec = types.SimpleNamespace(block_ids=np.arange(10, dtype=np.int32), group_sizes=[10], block_indices=[0])
    slots = types.SimpleNamespace(block_ids=np.arange(1, 11, dtype=np.int32))  # rows 1..10: crosses 3, 6, 9
    w.submit_store(1, spec, slots)
    w.get_finished()
    copies = w._store_lane.copier.row_copies
    assert sum(n for _, n in copies) == 10
    assert all(s // 3 == (s + n - 1) // 3 for s, n in copies), copies
    t.zero_()
    dst = types.SimpleNamespace(block_ids=np.arange(20, 30, dtype=np.int32), group_sizes=[10], block_indices=[0])
    w.submit_load(2, slots, dst)
    w.get_finished()
    assert torch.equal(t[20:30], orig[0:10])
    w.shutdown()


class FakeRuntime:
    def __init__(self, fail_at: int):
        self.calls, self.fail_at, self.cleared, self.unregistered = 0, fail_at, 0, []

    def host_register(self, ptr, size, flags):
        self.calls += 1
        return 2 if self.calls == self.fail_at else 0  # cudaErrorMemoryAllocation

    def host_unregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def clear_last_error(self):
        self.cleared += 1
        return 2

    def error_string(self, err):
        return "out of memory"


def test_failed_host_register_clears_the_sticky_error_and_unpins_what_it_pinned(monkeypatch):
    rt = FakeRuntime(fail_at=2)
    monkeypatch.setattr(cuda_rt, "runtime", lambda: rt)
    monkeypatch.setattr(cuda_lane, "MAX_REGISTER_BYTES", 4 * 4096)  # pieces of 4 rows
    rows = torch.zeros((10, 4096), dtype=torch.int8)
    assert cuda_lane.register_host_rows(rows) == ([], None)
    assert rt.cleared == 1 and rt.unregistered == [rows.data_ptr()]
    ok = FakeRuntime(fail_at=-1)
    monkeypatch.setattr(cuda_rt, "runtime", lambda: ok)
    ptrs, piece = cuda_lane.register_host_rows(rows)
    assert piece == 4 and ptrs == [rows.data_ptr() + i * 4 * 4096 for i in range(3)] and ok.cleared == 0


def test_an_unpinned_host_tier_is_loud(monkeypatch):
    """A failed cudaHostRegister keeps serving, pageable: one warning saying what that costs and where to look."""
    seen = []
    monkeypatch.setattr(cuda_lane.logger, "warning", lambda msg, *a: seen.append(msg % a))
    monkeypatch.setattr(cuda_rt, "runtime", lambda: FakeRuntime(fail_at=1))
    assert cuda_lane.register_host_rows(torch.zeros((4, 4096), dtype=torch.int8)) == ([], None)
    (msg,) = seen
    assert "NOT PINNED: cudaHostRegister failed (out of memory)" in msg and "slower" in msg, msg
    assert "ulimit -l" in msg and "tpu_offload_host_tier_pinned" in msg, msg


def test_an_unpinned_host_tier_is_measured():
    """The worker's gauge: 0 unpinned, 1 pinned, per rank; nothing off CUDA."""
    pytest.importorskip("vllm")  # the device check runs this file without vLLM
    from gpu_offload.vllm import metrics

    stats = metrics.WorkerStats(rank=1)
    assert stats.collect({}, None, None, pinned=False).reduce() == {f"{metrics.PINNED}:('cpu', '1')": 0.0}
    assert stats.collect({}, None, None, pinned=False) is None  # a gauge: sent at most once a second
    assert metrics.WorkerStats(0).collect({}, None, None, pinned=True).reduce() == {f"{metrics.PINNED}:('cpu', '0')": 1.0}
    assert metrics.WorkerStats(0).collect({}, None, None) is None  # off CUDA: nothing pinned, nothing sent
    assert metrics.PINNED in metrics.metric_definitions()


def test_the_cuda_runtime_is_found_among_loaded_libraries():
    assert cuda_rt.find_loaded_library("libc.so") or cuda_rt.find_loaded_library("libc-")
    assert cuda_rt.find_loaded_library("libdoes_not_exist") is None


class RecordingPipe:
    """Stands in for CudaPipe on CPU: records which side touched which staging half, in order."""

    def __init__(self):
        self.log = []

    def _side(self, name, buf):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.log.append((name, buf))
            yield

        return ctx()

    def device(self, buf):
        return self._side("device", buf)

    def bus(self, buf):
        return self._side("bus", buf)

    def join(self):
        self.log.append(("join", None))


@pytest.mark.parametrize("to_host", [True, False])
def test_staging_halves_alternate_and_each_side_follows_the_other(to_host):
    """A 7-slot transfer through 4 staging slots: halves of 2, pieces 0,1,0,1; a store gathers a half on
    the device before the bus moves it, a load moves it over the bus before the device scatters it."""
    import torch

    from gpu_offload.torch_backend.copy_ops import StagedCopier
    from gpu_offload.torch_backend.layout import HostLayout, PagedRows
    from gpu_offload.torch_backend.plan import TransferPlanner

    page, n = 64, 7
    layout = HostLayout.build([page], 1)
    engine = [torch.randint(-128, 128, (16, page), dtype=torch.int8)]
    host = torch.zeros((8, page), dtype=torch.int8)
    pipe = RecordingPipe()
    copier = StagedCopier(engine, host, PagedRows(torch.zeros((4, page), dtype=torch.int8), layout),
                          upload=torch.from_numpy, non_blocking=False, buffers=2, pipe=pipe)
    assert copier.capacity == 2
    blocks, slots = np.arange(3, 3 + n), np.arange(n)
    plan = TransferPlanner(1, [(0,)], 16, 8).plan(blocks, [n], [0], slots)
    copier.copy(plan, to_host)
    first, second = ("device", "bus") if to_host else ("bus", "device")
    assert pipe.log == [(s, b) for b in (0, 1, 0, 1) for s in (first, second)] + [("join", None)]
    if to_host:
        assert torch.equal(host[:n], engine[0][3:3 + n])


def test_pieces_are_capped_by_bytes_as_well_as_by_the_staging_half():
    import torch

    from gpu_offload.torch_backend.copy_ops import StagedCopier
    from gpu_offload.torch_backend.layout import HostLayout, PagedRows

    layout = HostLayout.build([64], 1)
    staging = PagedRows(torch.zeros((16, 64), dtype=torch.int8), layout)
    engine, host = [torch.zeros((4, 64), dtype=torch.int8)], torch.zeros((4, 64), dtype=torch.int8)
    make = lambda **kw: StagedCopier(engine, host, staging, upload=torch.from_numpy, non_blocking=False, **kw)
    assert make(buffers=2).capacity == 8
    assert make(buffers=2, piece_bytes=3 * 64).capacity == 3
    assert make(buffers=2, piece_bytes=10).capacity == 1  # a row larger than a piece: one row each
    assert make(buffers=2, piece_bytes=1 << 30).capacity == 8


@pytest.mark.parametrize("pages,word", [((64, 32), torch.int64), ((12, 20), torch.int32), ((6, 10), torch.int16),
                                        ((5, 64), torch.int8)])
def test_gathers_use_the_widest_word_the_pages_allow_and_move_the_same_bytes(pages, word):
    from gpu_offload.torch_backend.copy_ops import StagedCopier
    from gpu_offload.torch_backend.layout import HostLayout, PagedRows
    from gpu_offload.torch_backend.plan import TransferPlanner

    layout = HostLayout.build(list(pages), 2)
    stride = -(-layout.chunk_bytes // 8) * 8
    engine = [torch.randint(-128, 128, (12, p), dtype=torch.int8) for p in pages]
    host = torch.zeros((6, stride), dtype=torch.int8)
    copier = StagedCopier(engine, host, PagedRows(torch.zeros((4, stride), dtype=torch.int8), layout),
                          upload=torch.from_numpy, non_blocking=False, buffers=2)
    assert copier.word == word
    planner = TransferPlanner(2, [(0, 1)], 12, 6)
    blocks, slots = np.array([7, 2, 9, 4, 0]), np.array([5, 1, 3])
    copier.copy(planner.plan(blocks, [5], [0], slots), True)
    for t, p in enumerate(pages):
        for i, b in enumerate(blocks):
            row, sub = slots[i // 2], i % 2
            a = layout.offsets[t] + sub * p
            assert torch.equal(host[row, a:a + p], engine[t][b]), (t, i)
    dst = np.array([1, 3, 5, 8, 10])
    copier.copy(planner.plan(dst, [5], [0], slots), False)
    for t in range(len(pages)):
        assert torch.equal(engine[t][torch.as_tensor(dst)], engine[t][torch.as_tensor(blocks)])
