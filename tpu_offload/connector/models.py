"""Models whose per-request state is not all paged attention KV: refused at start, with the reason.

A prefix hit restores a request's KV for the prefix and the engine computes
on from there. That is only right if the paged attention KV is all the
state a request carries. Linear-attention hybrids (Qwen3.5-MoE's
gated-delta-net layers, Qwen3-Next, Mamba hybrids) also carry a recurrent
state that summarizes the whole prefix: tpu-inference keeps it in
``MambaSpec`` KV-cache groups, one state slot per running request (or per
block with vLLM's mamba prefix-caching ``align`` mode, which tpu-inference
0.32 does not checkpoint for external loads), and the connector moves
attention blocks only. A restored prefix would continue from a state that
never saw it (or from another request's), so such a model is refused at
engine start, by its KV-cache groups (the engine's own truth) and, where no
KV-cache config is given, by the model config's layer types.
"""

from __future__ import annotations

# vLLM KV-cache spec classes that hold something other than paged attention KV, by class name
# (so a vLLM without one of them still imports this module).
STATE_SPECS = ("MambaSpec",)
# hf_config.layer_types entries of layers that keep a recurrent state instead of a KV cache
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "gated_delta_net")


def _spec_names(spec) -> set[str]:
    names = {c.__name__ for c in type(spec).__mro__}
    for inner in (getattr(spec, "kv_cache_specs", None) or {}).values():
        names |= {c.__name__ for c in type(inner).__mro__}
    return names


def _model_name(vllm_config) -> str:
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_config", None)
    archs = list(getattr(hf, "architectures", None) or ())
    name = repr(getattr(model, "model", "?"))
    return f"{name} ({', '.join(archs)})" if archs else name


def unsupported_model(vllm_config, kv_cache_config) -> str | None:
    """Why this model cannot be offloaded (None: it can)."""
    state: dict[str, list[str]] = {}  # spec class -> its layers, over every group
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        for name in sorted(_spec_names(g.kv_cache_spec) & set(STATE_SPECS)):
            state.setdefault(name, []).extend(g.layer_names)
    if state:
        kind, layers = next(iter(state.items()))
        return _refusal(vllm_config, f"{len(layers)} layers in {kind} KV-cache groups (e.g. {layers[0]!r})")
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_config", None)
    text = getattr(hf, "text_config", None) or hf
    types = [t for t in (getattr(text, "layer_types", None) or ()) if t in RECURRENT_LAYER_TYPES]
    if types:
        return _refusal(vllm_config, f"{len(types)} {types[0]} layers (hf_config layer_types)")
    return None


def _refusal(vllm_config, what: str) -> str:
    return (f"model {_model_name(vllm_config)} keeps a recurrent state besides its attention KV: {what}. "
            "A prefix hit needs that state at the hit's end, which tpu-inference keeps per running request, "
            "not per block, and the offload connector stores paged attention KV only, so a restored prefix "
            "would continue from a state that never saw it. Serve this model without --kv-transfer-config")
