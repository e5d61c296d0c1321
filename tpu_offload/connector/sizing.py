"""Bytes per block, hence one chunk size and one slot count, the same in both halves.

vLLM hands the two halves different views of one set of caches. The worker's
KV-cache config keeps a group's per-layer specs: ``UniformTypeKVCacheSpecs``
when layers of one attention type differ in page size (Gemma 4's sliding and
global layers), whose ``page_size_bytes`` already sums every layer of the
group. The scheduler's (``generate_scheduler_kv_cache_config``) replaces that
by its first layer's spec. Both keep the same ``kv_cache_tensors``: one per
distinct layer spec of a group, naming its layers, with the strides of their
pages. So ``block_bytes`` reads a layer's page from its own spec where the
config has it, else (a collapsed group) from its tensor's page stride, and the
worker proves at start that the scheduler's view gives the same figure
(``check_views``) and that its caches hold it (``worker.register_runner``).
tpu-inference reports every attention page as the cache really lays it out
(``page_size_padded`` from ``get_attention_page_size_bytes``), so the spec
sums are what its arrays hold, heads repeated over TP included.
"""

from __future__ import annotations

import copy

from tpu_offload.core.config import ConfigError


def layer_specs(spec) -> dict[str, object] | None:
    """A ``UniformTypeKVCacheSpecs``'s per-layer specs (None: one spec for every layer of the group)."""
    per = getattr(spec, "kv_cache_specs", None)
    return dict(per) if isinstance(per, dict) and per else None


def first_spec(spec):
    """The spec of a group's first layer: what the scheduler's config holds for the group."""
    per = layer_specs(spec)
    return next(iter(per.values())) if per else spec


def _layout(kv_cache_config, vllm_config):
    """vLLM's resolved KV-cache layout (``KVCacheLayout``), or None when it cannot be told."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        if isinstance(name, str):
            return KVCacheLayout[name]
        cache = getattr(vllm_config, "cache_config", None)
        if cache is not None and hasattr(cache, "get_resolved_kv_cache_layout"):
            return cache.get_resolved_kv_cache_layout()
    except Exception:  # an older vLLM, or a stand-in config: no layout, no tensor strides
        return None
    return None


def tensor_pages(kv_cache_config, vllm_config=None) -> dict[str, int]:
    """Per layer, its page's bytes as the tensors' strides give it (layouts where a page is one run).

    Block-compact layouts only (L and B outermost; vLLM requires one for mixed
    page sizes): the stride of the inner of L and B is one (padded) page."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    layout = _layout(kv_cache_config, vllm_config) if tensors else None
    if layout is None or not getattr(layout, "is_block_compact", False):
        return {}
    block_outer = layout.is_block_outermost
    out: dict[str, int] = {}
    for t in tensors:
        page = int(t.layer_stride if block_outer else t.block_stride)
        for name in t.layers:
            out.setdefault(name, page)
    return out


def block_bytes(kv_cache_config, vllm_config=None) -> int:
    """Bytes of one block over every layer of every group, as the caches hold it (0 if unknown)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    strides = tensor_pages(kv_cache_config, vllm_config)
    total = 0
    for g in groups:
        spec, names = g.kv_cache_spec, list(g.layer_names)
        per = layer_specs(spec)
        if per is not None:
            total += sum(int(per[n].page_size_bytes) for n in names)
            continue
        page = int(spec.page_size_bytes)
        base = strides.get(names[0]) if names else None
        # A collapsed group: its spec is its first layer's; a layer whose page stride differs has another.
        total += sum(page if strides.get(n, base) == base else strides[n] for n in names)
    return total


def scheduler_view(kv_cache_config):
    """The config as vLLM hands it to the scheduler (``generate_scheduler_kv_cache_config``)."""
    cfg = copy.copy(kv_cache_config)
    cfg.kv_cache_groups = [copy.copy(g) for g in kv_cache_config.kv_cache_groups]
    for g in cfg.kv_cache_groups:
        g.kv_cache_spec = first_spec(g.kv_cache_spec)
    return cfg


def check_views(kv_cache_config, vllm_config=None) -> int:
    """The block bytes, proven the same from the worker's and the scheduler's view of the config.

    Raises ``ConfigError`` naming both figures when they differ: the two halves
    would count different slots in one host tier."""
    mine = block_bytes(kv_cache_config, vllm_config)
    theirs = block_bytes(scheduler_view(kv_cache_config), vllm_config) if kv_cache_config is not None else 0
    if mine != theirs:
        raise ConfigError(
            f"KV-cache sizing: the worker's KV-cache spec gives {mine} bytes per block over all layers, the "
            f"scheduler's view of it {theirs}; the two halves would size the host tier differently. "
            "Serve this model without --kv-transfer-config and report it")
    return mine


def check_chunk_bytes(settings, cache_chunk_bytes: int) -> None:
    """At worker registration: the caches must hold what both halves sized the tier by.

    The scheduler hands out ``num_slots`` slots computed from ``chunk_bytes``;
    a worker whose caches disagree would allocate for another count, so this
    is a start-up error naming both figures, never a warning."""
    if settings.chunk_bytes and settings.chunk_bytes != cache_chunk_bytes:
        raise ConfigError(
            f"KV-cache sizing: the KV-cache spec gives {settings.chunk_bytes} bytes per chunk "
            f"({settings.blocks_per_chunk} blocks, the size both halves count {settings.num_slots} host slots "
            f"by), the runner's caches hold {cache_chunk_bytes}. Serve this model without "
            "--kv-transfer-config and report it")
