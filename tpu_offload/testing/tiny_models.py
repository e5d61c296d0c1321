"""Random-weight Llama and Qwen3 checkpoints written at test time: no download.

Each shape exists to put one engine path under test:

* ``KV4``: 8 query heads over 4 KV heads, so TP 1, 2 and 4 shard whole KV
  heads (the common case);
* ``KV1``: 4 query heads over 1 KV head, so at TP >= 2 tpu-inference
  replicates the KV head on every shard (what Llama-3-8B does at TP 8);
* ``QWEN3``: a second architecture (``Qwen3ForCausalLM``), as ``KV4``;
* ``QWEN3_SERVED``: Qwen3-32B's attention shape (16 query heads per 8 KV
  heads of 128, bf16) with 2 tiny layers, for the served shape: TP 8 on 8
  emulated devices, one KV head per shard, 128-token pages, precompile on.

head_dim is 128 so the engine takes its default RPA v3 cache layout (the
layout a real TPU deployment of these models uses). The weights use a wide
init (0.2) so the next token depends visibly on the KV it attends to: a
corrupted restore then changes the output, and greedy decisions are rarely
near ties. A word-level tokenizer is written next to the weights so the
OpenAI server can serve the model too; tests pass token ids. In
``tpu_offload.testing`` because the demo and the benchmarks serve these models too.
"""

from __future__ import annotations

import dataclasses
import json
import os

from gpu_offload.testing.tiny_model import TinyLlama as _TinyLlama

VOCAB = 1024


@dataclasses.dataclass(frozen=True)
class TinyLlama(_TinyLlama):
    """The project's tiny Llama with this engine's defaults, a name, and a tokenizer beside it."""

    name: str = ""
    head_dim: int = 128
    vocab_size: int = VOCAB
    max_position: int = 4096

    def write(self, path: str, dtype: str) -> str:
        """Config, weights and tokenizer under ``path`` (reused when already there)."""
        super().write(path, dtype)
        write_tokenizer(path, self.vocab_size)
        return path


def write_tokenizer(path: str, vocab_size: int, specials: dict[str, int] | None = None) -> None:
    """A word-level tokenizer: token i is the word ``w{i}`` (ids 0-2 are special, and
    ``specials``' ids are their names: a multimodal model's placeholder tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {i: t for t, i in (specials or {}).items()}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{names.get(i, f"w{i}"): i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=list(specials or ()))
    fast.save_pretrained(path)


@dataclasses.dataclass(frozen=True)
class TinyQwen3(TinyLlama):
    """A random Qwen3 (per-head q/k RMS norms): another class in vLLM's model
    registry and in tpu-inference's, the family the tpu-v7 guide serves."""

    def write(self, path: str, dtype: str) -> str:
        marker = os.path.join(path, "tiny_qwen3.json")
        spec = json.dumps({**dataclasses.asdict(self), "dtype": dtype}, sort_keys=True)
        if not (os.path.exists(marker) and open(marker).read() == spec):
            import torch
            from transformers import Qwen3Config, Qwen3ForCausalLM

            torch.manual_seed(self.seed)
            cfg = Qwen3Config(
                hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                max_position_embeddings=self.max_position, initializer_range=self.init_range,
                tie_word_embeddings=False, torch_dtype=dtype,
            )
            Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
            with open(marker, "w") as f:
                f.write(spec)
        write_tokenizer(path, self.vocab_size)
        return path


KV4 = TinyLlama(name="kv4", num_heads=8, num_kv_heads=4)
KV1 = TinyLlama(name="kv1", num_heads=4, num_kv_heads=1)
QWEN3 = TinyQwen3(name="qwen3", num_heads=8, num_kv_heads=4)
QWEN3_SERVED = TinyQwen3(name="qwen3-served", num_heads=16, num_kv_heads=8)
