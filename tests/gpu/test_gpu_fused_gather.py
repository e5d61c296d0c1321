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
    run.used = [*getattr(run, "used", [])[-1:], w.gather_used]
    return w.pool.slab.copy(), [t.clone() for t in tensors], r.nbytes


@pytest.mark.parametrize("k,staging_blocks,first", [(1, 128, 0), (1, 2, 0), (2, 4, 1), (4, 4, 3), (4, 128, 0)])
def test_fused_moves_the_same_bytes_as_the_index_path(k, staging_blocks, first):
    slab_i, eng_i, n_i = run("index", k, staging_blocks, first)
    slab_f, eng_f, n_f = run("fused", k, staging_blocks, first)
    assert n_f == n_i
    assert run.used == ["index", "fused"]
    assert np.array_equal(slab_f, slab_i)
    for a, b in zip(eng_f, eng_i):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(eng_f, engine_tensors(0)))  # the load wrote something


def test_planned_offsets_word_and_vector_width():
    layout = HostLayout.build([64, 32], 2)  # slot: t0 pages at 0, 64; t1 at 128, 160
    eng = [torch.zeros((10, 64), dtype=torch.int8), torch.zeros((10, 32), dtype=torch.int8)]
    base0, base1 = eng[0].data_ptr(), eng[1].data_ptr()
    halves = [base0 - 4096, base0 + 8192]  # an engine tensor may lie above or below a staging half
    a = fused_gather.PageAddresses(eng, layout, stride=256, staging_bases=halves)
    assert (a.word, a.vec, a.max_words, a.dtype) == (8, 2, 8, torch.int64)
    e, s, w = a.pages((0, 1), gpu=np.array([3, 7]), rel=np.array([0, 2]), sub=np.array([1, 0]), half=1)
    assert (e * 8 + halves[1]).tolist() == [base0 + 3 * 64, base0 + 7 * 64, base1 + 3 * 32, base1 + 7 * 32]
    assert (s * 8).tolist() == [0 * 256 + 0 + 64, 2 * 256 + 0 + 0, 0 + 128 + 32, 2 * 256 + 128]
    assert w.tolist() == [8, 8, 4, 4]
    assert (a.pages((0,), np.array([3]), np.array([0]), np.array([0]), 0)[0] * 8 + halves[0]).tolist() == [base0 + 192]
    b = fused_gather.PageAddresses(eng, layout, stride=256, staging_bases=[base0 + 8])
    assert (b.word, b.vec) == (8, 1)  # 8-byte aligned, not 16: one word per access
    assert fused_gather.PageAddresses(eng, layout, stride=256, staging_bases=[base0 + 2]).word == 2


def test_pages_that_are_not_contiguous_rows_fall_back_to_the_index_path(caplog):
    big = torch.randint(-128, 128, (NUM_BLOCKS, 2, 2048), dtype=torch.int8)
    strided = big[:, 0, :]  # rows 4096 B apart, pages of 2048 B: fused handles it (row stride)
    assert fused_gather.PageAddresses([strided], HostLayout.build([2048], 1), 2048, [0]).row.tolist() == [4096]
    cols = big.view(NUM_BLOCKS, -1)[:, ::2]  # not contiguous inside a page
    with pytest.raises(ValueError, match="not contiguous"):
        fused_gather.PageAddresses([cols], HostLayout.build([2048], 1), 2048, [0])
    with caplog.at_level(logging.WARNING):
        w = HostTransferEngine([strided], [2048], [(0,)], 8, 1, strategy="staged", gather="fused")
    assert w.gather_used == "fused"
    with pytest.raises(ValueError, match="gather 'gpu'"):
        HostTransferEngine([strided], [2048], [(0,)], 8, 1, strategy="staged", gather="gpu")


def _interpreted_kernel(monkeypatch):
    """fused_kernel imported and run under TRITON_INTERPRET=1 (set for this test only), or a skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_gpu_cuda.py runs the compiled kernel instead")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at import (decoration) and at launch
    module = importlib.import_module("gpu_offload.torch_backend.fused_kernel")
    if type(module._copy_pages).__name__ != "InterpretedFunction":
        pytest.skip("fused_kernel already imported without the interpreter")
    return module


@pytest.mark.parametrize("k,staging_blocks,first", [(1, 2, 0), (4, 4, 3)])
def test_triton_kernel_under_the_interpreter_matches_the_index_path(monkeypatch, k, staging_blocks, first):
    _interpreted_kernel(monkeypatch)
    made = []

    def triton_mover(addresses, device):
        made.append(fused_gather.TritonMover(addresses.tile_words, addresses.vec))
        return made[-1]

    monkeypatch.setattr(fused_gather, "make_mover", triton_mover)
    slab_i, eng_i, _ = run("index", k, staging_blocks, first)
    slab_f, eng_f, _ = run("fused", k, staging_blocks, first)
    assert made
    assert np.array_equal(slab_f, slab_i)
    for a, b in zip(eng_f, eng_i):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,vec", [(torch.int64, 2), (torch.int64, 1), (torch.int16, 8), (torch.int8, 1)])
def test_triton_kernel_tiles_and_masks_pages_of_mixed_sizes(monkeypatch, dtype, vec):
    """One launch, pages of three sizes (masked in their last tile), an engine below and above the
    staging buffer, both directions; nothing outside a page is written."""
    kernel = _interpreted_kernel(monkeypatch)
    word = torch.empty(0, dtype=dtype).element_size()
    tile = 64 // word  # small tiles: several per page
    arena = torch.zeros(3 * 4096 // word, dtype=dtype)  # [engine-low | staging | engine-high]
    src = torch.randint(-100, 100, (arena.numel(),)).to(dtype)
    stg = arena[4096 // word: 2 * 4096 // word]
    lo, hi = -(4096 // word), 4096 // word  # word offsets of the low and high engine regions from `stg`
    eng = torch.tensor([lo + 0, lo + 2048 // word, hi + 1024 // word], dtype=torch.int64)
    off = torch.tensor([64, 1792, 3200], dtype=torch.int64) // word  # no two pages overlap on either side
    nbytes = [1600, 768, 64]
    words = torch.tensor([n // word for n in nbytes], dtype=torch.int64)
    launch = kernel.launcher(tile, vec)
    arena.copy_(src)
    stg.zero_()
    launch(stg, eng, off, words, int(words.max()), True)
    base = 4096 // word
    for e, o, n in zip(eng.tolist(), off.tolist(), words.tolist()):
        assert torch.equal(stg[o:o + n], src[base + e:base + e + n])
    staged = stg.clone()
    arena.zero_()
    stg.copy_(staged)
    launch(stg, eng, off, words, int(words.max()), False)
    written = torch.zeros(arena.numel(), dtype=torch.bool)
    written[base:2 * base] = True
    for e, n in zip(eng.tolist(), words.tolist()):
        assert torch.equal(arena[base + e:base + e + n], src[base + e:base + e + n])
        written[base + e:base + e + n] = True
    assert not arena[~written].any()  # the masks hold


def test_self_test_passes_the_kernel_and_catches_a_wrong_copy(monkeypatch):
    _interpreted_kernel(monkeypatch)
    cpu = torch.device("cpu")
    fused_gather.self_test(fused_gather.TritonMover(16, 2), cpu, torch.int64, 16, 2)
    fused_gather.self_test(fused_gather.TritonMover(64, 1), cpu, torch.int8, 64, 1)
    fused_gather.self_test(fused_gather.ReferenceMover(2), cpu, torch.int16, 16, 8)
    with pytest.raises(RuntimeError, match="wrong bytes"):
        fused_gather.self_test(lambda *a: None, cpu, torch.int64, 16, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is absent")
def test_a_mover_that_cannot_run_leaves_the_index_path(caplog):
    eng = [torch.zeros((4, 64), dtype=torch.int8)]
    a = fused_gather.PageAddresses(eng, HostLayout.build([64], 1), 64, [0])
    with caplog.at_level(logging.WARNING):
        assert fused_gather.make_mover(a, torch.device("cuda")) is None
    assert "index gather" in caplog.text


@pytest.mark.parametrize("dtype,vec", [("i64", 2), ("i64", 1), ("i32", 4), ("i8", 16), ("i8", 1)])
def test_triton_kernel_compiles_for_hopper_with_16_byte_accesses(monkeypatch, dtype, vec):
    """Compiled (not interpreted) to PTX for sm_90 on the host, no GPU needed: with ``vec`` words of
    16 bytes every load and store of the page body is a 16-byte vector access; without, one word."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # A private copy of the module: the shared one may have been imported under the interpreter.
    spec = importlib.util.spec_from_file_location("_fused_kernel_compiled", fused_gather.__file__.replace(
        "fused_gather.py", "fused_kernel.py"))
    fused_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused_kernel)

    word = {"i64": 8, "i32": 4, "i8": 1}[dtype]
    sig = {"stg_ptr": f"*{dtype}", "eng_off_ptr": "*i64", "stg_off_ptr": "*i64", "words_ptr": "*i64",
           "TO_STAGING": "constexpr", "TILE": "constexpr", "VEC": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # torch allocations: 16-byte aligned
    want = ".v2.b64" if vec * word == 16 and word == 8 else ".v4.b32" if vec * word == 16 else f".b{8 * word}"
    for to_staging in (True, False):
        src = ASTSource(fn=fused_kernel._copy_pages, signature=sig, attrs=aligned,
                        constexprs={"TO_STAGING": to_staging, "TILE": fused_gather.TILE_BYTES // word, "VEC": vec})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        body = [x.split()[1] for x in ptx.splitlines() if x.strip().startswith("@") and "global" in x]
        assert body, ptx
        assert all(op.endswith(want) for op in body), body


def test_auto_gather_is_fused_only_for_many_tensors_on_cuda():
    """"auto" keeps the index gather on CPU and for few tensors; the fused one needs CUDA and
    ``FUSED_MIN_TENSORS`` tensors (where the H200 measured it ahead both ways at once)."""
    from gpu_offload.torch_backend import fused_gather as fg

    cpu = [torch.zeros(4, 64, dtype=torch.int8) for _ in range(fg.FUSED_MIN_TENSORS)]
    assert fg.auto_gather(cpu) == "index"
    meta = [torch.empty(4, 64, dtype=torch.int8, device="meta") for _ in range(fg.FUSED_MIN_TENSORS)]
    assert fg.auto_gather(meta) == "index"

    class Cuda:  # only the device type matters to the choice
        device = torch.device("cuda")

    assert fg.auto_gather([Cuda()] * fg.FUSED_MIN_TENSORS) == "fused"
    assert fg.auto_gather([Cuda()] * (fg.FUSED_MIN_TENSORS - 1)) == "index"
    t = torch.zeros(8, 64, dtype=torch.int8)
    assert HostTransferEngine([t], [64], [(0,)], 4, 1, gather="auto").gather_used in ("direct", "index")
