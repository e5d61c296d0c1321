"""A random-weight Kimi K2.5 (``KimiK25ForConditionalGeneration``): the tiny DeepSeek-V3 beside a vision tower.

Kimi K2.5's text model is DeepSeek-V3's architecture (MLA, grouped sigmoid
MoE); vLLM 0.32 builds it as ``DeepseekV2ForCausalLM`` under
``language_model`` and tpu-inference prefers vLLM's model for this
architecture (``_VLLM_PREFERRED_ARCHITECTURES``). The text weights here are
exactly ``tiny_families.DEEPSEEK_V3``'s, so the two engines must give the
same greedy tokens; the vision tower (MoonViT, 1 layer) and projector are
HF transformers' ``Kimi_K25ForConditionalGeneration`` at random init.
Written in the original checkpoint's names, which vLLM loads
(``language_model.model.layers.*``, ``vision_tower.*``, ``mm_projector.*``):
transformers 5.19 writes them back from its own, except the text layers
(``blocks``, the vision encoder's word), the patch embedding (under
``encoder``) and the projector's ``pre_norm``.
"""

from __future__ import annotations

import json
import os

ARCHITECTURE = "KimiK25ForConditionalGeneration"
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 1}


def write_kimi_k25(path: str, deepseek_dir: str) -> str:
    """Kimi K2.5 under ``path`` with the text weights of the DeepSeek-V3 checkpoint in ``deepseek_dir``."""
    marker = os.path.join(path, "tiny_kimi_k25.json")
    text = json.load(open(os.path.join(deepseek_dir, "config.json")))
    spec = json.dumps({"text": text, "vision": VISION}, sort_keys=True)
    if not (os.path.exists(marker) and open(marker).read() == spec):
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import DeepseekV3Config, Kimi_K25Config, Kimi_K25ForConditionalGeneration
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

        torch.manual_seed(0)
        text_cfg = DeepseekV3Config.from_pretrained(deepseek_dir)
        cfg = Kimi_K25Config(text_config=text_cfg, vision_config=Kimi_K25VisionConfig(**VISION),
                             projection_hidden_size=VISION["hidden_size"], tie_word_embeddings=False)
        hf_dir = os.path.join(path, "hf")  # transformers writes the original names back, but for two
        Kimi_K25ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(hf_dir, safe_serialization=True)
        text_weights = load_file(os.path.join(deepseek_dir, "model.safetensors"))
        weights = {f"language_model.{k}": v for k, v in text_weights.items()}
        for name, p in load_file(os.path.join(hf_dir, "model.safetensors")).items():
            name = name.replace("model.mm_projector.", "mm_projector.")  # its pre_norm keeps the HF prefix
            name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
            if name.startswith(("vision_tower.", "mm_projector.")):
                weights[name] = p
        os.makedirs(path, exist_ok=True)
        save_file(weights, os.path.join(path, "model.safetensors"))
        cfg_dict = cfg.to_dict()
        cfg_dict["architectures"] = [ARCHITECTURE]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg_dict, f, indent=2)
        with open(marker, "w") as f:
            f.write(spec)
    from tpu_offload.testing.tiny_models import write_tokenizer

    write_tokenizer(path, text["vocab_size"])
    return path


class TinyKimiK25:
    """``conftest.MODELS`` entry: the DeepSeek-V3 checkpoint beside it, then Kimi K2.5 from it."""

    name = "kimi-k25"

    def write(self, path: str, dtype: str) -> str:
        from tpu_offload.testing.tiny_families import DEEPSEEK_V3

        assert dtype == "bfloat16", "bf16 only, as DeepSeek-V3"
        return write_kimi_k25(path, DEEPSEEK_V3.write(os.path.join(path, "deepseek-v3"), dtype))


KIMI_K25 = TinyKimiK25()
