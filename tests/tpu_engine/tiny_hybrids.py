"""A random-weight Qwen3.5-MoE: linear-attention (gated-delta-net) layers beside attention layers.

Written as its checkpoints come (``Qwen3_5MoeForConditionalGeneration``, a
tiny vision tower beside the text model, and the image and video processor
configs vLLM's multimodal processor reads), so tpu-inference takes the path
it prefers for this architecture (the vLLM model, ``_VLLM_PREFERRED_ARCHITECTURES``).
Four text layers: three gated-delta-net, one full attention (HF's default
``full_attention_interval`` 4), a 4-expert MoE. bf16, as every
vLLM-model-path family here.
"""

from __future__ import annotations

import json
import os

from tiny_models import VOCAB, write_tokenizer

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
SPEC = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "initializer_range": 0.05, "tie_word_embeddings": False}


def write_qwen3_5_moe(path: str) -> str:
    marker = os.path.join(path, "tiny_qwen3_5_moe.json")
    spec = json.dumps(SPEC, sort_keys=True)
    if not (os.path.exists(marker) and open(marker).read() == spec):
        import torch
        from transformers import (Qwen2VLImageProcessor, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                                  Qwen3_5MoeTextConfig, Qwen3_5MoeVisionConfig, Qwen3VLVideoProcessor)

        torch.manual_seed(0)
        vision = Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                        out_hidden_size=SPEC["hidden_size"])
        cfg = Qwen3_5MoeConfig(text_config=Qwen3_5MoeTextConfig(**SPEC), vision_config=vision,
                               tie_word_embeddings=False)
        model = Qwen3_5MoeForConditionalGeneration(cfg)
        assert type(model).__name__ == ARCHITECTURE
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        Qwen2VLImageProcessor().save_pretrained(path)
        Qwen3VLVideoProcessor().save_pretrained(path)
        with open(marker, "w") as f:
            f.write(spec)
    write_tokenizer(path, VOCAB)
    return path
