"""Random-weight checkpoints of the other model families tpu-inference 0.32 serves in JAX.

``tiny_models`` covers the dense GQA families (Llama, Qwen3). Each family
here adds an attention or cache layout of its own to the engine under test:

* ``GPT_OSS`` (``GptOssForCausalLM``): head_dim 64, so tpu-inference takes
  its head_dim-64 RPA kernel and cache layout (``[K | V]`` in one 128-lane
  row per head); a learned attention sink per query head; sliding-window
  (even) and full (odd) layers; a small MoE (4 experts, top 2).
* ``GEMMA4`` (``Gemma4ForCausalLM``, text only): sliding layers and a global
  layer with a larger head_dim (so two KV cache page shapes in one model),
  q/k/v norms, partial rope on the global layer, final-logit soft cap.

Sizes: hidden 128, 2-3 layers, vocab ``tiny_models.VOCAB``, so an engine
starts in seconds. Sliding windows are 32 tokens, so prompts of a few
hundred tokens reach well past them. Weights use ``tiny_models``' wide init
(0.2), and every parameter HF initializes to a constant (biases, norm
scales, sinks' neighbours) gets noise around that constant, so a weight
the engine loads into the wrong place changes the tokens. A checkpoint is
reused when its marker file (the family's spec and dtype) matches.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tiny_models import VOCAB, write_tokenizer

CONSTANT_NOISE = 0.2  # std of the noise added to parameters HF initializes to a constant


@dataclasses.dataclass(frozen=True)
class TinyFamily:
    """One family's tiny checkpoint: an HF config, random weights, a tokenizer."""

    name: str
    architecture: str
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 128
    sliding_window: int = 32
    vocab_size: int = VOCAB
    max_position: int = 4096
    init_range: float = 0.2
    seed: int = 0
    engine_env: tuple[tuple[str, str], ...] = ()  # environment the engine needs for this family
    hf_class: str = ""  # HF's class for the checkpoint, when the engine serves it as another architecture
    served_architecture: str = ""  # the architecture config.json names for the engine (default: HF's class)
    bf16_only: bool = False  # the engine cannot run this family in float32

    def hf_config(self, dtype: str):
        raise NotImplementedError

    def write(self, path: str, dtype: str) -> str:
        """Config, weights and tokenizer under ``path`` (reused when already there)."""
        marker = os.path.join(path, f"tiny_{self.name}.json")
        spec = json.dumps({**dataclasses.asdict(self), "dtype": dtype}, sort_keys=True)
        if not (os.path.exists(marker) and open(marker).read() == spec):
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(self.seed)
            model = AutoModelForCausalLM.from_config(self.hf_config(dtype), dtype=torch.float32)
            assert type(model).__name__ == (self.hf_class or self.architecture), type(model).__name__
            _noise_on_constants(model)
            model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
            if self.served_architecture:
                _serve_as(path, self.served_architecture)
            with open(marker, "w") as f:
                f.write(spec)
        write_tokenizer(path, self.vocab_size)
        return path


def _serve_as(path: str, architecture: str) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = [architecture]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _noise_on_constants(model) -> None:
    """Parameters HF initializes to one value (zeros, ones) get noise around it."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=g) * CONSTANT_NOISE)


@dataclasses.dataclass(frozen=True)
class TinyGptOss(TinyFamily):
    """gpt-oss as tpu-inference serves it: ``MODEL_IMPL_TYPE=auto`` resolves to its
    vLLM-model (torchax) path for this architecture. Its own JAX model
    (``models/jax/gpt_oss.py``, ``MODEL_IMPL_TYPE=flax_nnx``) cannot load an
    unquantized checkpoint with the flax it pins (0.12.10): ``_load_regular_param``
    reads ``param.sharding`` (now the array's, ``None`` on the abstract model)
    for the partition spec: "jax.P() argument after * must be an iterable, not
    NoneType". bf16 only: the vLLM-model path frees each torch weight after
    moving it to JAX (``untyped_storage().resize_(0)``), and a float32 weight
    went through ``tensor.numpy()``, which makes torch mark its storage not
    resizable ("Trying to resize storage that is not resizable", on any
    device); bf16 takes a copy instead."""

    bf16_only: bool = True
    num_experts: int = 4
    experts_per_token: int = 2

    def hf_config(self, dtype: str):
        from transformers import GptOssConfig

        return GptOssConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, num_local_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token, vocab_size=self.vocab_size,
            sliding_window=self.sliding_window, max_position_embeddings=self.max_position,
            initializer_range=self.init_range, tie_word_embeddings=False, dtype=dtype,
        )


@dataclasses.dataclass(frozen=True)
class TinyGemma4(TinyFamily):
    """Gemma 4 as its checkpoints come (``Gemma4ForConditionalGeneration``: the
    text model under ``model.language_model``, a vision tower beside it),
    served text-only: ``config.json`` names ``Gemma4ForCausalLM``, the class
    tpu-inference registers for that (its loader reads ``hf_config.text_config``
    and skips the vision weights). HF's auto class for the same directory is
    the whole ``Gemma4ForConditionalGeneration``; text prompts never reach its
    vision tower."""

    layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention", "full_attention")
    global_head_dim: int = 256
    soft_cap: float = 30.0
    served_architecture: str = "Gemma4ForCausalLM"

    def hf_config(self, dtype: str):
        from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

        text = Gemma4TextConfig(
            hidden_size=self.hidden_size, num_hidden_layers=len(self.layer_types), layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            global_head_dim=self.global_head_dim, intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size, vocab_size_per_layer_input=self.vocab_size, hidden_size_per_layer_input=0,
            sliding_window=self.sliding_window, max_position_embeddings=self.max_position,
            final_logit_softcapping=self.soft_cap, initializer_range=self.init_range,
            tie_word_embeddings=False, dtype=dtype,
        )
        vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=16)
        # Untied: with random weights, logits = final_norm(h) . E and h dominated by the scaled input
        # embedding just copy the last token (the real checkpoints tie them).
        return Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                            initializer_range=self.init_range, tie_word_embeddings=False, dtype=dtype)


# bf16 only (see TinyGptOss), and at init 0.2 this model is chaotic in bf16 (HF's own bf16 and
# float32 logits then differ by up to ~4 at the 99th percentile, against a median top-2 margin of
# 0.4); at 0.05 they differ by 0.03 against a median margin of 0.13.
GPT_OSS = TinyGptOss(name="gpt-oss", architecture="GptOssForCausalLM", init_range=0.05)

GEMMA4 = TinyGemma4(name="gemma4", architecture="Gemma4ForCausalLM", hf_class="Gemma4ForConditionalGeneration",
                    head_dim=128)

FAMILIES = {f.name: f for f in (GPT_OSS, GEMMA4)}
