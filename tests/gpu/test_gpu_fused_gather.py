"""The fused gather (one launch per piece for all KV tensors) moves the same bytes as the index path.

On CPU the staged engine runs with ``ReferenceMover`` (one memmove per planned page: exactly the
kernel's work), and, when Triton is importable and no CUDA device is, with the Triton kernel itself
under ``TRITON_INTERPRET=1``. Each case stores and loads through both gathers and compares the host
slab and the engine tensors byte for byte: hybrid groups, pages of three sizes (one that does not
divide the row stride), chunks entered mid-way, ragged last chunks, several staging pieces.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types

import numpy as np
import pytest
import torch

from gpu_offload.torch_backend import fused_gather
from gpu_offload.torch_backend.engine import HostTransferEngine
from gpu_offload.torch_backend.layout import HostLayout

NUM_BLOCKS, NUM_SLOTS = 48, 40
PAGES = [4096, 4096, 1536, 2560]  # 1536 B does not divide the slot row: the 3-D view case of the index path
GROUPS = [(0, 1), (2, 3)]


def spec(blocks, sizes, firsts):
    return types.SimpleNamespace(block_ids=np.asarray(blocks, np.int32), group_sizes=list(sizes),
                                 block_indices=list(firsts))


def slots(s):
    return types.SimpleNamespace(block_ids=np.asarray(s, np.int32))


def engine_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, generator=g) for p in PAGES]


def run(gather: str, k: int, staging_blocks: int, first: int):
    """Store two groups' blocks (entered at sub-block ``first % k``), load them elsewhere: (slab, tensors)."""
    tensors = engine_tensors(0)
    w = HostTransferEngine(tensors, PAGES, GROUPS, NUM_SLOTS, k, strategy="staged",
                           staging_blocks=staging_blocks, gather=gather, zero_pool=True)
    rng = np.random.default_rng(k)
    perm = rng.permutation(NUM_BLOCKS)
    n0, n1 = 3 * k + 1, 2 * k  # group 0 ragged at the end
    skip = first % k
    n_slots0, n_slots1 = -(-(skip + n0) // k), -(-(skip + n1) // k)
    src = perm[: n0 + n1]
    dst = perm[n0 + n1: 2 * (n0 + n1)]
    host = rng.permutation(NUM_SLOTS)[: n_slots0 + n_slots1]
    w.submit_store(1, spec(src, (n0, n1), (first, first)), slots(host))
    (r,) = w.get_finished()
    assert r.ok
    w.submit_load(2, slots(host), spec(dst, (n0, n1), (first, first)))
    (r,) = w.get_finished()
    assert r.ok and w.take_load_error_blocks() == set()
    w.shutdown()
    return w.pool.slab.copy(), [t.clone() for t in tensors], r.nbytes


@pytest.mark.parametrize("k,staging_blocks,first", [(1, 128, 0), (1, 2, 0), (2, 4, 1), (4, 4, 3), (4, 128, 0)])
def test_fused_moves_the_same_bytes_as_the_index_path(k, staging_blocks, first):
    slab_i, eng_i, n_i = run("index", k, staging_blocks, first)
    slab_f, eng_f, n_f = run("fused", k, staging_blocks, first)
    assert n_f == n_i
    assert np.array_equal(slab_f, slab_i)
    for a, b in zip(eng_f, eng_i):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(eng_f, engine_tensors(0)))  # the load wrote something


def test_planned_addresses_and_word():
    layout = HostLayout.build([64, 32], 2)  # slot: t0 pages at 0, 64; t1 at 128, 160
    eng = [torch.zeros((10, 64), dtype=torch.int8), torch.zeros((10, 32), dtype=torch.int8)]
    a = fused_gather.PageAddresses(eng, layout, stride=256, staging_bases=[4096])
    assert a.word == 8 and a.max_words == 8
    e, s, w = a.pages((0, 1), gpu=np.array([3, 7]), rel=np.array([0, 2]), sub=np.array([1, 0]))
    base0, base1 = eng[0].data_ptr(), eng[1].data_ptr()
    assert e.tolist() == [base0 + 3 * 64, base0 + 7 * 64, base1 + 3 * 32, base1 + 7 * 32]
    assert s.tolist() == [0 * 256 + 0 + 64, 2 * 256 + 0 + 0, 0 + 128 + 32, 2 * 256 + 128]
    assert w.tolist() == [8, 8, 4, 4]
    assert fused_gather.PageAddresses(eng, layout, stride=256, staging_bases=[4098]).word == 2


def test_pages_that_are_not_contiguous_rows_fall_back_to_the_index_path(caplog):
    big = torch.randint(-128, 128, (NUM_BLOCKS, 2, 2048), dtype=torch.int8)
    strided = big[:, 0, :]  # rows 4096 B apart, pages of 2048 B: fused handles it (row stride)
    assert fused_gather.PageAddresses([strided], HostLayout.build([2048], 1), 2048, [0]).row.tolist() == [4096]
    cols = big.view(NUM_BLOCKS, -1)[:, ::2]  # not contiguous inside a page
    with pytest.raises(ValueError, match="not contiguous"):
        fused_gather.PageAddresses([cols], HostLayout.build([2048], 1), 2048, [0])
    with caplog.at_level(logging.WARNING):
        w = HostTransferEngine([strided], [2048], [(0,)], 8, 1, strategy="staged", gather="fused")
    assert w._store_lane.copier.mover is not None
    with pytest.raises(ValueError, match="gather 'gpu'"):
        HostTransferEngine([strided], [2048], [(0,)], 8, 1, strategy="staged", gather="gpu")


def _interpreted_kernel():
    """fused_kernel imported under TRITON_INTERPRET=1, or a skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_gpu_cuda.py runs the compiled kernel instead")
    name = "gpu_offload.torch_backend.fused_kernel"
    if name in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fused_kernel already imported without the interpreter")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is decorated; the module is only used here
    return importlib.import_module(name)


@pytest.mark.parametrize("k,staging_blocks,first", [(1, 2, 0), (4, 4, 3)])
def test_triton_kernel_under_the_interpreter_matches_the_index_path(monkeypatch, k, staging_blocks, first):
    _interpreted_kernel()
    made = []

    def triton_mover(addresses, device):
        made.append(fused_gather.TritonMover(addresses.word, addresses.tile_words))
        return made[-1]

    monkeypatch.setattr(fused_gather, "make_mover", triton_mover)
    slab_i, eng_i, _ = run("index", k, staging_blocks, first)
    slab_f, eng_f, _ = run("fused", k, staging_blocks, first)
    assert made
    assert np.array_equal(slab_f, slab_i)
    for a, b in zip(eng_f, eng_i):
        assert torch.equal(a, b)


@pytest.mark.parametrize("word", [8, 2, 1])
def test_triton_kernel_tiles_and_masks_pages_of_mixed_sizes(word):
    """One launch, pages of two sizes (the smaller masked in its last tile), both directions."""
    kernel = _interpreted_kernel()
    tile = 64 // word  # small tiles: several per page
    src = torch.randint(-128, 128, (4096,), dtype=torch.int8)
    stg = torch.zeros(4096, dtype=torch.int8)
    eng = torch.tensor([src.data_ptr() + o for o in (0, 2048, 3072)], dtype=torch.int64)
    off = torch.tensor([64, 1792, 3200], dtype=torch.int64)  # no two pages overlap on either side
    nbytes = [200 * word, 96 * word, 8 * word]
    words = torch.tensor([n // word for n in nbytes], dtype=torch.int64)
    launch = kernel.launcher(word, tile)
    launch(eng, off, words, int(words.max()), stg.data_ptr(), True)
    want = torch.zeros(4096, dtype=torch.int8)
    for e, o, n in zip(eng.tolist(), off.tolist(), nbytes):
        want[o:o + n] = src[e - src.data_ptr():e - src.data_ptr() + n]
    assert torch.equal(stg, want)
    back = torch.zeros(4096, dtype=torch.int8)
    eng_back = eng - src.data_ptr() + back.data_ptr()
    launch(eng_back, off, words, int(words.max()), stg.data_ptr(), False)
    for e, o, n in zip(eng.tolist(), off.tolist(), nbytes):
        i = e - src.data_ptr()
        assert torch.equal(back[i:i + n], src[i:i + n])
    written = torch.zeros(4096, dtype=torch.bool)
    for e, n in zip(eng.tolist(), nbytes):
        written[e - src.data_ptr():e - src.data_ptr() + n] = True
    assert not back[~written].any()  # nothing written past a page (the masks hold)


def test_self_test_passes_the_kernel_and_catches_a_wrong_copy():
    _interpreted_kernel()
    fused_gather.self_test(fused_gather.TritonMover(8, 16), torch.device("cpu"), 8, 16)
    fused_gather.self_test(fused_gather.ReferenceMover(2), torch.device("cpu"), 2, 16)
    with pytest.raises(RuntimeError, match="wrong bytes"):
        fused_gather.self_test(lambda *a: None, torch.device("cpu"), 8, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is absent")
def test_a_mover_that_cannot_run_leaves_the_index_path(caplog):
    eng = [torch.zeros((4, 64), dtype=torch.int8)]
    a = fused_gather.PageAddresses(eng, HostLayout.build([64], 1), 64, [0])
    with caplog.at_level(logging.WARNING):
        assert fused_gather.make_mover(a, torch.device("cuda")) is None
    assert "index gather" in caplog.text
