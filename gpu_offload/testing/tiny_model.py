"""A random-weight Llama written to disk, so demos and tests need no download.

vLLM's CPU attention needs ``head_dim >= 64``. Weights use a larger init
range than a trained model's default (0.02) so the next token depends
visibly on the KV it attends to: a corrupted restore then changes the output.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position: int = 8192
    init_range: float = 0.2
    seed: int = 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def write(self, path: str, dtype: str = "float32") -> str:
        """Save config + weights under ``path`` (reused if already there)."""
        marker = os.path.join(path, "tiny_llama.json")
        spec = json.dumps({**dataclasses.asdict(self), "dtype": dtype}, sort_keys=True)
        if os.path.exists(marker) and open(marker).read() == spec:
            return path
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(self.seed)
        cfg = LlamaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position,
            initializer_range=self.init_range,
            tie_word_embeddings=False,
            torch_dtype=dtype,
        )
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        with open(marker, "w") as f:
            f.write(spec)
        return path


@dataclasses.dataclass(frozen=True)
class TinyGemma3:
    """A random Gemma-3-like text model: sliding-window and full-attention layers,
    so vLLM gives it two KV-cache groups (a hybrid model for the offloading path)."""

    hidden_size: int = 256
    num_layers: int = 2  # layer i: sliding if i is even, full if odd
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position: int = 4096
    sliding_window: int = 128
    init_range: float = 0.2
    seed: int = 0

    def write(self, path: str, dtype: str = "float32") -> str:
        marker = os.path.join(path, "tiny_gemma3.json")
        spec = json.dumps({**dataclasses.asdict(self), "dtype": dtype}, sort_keys=True)
        if os.path.exists(marker) and open(marker).read() == spec:
            return path
        import torch
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        torch.manual_seed(self.seed)
        cfg = Gemma3TextConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position,
            sliding_window=self.sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)],
            initializer_range=self.init_range,
            tie_word_embeddings=True,
            torch_dtype=dtype,
        )
        model = Gemma3ForCausalLM(cfg).to(getattr(torch, dtype))
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        with open(marker, "w") as f:
            f.write(spec)
        return path
