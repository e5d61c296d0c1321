"""MLA ragged paged attention in plain, jittable JAX, for tpu-inference on CPU.

Same signature, cache layout and result as tpu-inference's MLA kernel
(``kernels/mla/v2/kernel.py:mla_ragged_paged_attention``, which
``attention_interface.mla_attention`` calls for DeepSeek-style latent
attention), under the same guarantees as ``cpu_attention``: padding is
inert, never-written cache memory cannot leak in, and one token's result
does not depend on the rest of the batch (keys visited in fixed blocks).

The latent cache is ``[pages, page_size // packing, packing, align(A, 128) +
align(R, 128)]``: token ``t`` of a page sits at ``[t // packing, t % packing]``
with its compressed KV ``c`` (``A = kv_lora_rank`` wide) first and its roped
key part ``k_pe`` (``R`` wide) after ``align(A, 128)``. The step's new tokens
are written with the kernel family's own ``update_kv_cache``
(``kernels/mla/v1``, the same layout), so the bytes a connector would copy are
laid out as on a TPU. Queries arrive absorbed: ``ql_nope [N, T, A]`` (head
major, already multiplied by the key up-projection) and ``q_pe [T, N, R]``;
each head scores ``ql_nope . c + q_pe . k_pe`` and reads ``c`` as its value,
so the output is ``[N, T, A]`` (the model applies the value up-projection).

Scores and the softmax accumulate in float32; the output has the queries'
dtype. The transposed cache (``MLA_TRANSPOSE_KV_CACHE=1``) is not supported.
In ``tpu_offload.testing`` because ``cpu_support`` installs it in every engine on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tpu_offload.testing.cpu_attention import _NEG, BLOCK_TOKENS, token_positions  # same bookkeeping and masking
_STATIC = ("sm_scale", "sliding_window", "soft_cap", "q_scale", "k_scale", "v_scale")


def mla_ragged_paged_attention(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
                               distribution, *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None,
                               q_scale=None, k_scale=None, v_scale=None, transpose_kv_cache=False, **_kernel_tuning):
    """``(out [N, T, A], new cache)``, as the kernel returns them."""
    if transpose_kv_cache:
        raise NotImplementedError("the transposed MLA cache (MLA_TRANSPOSE_KV_CACHE) is not implemented on CPU")
    return _mla(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, distribution,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, q_scale=q_scale,
                k_scale=k_scale, v_scale=v_scale)


def _align(n: int, to: int = 128) -> int:
    return -(-n // to) * to


@functools.partial(jax.jit, static_argnames=_STATIC)
def _mla(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale,
         sliding_window, soft_cap, q_scale, k_scale, v_scale):
    from tpu_inference.kernels.mla.v1.kernel import update_kv_cache

    i32, f32 = jnp.int32, jnp.float32
    n_heads, T, lkv = ql_nope.shape
    r = q_pe.shape[-1]
    lkv_pad = _align(lkv)
    num_pages, rows, packing, width = cache_kv.shape
    page_size = rows * packing
    S = kv_lens.shape[0]
    P = page_indices.shape[0] // S
    table = jnp.clip(page_indices.reshape(S, P).astype(i32), 0, num_pages - 1)

    seq, valid, kv_len, pos = token_positions(T, kv_lens, cu_q_lens, distribution)

    # The kernel family's own cache write (sequences past distribution[2] and padding write nothing).
    cache_kv = update_kv_cache(new_kv_c.astype(cache_kv.dtype), new_k_pe.astype(cache_kv.dtype), cache_kv, kv_lens,
                               page_indices, cu_q_lens, distribution)
    flat = cache_kv.reshape(num_pages, page_size, width)

    q_c = jnp.transpose(ql_nope, (1, 0, 2)).astype(f32)  # [T, N, A]
    q_r = q_pe.astype(f32)
    scale = sm_scale * (k_scale or 1.0) * (q_scale or 1.0)
    pages_per_block = max(1, min(P, BLOCK_TOKENS // page_size))
    block = pages_per_block * page_size
    n_blocks = (jnp.max(kv_len) + block - 1) // block

    def body(b, carry):
        m, l, acc = carry
        cols = jnp.clip(b * pages_per_block + jnp.arange(pages_per_block), 0, P - 1)
        kv = flat[table[seq][:, cols]].reshape(T, block, width)
        j = b * block + jnp.arange(block, dtype=i32)
        ok = (j[None, :] < kv_len[:, None]) & (j[None, :] <= pos[:, None])
        if sliding_window is not None:
            ok &= j[None, :] > pos[:, None] - sliding_window
        kv = jnp.where(ok[:, :, None], kv, 0)
        c, k_pe = kv[..., :lkv].astype(f32), kv[..., lkv_pad : lkv_pad + r].astype(f32)
        s = (jnp.einsum("tna,tja->tnj", q_c, c, preferred_element_type=f32)
             + jnp.einsum("tnr,tjr->tnj", q_r, k_pe, preferred_element_type=f32)) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(ok[:, None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("tnj,tja->tna", p, c, preferred_element_type=f32)
        return m_new, l, acc * alpha[..., None] + pv

    init = (jnp.full((T, n_heads), _NEG, f32), jnp.zeros((T, n_heads), f32), jnp.zeros((T, n_heads, lkv), f32))
    _, l, acc = lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    if v_scale is not None:
        out = out * v_scale
    out = jnp.where(valid[:, None, None], out, 0.0)
    return jnp.transpose(out, (1, 0, 2)).astype(ql_nope.dtype), cache_kv  # the kernel writes into ql_nope
