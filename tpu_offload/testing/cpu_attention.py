"""Ragged paged attention in plain, jittable JAX, for tpu-inference on CPU.

Same signature, cache layout and result as tpu-inference's RPA v3 kernels
(``ragged_paged_attention`` and its head_dim-64 variant): the step's K/V are
written into the paged cache with the kernels' own ``merge_kv`` (so the bytes
a connector copies are laid out exactly as on a TPU), then each token attends
causally over its own sequence's pages.

Trustworthy by construction, so token-equality tests mean something:

* padding is inert: tokens past ``cu_q_lens[num_seqs]`` write nothing and
  read nothing, and sequences past ``distribution[2]`` are ignored, whatever
  their (unset) metadata holds;
* never-written cache memory cannot leak in: K *and* V of every position a
  token may not see are zeroed before they meet the softmax (``0 * NaN`` is
  NaN, so masking the scores alone is not enough);
* one token's result does not depend on the rest of the batch: keys are
  visited in fixed 128-position blocks, and a block a token cannot see adds
  exactly nothing to its running softmax. A prefix restored by a connector
  therefore gives bit-identical logits to one computed in place.

Scores and the softmax accumulate in float32 (the kernel accumulates bf16
inputs in bf16); the output has the queries' dtype, as the kernel's does.
Query head ``h`` reads KV head ``h // (q_heads // kv_heads)``, as the kernel's
``prepare_inputs`` and HF's ``repeat_kv`` both do.

In ``tpu_offload.testing`` because ``cpu_support`` installs it in every engine on CPU
(tests, demos and benchmarks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK_TOKENS = 128  # keys visited per loop step (whole pages)
_NEG = -1e30  # masked score: exp(_NEG - m) == 0 for any real max m, and no inf - inf
_STATIC = ("sm_scale", "sliding_window", "soft_cap", "use_causal_mask", "update_kv_cache",
           "q_scale", "k_scale", "v_scale", "layout")


def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                           use_causal_mask=True, update_kv_cache=True, sm_scale=1.0, sliding_window=None,
                           soft_cap=None, q_scale=None, k_scale=None, v_scale=None, **_kernel_tuning):
    """RPA v3: cache ``[pages, page_size, align(2*kv_heads, packing)//packing, packing, align(head_dim, 128)]``."""
    return _rpa(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, None,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                use_causal_mask=use_causal_mask, update_kv_cache=update_kv_cache,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, layout="v3")


def ragged_paged_attention_hd64(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                attention_sink=None, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                q_scale=None, k_scale=None, v_scale=None, **_kernel_tuning):
    """RPA v3, head_dim 64: cache ``[pages, page_size, align(kv_heads, packing)//packing, packing, 128]``.

    ``attention_sink`` (f32 ``[q_heads]``, gpt-oss): one extra logit per query
    head that joins the softmax denominator and carries no value, so a token
    may attend to "nothing". The kernel starts each head's running max at the
    sink and its running sum at 1 (``exp(sink - sink)``); HF's eager GptOss
    attention appends the sink as a last score column and drops its
    probability. Both are what the running softmax here starts from."""
    return _rpa(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, use_causal_mask=True,
                update_kv_cache=True, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, layout="hd64")


def _merge(layout: str, k, v):
    """The kernel's own merge_kv: the cache bytes are exactly what a TPU writes."""
    if layout == "v3":
        from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv
    else:
        from tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64 import merge_kv
    return merge_kv(k, v)


def _split(layout: str, kv, kv_heads: int, head_dim: int):
    """Inverse of ``_merge`` on gathered pages ``[..., rows, packing, last]``."""
    *lead, rows, packing, last = kv.shape
    kv = kv.reshape(*lead, rows * packing, last)
    if layout == "v3":  # row 2i is K of head i, row 2i+1 its V; head_dim padded to 128
        kv = kv[..., : 2 * kv_heads, :].reshape(*lead, kv_heads, 2, last)
        return kv[..., 0, :head_dim], kv[..., 1, :head_dim]
    kv = kv[..., :kv_heads, :]  # hd64: row i is head i, [K | V] along the last dim
    return kv[..., :head_dim], kv[..., head_dim : 2 * head_dim]


def token_positions(T: int, kv_lens, cu_q_lens, distribution):
    """Which sequence each of ``T`` query tokens belongs to, whether it is a real token (padding and
    sequences past ``distribution[2]`` are not), its sequence's KV length and its position there."""
    i32 = jnp.int32
    S = kv_lens.shape[0]
    num_seqs = distribution[2].astype(i32)
    starts, ends = cu_q_lens[:S].astype(i32), cu_q_lens[1 : S + 1].astype(i32)
    ends_sorted = jnp.where(jnp.arange(S) < num_seqs, ends, jnp.iinfo(i32).max)
    t = jnp.arange(T, dtype=i32)
    seq = jnp.clip(jnp.searchsorted(ends_sorted, t, side="right"), 0, S - 1).astype(i32)
    valid = (t < cu_q_lens[num_seqs]) & (seq < num_seqs)
    kv_len = jnp.where(valid, kv_lens[seq].astype(i32), 0)
    pos = jnp.where(valid, kv_len - (ends[seq] - starts[seq]) + (t - starts[seq]), 0)
    return seq, valid, kv_len, pos


@functools.partial(jax.jit, static_argnames=_STATIC)
def _rpa(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, *, sm_scale,
         sliding_window, soft_cap, use_causal_mask, update_kv_cache, q_scale, k_scale, v_scale, layout):
    i32, f32 = jnp.int32, jnp.float32
    T, n_heads, head_dim = queries.shape
    kv_heads = keys.shape[1]
    group = n_heads // kv_heads
    num_pages, page_size = kv_cache.shape[:2]
    S = kv_lens.shape[0]
    P = page_indices.shape[0] // S
    table = jnp.clip(page_indices.reshape(S, P).astype(i32), 0, num_pages - 1)

    seq, valid, kv_len, pos = token_positions(T, kv_lens, cu_q_lens, distribution)

    if update_kv_cache:  # the step's K/V into their pages; padding goes out of bounds (dropped)
        page = table[seq, jnp.clip(pos // page_size, 0, P - 1)]
        slot = jnp.where(valid, page * page_size + pos % page_size, num_pages * page_size)
        flat = kv_cache.reshape(num_pages * page_size, *kv_cache.shape[2:])
        flat = flat.at[slot].set(_merge(layout, keys, values).astype(kv_cache.dtype), mode="drop")
        kv_cache = flat.reshape(kv_cache.shape)

    q = queries
    if q_scale is not None:
        q = q / q_scale
        if jnp.issubdtype(kv_cache.dtype, jnp.floating):
            info = jnp.finfo(kv_cache.dtype)
            q = jnp.clip(q, float(info.min), float(info.max))
        q = q.astype(kv_cache.dtype)
    q = q.reshape(T, kv_heads, group, head_dim)
    scale = sm_scale * (k_scale or 1.0) * (q_scale or 1.0)

    pages_per_block = max(1, min(P, BLOCK_TOKENS // page_size))
    block = pages_per_block * page_size
    n_blocks = (jnp.max(kv_len) + block - 1) // block

    def body(b, carry):
        m, l, acc = carry
        cols = jnp.clip(b * pages_per_block + jnp.arange(pages_per_block), 0, P - 1)
        kv = kv_cache[table[seq][:, cols]]  # [T, pages_per_block, page_size, rows, packing, last]
        kv = kv.reshape(T, block, *kv.shape[3:])
        k, v = _split(layout, kv, kv_heads, head_dim)  # [T, block, kv_heads, head_dim]
        j = b * block + jnp.arange(block, dtype=i32)
        ok = j[None, :] < kv_len[:, None]
        if use_causal_mask:
            ok &= j[None, :] <= pos[:, None]
        if sliding_window is not None:
            ok &= j[None, :] > pos[:, None] - sliding_window
        k = jnp.where(ok[:, :, None, None], k, 0)
        v = jnp.where(ok[:, :, None, None], v, 0)
        s = jnp.einsum("tkgd,tjkd->tkgj", q, k, preferred_element_type=f32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(ok[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("tkgj,tjkd->tkgd", p, v.astype(f32), preferred_element_type=f32)
        return m_new, l, acc * alpha[..., None] + pv

    if sinks is None:  # running max, running sum, accumulator
        m0, l0 = jnp.full((T, kv_heads, group), _NEG, f32), jnp.zeros((T, kv_heads, group), f32)
    else:  # the sink is a score already seen: max = sink, sum = exp(sink - sink)
        m0 = jnp.broadcast_to(sinks.astype(f32).reshape(kv_heads, group), (T, kv_heads, group))
        l0 = jnp.ones((T, kv_heads, group), f32)
    init = (m0, l0, jnp.zeros((T, kv_heads, group, head_dim), f32))
    _, l, acc = lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    if v_scale is not None:
        out = out * v_scale
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, n_heads, head_dim).astype(queries.dtype), kv_cache
