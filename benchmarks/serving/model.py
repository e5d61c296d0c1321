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


# A chat template for the agentic workload: the tool catalog first (as real templates put it in
# the system turn, so it is part of every call's shared prefix), then each message with its role,
# an assistant's tool calls as text. Plain text, no special tokens: any tokenizer renders it.
CHAT_TEMPLATE = (
    "{% if tools %}<tools> {{ tools | tojson }} </tools>{{ '\n' }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}> "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{{ p['text'] if p['text'] is defined else '' }}{% endfor %}"
    "{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for t in m['tool_calls'] %}"
    " [{{ t['function']['name'] }}({{ t['function']['arguments'] | tojson }})]{% endfor %}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def train_text_tokenizer(path: str, vocab_size: int, corpus_files: list[str]) -> str:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries trained on ``corpus_files``
    (inference-perf's own text: its Shakespeare corpus and agentic theme templates), with
    ``CHAT_TEMPLATE``: the agentic workload sends English chat messages with tool catalogs,
    which the word-level tokenizer would map to ``<unk>`` (every session would then look the
    same to a prefix cache). Any byte sequence encodes, so no prompt is lost."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def agentic_corpus() -> list[str]:
    """inference-perf's shipped text (from ``.venv-bench``): what the agentic generator draws from."""
    import glob

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    venv = os.path.join(root, ".venv-bench")
    found = []
    for pat in ("lib/python3*/site-packages/inference_perf/assets/shakespeare.txt",
                "lib/python3*/site-packages/inference_perf/datagen/synthetic_agentic/synthetic_themes.py"):
        found += sorted(glob.glob(os.path.join(venv, pat)))[:1]
    if len(found) == 2:
        return found
    raise FileNotFoundError("inference-perf's package (.venv-bench) is missing: its text trains the agentic tokenizer")


def build(path: str, model, dtype: str = "float32", tokenizer: str = "wordlevel") -> str:
    """Model (``gpu_offload.tiny_model.TinyLlama``) and tokenizer under ``path``; reused if
    the same spec is already there. ``tokenizer``: ``wordlevel`` (exact round trips of random
    ids, for the token-level workloads) or ``text`` (byte-level BPE with a chat template, for
    the agentic workload's English chat messages)."""
    marker = os.path.join(path, "serving_model.json")
    spec = json.dumps({"model": repr(model), "dtype": dtype,
                       "tokenizer": "wordlevel-v1" if tokenizer == "wordlevel" else "text-bpe-v1"}, sort_keys=True)
    if os.path.exists(marker) and open(marker).read() == spec:
        return path
    model.write(path, dtype=dtype)
    if tokenizer == "wordlevel":
        train_tokenizer(path, model.vocab_size)
    else:
        train_text_tokenizer(path, model.vocab_size, agentic_corpus())
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
