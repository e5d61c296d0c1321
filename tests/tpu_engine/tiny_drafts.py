"""A random-weight EAGLE-3 drafter for the tiny Llama target (``tiny_models.KV4``).

tpu-inference 0.32 registers three speculative-decoding drafters with a
model of their own (``Eagle3LlamaForCausalLM``, ``Gemma4MTPModel``,
``DFlashForCausalLM``). EAGLE-3 is the one its JAX path builds for a plain
Llama target: one decoder layer whose attention reads ``[embedding |
hidden]`` (2 x hidden wide), an ``fc`` folding three of the target's hidden
states into one, its own norm and ``lm_head`` over a draft vocabulary, and
``d2t`` (draft id -> target id offsets). Written as EAGLE-3 checkpoints come
(``LlamaForCausalLM`` in config.json, weights under ``midlayer.``; vLLM's
``EAGLEConfig`` renames the architecture to ``Eagle3LlamaForCausalLM``).
The embedding is not stored: the drafter shares the target's.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tpu_offload.testing.tiny_models import KV4, VOCAB


def write_eagle3(path: str, target=KV4, init: float = 0.05) -> str:
    """Config and weights of an EAGLE-3 drafter for ``target`` under ``path`` (reused when there)."""
    h, heads, kv_heads, hd, inter = (target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim,
                                     target.intermediate_size)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd,
           "intermediate_size": inter, "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": VOCAB,
           "max_position_embeddings": target.max_position, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    marker = os.path.join(path, "tiny_eagle3.json")
    spec = json.dumps({**cfg, "init": init}, sort_keys=True)
    if os.path.exists(marker) and open(marker).read() == spec:
        return path
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * init).to(torch.bfloat16)

    def norm():
        return (1 + torch.randn(h, generator=g) * 0.1).to(torch.bfloat16)

    weights = {
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": norm(), "fc.weight": w(h, 3 * h), "lm_head.weight": w(VOCAB, h),
        "d2t": torch.zeros(VOCAB, dtype=torch.int64),  # draft vocabulary = the target's
        "t2d": torch.ones(VOCAB, dtype=torch.bool),
    }
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(marker, "w") as f:
        f.write(spec)
    return path


# The target: the tiny Llama with 8 layers. tpu-inference's Llama hands EAGLE-3 the hidden states
# entering layers (2, n // 2, n - 3), three distinct layers only from n = 7 (fewer, and the
# drafter's fc gets a narrower input than the 3 x hidden it was built for).
EAGLE3_TARGET = dataclasses.replace(KV4, name="kv4-8-layers", num_layers=8)
