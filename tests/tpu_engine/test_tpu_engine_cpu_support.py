"""The CPU support module itself, without starting an engine.

Its attention is checked against tpu-inference's own reference
implementations (``ref_ragged_paged_attention`` and its head_dim-64 twin,
which loop in Python and cannot be jitted), on both cache layouts, with GQA,
padded tokens and padded sequences.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpu_offload.testing import cpu_attention, cpu_support

# (q_len, kv_len) per sequence; decode-only first, as the runner orders them.
SEQS = [(1, 37), (1, 5), (23, 23), (9, 40)]


def make_inputs(rng, *, q_heads, kv_heads, head_dim, dtype, page_size, layout, seqs=SEQS, max_seqs=6,
                pages_per_seq=8, num_pages=48, tokens=64):
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, kernel_hd64

    shape_of = kernel.get_kv_cache_shape if layout == "v3" else kernel_hd64.get_kv_cache_shape
    cache = jnp.asarray(rng.standard_normal(shape_of(num_pages, page_size, kv_heads, head_dim, dtype)), dtype)
    q = jnp.asarray(rng.standard_normal((tokens, q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    kv_lens = np.zeros(max_seqs, np.int32)
    pages = np.zeros((max_seqs, pages_per_seq), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for i, (q_len, kv_len) in enumerate(seqs):
        kv_lens[i] = kv_len
        n = -(-kv_len // page_size)
        pages[i, :n] = [free.pop() for _ in range(n)]
        cu[i + 1] = cu[i] + q_len
    cu[len(seqs) + 1:] = cu[len(seqs)]
    n_decode = sum(1 for q_len, _ in seqs if q_len == 1)
    dist = np.array([n_decode, n_decode, len(seqs)], np.int32)
    meta = tuple(jnp.asarray(x) for x in (kv_lens, pages.reshape(-1), cu, dist))
    return (q, k, v, cache, *meta), int(cu[len(seqs)])


CASES = [  # q heads, kv heads, head_dim, dtype, page size, layout
    (8, 4, 128, "float32", 16, "v3"),
    (8, 2, 128, "bfloat16", 16, "v3"),
    (4, 1, 128, "float32", 128, "v3"),
    (4, 2, 64, "float32", 16, "hd64"),
    (8, 2, 64, "bfloat16", 16, "hd64"),
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype,page_size,layout", CASES)
def test_attention_matches_tpu_inference_reference(q_heads, kv_heads, head_dim, dtype, page_size, layout):
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, kernel_hd64

    args, n = make_inputs(np.random.default_rng(0), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          dtype=dtype, page_size=page_size, layout=layout)
    scale = head_dim ** -0.5
    if layout == "v3":
        want, want_cache = kernel.ref_ragged_paged_attention(*args, sm_scale=scale)
        got, got_cache = cpu_attention.ragged_paged_attention(*args, sm_scale=scale)
    else:
        want, want_cache = kernel_hd64.ref_ragged_paged_attention_hd64(*args, sm_scale=scale)
        got, got_cache = cpu_attention.ragged_paged_attention_hd64(*args, sm_scale=scale)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))  # bit-exact layout
    assert not np.asarray(got[n:], np.float32).any(), "padding tokens produce zeros"


def test_unwritten_pages_and_padding_cannot_leak_in():
    """NaN in every page nobody wrote, and in the padded queries/keys, changes nothing."""
    import jax.numpy as jnp

    kw = dict(q_heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16, layout="v3")
    args, n = make_inputs(np.random.default_rng(1), **kw)
    q, k, v, cache, kv_lens, pages, cu, dist = args
    out, new_cache = cpu_attention.ragged_paged_attention(*args, sm_scale=0.1)
    used = np.zeros(cache.shape[0], bool)
    used[np.asarray(pages)] = True
    used[0] = False  # page 0 only ever appears as padding in the table
    poisoned = jnp.where(jnp.asarray(used)[:, None, None, None, None], new_cache, jnp.nan)
    nan_tail = lambda x: x.at[n:].set(jnp.nan)  # noqa: E731
    out2, _ = cpu_attention.ragged_paged_attention(nan_tail(q), nan_tail(k), nan_tail(v), poisoned, kv_lens, pages,
                                                   cu, dist, sm_scale=0.1, update_kv_cache=False)
    np.testing.assert_array_equal(np.asarray(out2[:n]), np.asarray(out[:n]))


def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch():
    """Batch invariance: what a connector restores and what is computed in place
    must give identical logits, whatever else shares the step."""
    kw = dict(q_heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16, layout="v3")
    import jax.numpy as jnp

    batch, n = make_inputs(np.random.default_rng(2), **kw)
    q, k, v, cache, kv_lens, pages, cu, dist = batch  # the lone call reuses sequence 3's pages and cache

    start = int(cu[3])
    table = np.asarray(pages).reshape(6, -1)
    lone_meta = (jnp.asarray(np.array([40, 0, 0, 0, 0, 0], np.int32)),
                 jnp.asarray(np.concatenate([table[3], np.zeros(table[3].size * 5, np.int32)])),
                 jnp.asarray(np.array([0, 9, 9, 9, 9, 9, 9], np.int32)), jnp.asarray(np.array([0, 0, 1], np.int32)))
    shift = lambda x: jnp.roll(x, -start, axis=0)  # noqa: E731
    got_batch, _ = cpu_attention.ragged_paged_attention(*batch, sm_scale=0.1)
    got_alone, _ = cpu_attention.ragged_paged_attention(shift(q), shift(k), shift(v), cache, *lone_meta, sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(got_alone[:9]), np.asarray(got_batch[start : start + 9]))


def _aligned(n: int) -> np.ndarray:
    raw = np.zeros(n * 4 + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + n * 4].view(np.int32)


def test_jax_cpu_aliases_aligned_host_arrays():
    """The hazard behind the non-deterministic baselines: on JAX CPU a put of an
    aligned numpy array shares its memory, so writing the numpy buffer later
    rewrites the "device" array (on a TPU the put copies to HBM)."""
    import jax

    buf = _aligned(256)
    x = jax.device_put(buf, jax.devices()[0])
    buf[:] = 7
    assert int(np.asarray(x)[0]) == 7


def test_the_runners_puts_copy_host_buffers():
    """tpu-inference's runner reuses one host buffer for every step's inputs and
    ships it with ``device_array``; after apply() that put copies."""
    from tpu_inference import utils

    mesh = cpu_support.make_mesh((1, 2), ("data", "model"))
    buf = _aligned(256)
    x, y = utils.device_array(mesh, (buf, buf[:64]))
    buf[:] = 7
    assert not np.asarray(x).any() and not np.asarray(y).any()


def test_mesh_axes_are_auto_like_tpu_inference_makes_them():
    from jax.sharding import AxisType

    mesh = cpu_support.make_mesh((1, 4), ("data", "model"))
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(mesh.shape) == {"data": 1, "model": 4}


def test_apply_is_idempotent():
    from tpu_inference import utils
    from tpu_inference.layers.common import attention_interface

    put, attn = utils.general_device_put, attention_interface.ragged_paged_attention
    cpu_support.apply()
    assert utils.general_device_put is put
    assert attention_interface.ragged_paged_attention is attn is cpu_attention.ragged_paged_attention
