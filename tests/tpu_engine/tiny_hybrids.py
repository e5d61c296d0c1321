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

from tpu_offload.testing.tiny_models import VOCAB, write_tokenizer

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


# ---- more of tpu-inference 0.32's registry, for the full-tier test --------------------------------
import dataclasses  # noqa: E402

from tpu_offload.testing.tiny_families import TinyFamily  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TinyQwen2(TinyFamily):
    """Qwen2 (q/k/v biases) on tpu-inference's JAX path (``Qwen2ForCausalLM``). Tied embeddings:
    its JAX model builds an untied ``lm_head`` with ``getattr(hf_config, 'hidden_size',
    hf_config.text_config.hidden_size)``, whose default is evaluated first and raises for a plain
    Qwen2 config ("'Qwen2Config' object has no attribute 'text_config'")."""

    def hf_config(self, dtype: str):
        from transformers import Qwen2Config

        return Qwen2Config(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                           num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                           intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                           max_position_embeddings=self.max_position, initializer_range=self.init_range,
                           tie_word_embeddings=True, dtype=dtype)


QWEN2 = TinyQwen2(name="qwen2", architecture="Qwen2ForCausalLM", hidden_size=256, num_heads=2, num_kv_heads=2,
                  head_dim=128)
REGISTRY_EXTRA = {f.name: f for f in (QWEN2,)}
