"""A random-weight Llama plus a tokenizer trained here, in one directory (nothing downloaded).

Both the server (vLLM or tpu-inference) and inference-perf load the tokenizer with
``AutoTokenizer``. It is word-level over whitespace-split pseudo-words, so
``encode(decode(ids)) == ids`` exactly: a group's shared prefix tokenizes to the same
ids in every prompt of the group, which is what makes prefix caching (and this
benchmark) meaningful.
"""

from __future__ import annotations

import json
import os

_SYLLABLES = ("ka", "lo", "mi", "nu", "pe", "ra", "so", "ti", "vu", "ze", "ba", "do", "fi", "gu", "he", "jo")
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: LlamaConfig's default bos/eos ids


def _words(n: int) -> list[str]:
    """``n`` distinct pseudo-words, deterministic."""
    out, k = [], 0
    s = len(_SYLLABLES)
    while len(out) < n:
        w, i = "", k
        while True:
            w += _SYLLABLES[i % s]
            i //= s
            if i == 0:
                break
        out.append(w)
        k += 1
    return out


def train_tokenizer(path: str, vocab_size: int, seed: int = 0) -> str:
    """Train a word-level tokenizer of exactly ``vocab_size`` entries on a generated corpus
    and save it (``tokenizer.json`` + config) under ``path``."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = _words(vocab_size - len(SPECIALS))
    rng = np.random.default_rng(seed)
    corpus = [" ".join(rng.choice(words, size=64).tolist()) for _ in range(2000)] + [" ".join(words)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIALS))
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=1 << 20)
    fast.save_pretrained(path)
    return path


def build(path: str, model, dtype: str = "float32") -> str:
    """Model (``gpu_offload.tiny_model.TinyLlama``) and tokenizer under ``path``; reused if
    the same spec is already there."""
    marker = os.path.join(path, "serving_model.json")
    spec = json.dumps({"model": repr(model), "dtype": dtype, "tokenizer": "wordlevel-v1"}, sort_keys=True)
    if os.path.exists(marker) and open(marker).read() == spec:
        return path
    model.write(path, dtype=dtype)
    train_tokenizer(path, model.vocab_size)
    with open(marker, "w") as f:
        f.write(spec)
    return path


def tiny_llama_class():
    """``TinyLlama`` from the project's test helpers (its module moved once already)."""
    try:
        from gpu_offload.testing.tiny_model import TinyLlama
    except ImportError:
        from gpu_offload.tiny_model import TinyLlama
    return TinyLlama


def bench_model():
    """The serving benchmarks' model: prefill costs enough on a CPU core that a cached
    prefix shows, small enough that a configuration runs in minutes on 2 cores."""
    return tiny_llama_class()(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                              intermediate_size=1408, vocab_size=2048, max_position=8192)


if __name__ == "__main__":  # python -m benchmarks.serving.model DIR
    import sys

    print(build(sys.argv[1], bench_model()))
