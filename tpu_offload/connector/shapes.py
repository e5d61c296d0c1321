"""The KV cache tpu-inference builds for a model at a TP degree, in bytes, without tpu-inference or JAX.

Importing tpu-inference polls the GCE metadata server (~20 s off a TPU host)
and needs vLLM's platform resolved, so the self-check's offline mode (a
laptop, CI) sizes a deployment from this module alone. ``aot.py`` builds the
real abstract caches with tpu-inference's own shape functions;
``tests/tpu_compiler/test_shapes.py`` proves both give the same bytes for
every model of ``MODELS`` at TP 1 to 8.

The shapes mirror tpu-inference 0.32 at its default settings: the ragged
paged attention kernel (``(block_size, cdiv(2 * heads, packing), packing,
align(head_dim, 128))`` per head shard; head_dim 64 packs K and V into one
128-lane row), and the MLA v2 kernel (``(cdiv(block_size, 32), 32,
align(latent, 128))``, ``MLA_KV_PACKING_SIZE=32``, not transposed). Its
environment overrides (``USE_BATCHED_RPA_KERNEL``, ``MLA_*``) are not
followed here; the online self-check reads the real shapes.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the KV cache depends on; the figures are the models' published configs."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    use_mla: bool = False


MODELS = {m.name: m for m in (
    ModelShape("Qwen3-32B", 64, 8, 128),
    ModelShape("Llama-3.1-70B", 80, 8, 128),
    ModelShape("Llama-3.1-8B", 32, 8, 128),
    ModelShape("Qwen2.5-7B", 28, 4, 128),  # 4 KV heads: replicated at TP 8
    ModelShape("gpt-oss-120b", 36, 8, 64),  # head_dim 64; sliding-window and full layers share one shape
    ModelShape("DeepSeek-V3", 61, 1, 576, use_mla=True),  # MLA: one latent (512 + 64 rope) per token
)}

# KV-cache dtypes by bytes per element (tpu-inference packs 32 // bits elements per 32-bit word).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
MLA_PACKING = 32  # tpu-inference's MLA_KV_PACKING_SIZE default


def padded_kv_heads(model: ModelShape, tp: int) -> tuple[int, int]:
    """(heads in the cache, replicas): tpu-inference repeats each KV head up to the TP degree."""
    if model.use_mla or model.kv_heads >= tp:
        return model.kv_heads, 1
    if tp % model.kv_heads:
        raise ValueError(f"{model.name}: {model.kv_heads} KV heads cannot be repeated over TP {tp}")
    return tp, tp // model.kv_heads


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"KV-cache dtype {dtype!r} is unknown; allowed: {', '.join(DTYPE_BYTES)}") from None


def block_shape(model: ModelShape, tp: int, block_size: int) -> tuple[int, ...]:
    """One layer's block as the cache holds it over all TP shards (the cache's shape less its block dim)."""
    packing = 4 // dtype_bytes(model.dtype)
    if model.use_mla:
        return (_align(block_size, MLA_PACKING) // MLA_PACKING, MLA_PACKING, _align(model.head_dim, 128))
    heads, _ = padded_kv_heads(model, tp)
    if heads % tp:
        raise ValueError(f"{model.name}: {heads} KV heads cannot be split over TP {tp}")
    per_shard = heads // tp
    if model.head_dim == 64:  # K and V share one 128-lane row
        rows, lanes = _align(per_shard, packing) // packing, 128
    else:
        rows, lanes = _align(2 * per_shard, packing) // packing, _align(model.head_dim, 128)
    return (block_size, rows * tp, packing, lanes)


@dataclasses.dataclass(frozen=True)
class CacheSizes:
    """Bytes of one block over every layer, as the connector counts them (``jax_backend/layout.py``)."""

    shape: tuple[int, ...]  # one layer's block, all shards
    kv_replicas: int  # times tpu-inference repeats each KV head (1: none; MLA: 1, its latent has no heads)
    replicated_block_bytes: int  # what the cache holds per block, repeats included
    block_bytes: int  # distinct bytes: what a chunk stores per block on the host
    device_block_bytes: int  # one device's piece of a block in staging


def cache_sizes(model: ModelShape, tp: int, block_size: int) -> CacheSizes:
    """The figures ``KVLayout.from_caches`` reads off tpu-inference's caches for this model at TP ``tp``."""
    shape = block_shape(model, tp, block_size)
    replicated = math.prod(shape) * dtype_bytes(model.dtype) * model.layers
    if model.use_mla:  # one latent copy on every device of the model axis; each keeps a 1/tp slice
        return CacheSizes(shape, 1, replicated, replicated, replicated // tp)
    _, replicas = padded_kv_heads(model, tp)
    return CacheSizes(shape, replicas, replicated, replicated // replicas, replicated // tp // replicas)
