"""Demo: vLLM restores a shared prompt prefix from our host tier.

    python -m gpu_offload.demo

Builds a random Llama in a temp dir (no download), runs real vLLM in this
process with ``HostOffloadSpec``, sends 4 prompts that share a 1.5K-token
prefix (their KV goes to the host tier), empties vLLM's prefix cache, sends
them again (their KV now comes back from the host tier) and prints TTFT
recompute vs restored, tokens served by the tier, bytes moved and whether
the outputs are identical. On a CPU-only machine it runs on vLLM's CPU
backend; both runs use the same warmed-up engine.

CPU thread binding: vLLM's CPU platform reserves one more core for any
engine with a kv-transfer-config, which on a small machine alone changes
speed. ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is therefore set explicitly (default
1 here) so every configuration runs on the same cores.

Reading the table: TTFT is vLLM's per-request ``first_token_latency``. When
restoring, request 0 loads the shared prefix; vLLM holds the other three
until that load lands (it never loads one chunk twice at once), then they
take the prefix from its own cache and load only their own last chunk, so
their TTFT includes one more engine step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same cores with and without offloading

import numpy as np  # noqa: E402

from gpu_offload.testing.tiny_model import TinyLlama  # noqa: E402
from gpu_offload.vllm.selection import kv_transfer_config  # noqa: E402

# Big enough that prefill costs what it does in a real model per layer,
# small enough to build and run on 2 CPU cores in well under 2 minutes.
DEMO_MODEL = TinyLlama(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                       intermediate_size=2816, vocab_size=2048, max_position=8192)


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` entries next to the model.

    The prompts are token ids, so the engine needs no tokenizer to run; but
    without one (``skip_tokenizer_init``) vLLM's renderer warm-up logs a
    13-line traceback a new user reads as a failure.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            model_max_length=1 << 20).save_pretrained(path)


def make_prompts(n: int, prefix: int, suffix: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, size=prefix).tolist()
    return [{"prompt_token_ids": shared + rng.integers(1, vocab, size=suffix).tolist()} for _ in range(n)]


def run(llm, prompts, max_tokens: int = 8):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    ttft = [o.metrics.first_token_latency if o.metrics else float("nan") for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], ttft, [o.num_cached_tokens or 0 for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--suffix", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args(argv)

    from vllm import LLM

    from gpu_offload import testing

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpu_offload_demo_") as tmp:
        m = DEMO_MODEL
        print(f"building random Llama: hidden {m.hidden_size}, {m.num_layers} layers, "
              f"{m.num_heads} heads / {m.num_kv_heads} KV heads x {m.head_dim}, float32 ...", flush=True)
        path = m.write(os.path.join(tmp, "model"))
        write_tokenizer(path, m.vocab_size)
        max_len = args.prefix + args.suffix + 64
        llm = LLM(model=path, dtype="float32", max_model_len=max_len,
                  enforce_eager=True, max_num_seqs=args.prompts, disable_log_stats=False,
                  kv_transfer_config=kv_transfer_config(1 << 30))
        worker = testing.live_workers()[-1]

        warm = make_prompts(args.prompts, args.prefix, args.suffix, m.vocab_size, seed=99)
        run(llm, warm, max_tokens=2)  # warm-up: kernels, allocator; its chunks are not reused
        prompts = make_prompts(args.prompts, args.prefix, args.suffix, m.vocab_size, seed=1)

        s0 = dict(vars(worker.stats))
        out_a, ttft_a, _ = run(llm, prompts)  # recompute, and store
        stored = worker.stats.stored_bytes - s0["stored_bytes"]
        llm.reset_prefix_cache()  # vLLM's own cache is empty now; our tier is not
        s1 = dict(vars(worker.stats))
        out_b, ttft_b, cached_b = run(llm, prompts)  # restore from the host tier
        hit_tokens = worker.stats.loaded_tokens - s1["loaded_tokens"]  # what actually landed
        loaded = worker.stats.loaded_bytes - s1["loaded_bytes"]
        load_s = worker.stats.load_seconds - s1["load_seconds"]

        n_tok = len(prompts[0]["prompt_token_ids"])
        print()
        print(f"{args.prompts} prompts x {n_tok} tokens ({args.prefix} shared + {args.suffix} unique), "
              f"sent together, 8 new tokens each, vLLM on {worker.device.type}")
        print(f"{'request':>8} {'TTFT recompute':>15} {'TTFT restored':>14} {'speedup':>8} {'cached tokens':>14}")
        for i, (a, b, c) in enumerate(zip(ttft_a, ttft_b, cached_b)):
            print(f"{i:>8} {a * 1e3:>12.1f} ms {b * 1e3:>11.1f} ms {a / b:>7.1f}x {c:>14}")
        a, b = max(ttft_a), max(ttft_b)
        print(f"{'all':>8} {a * 1e3:>12.1f} ms {b * 1e3:>11.1f} ms {a / b:>7.1f}x   (until the last first token)")
        print()
        print(f"tokens served from the host tier : {hit_tokens}")
        print(f"bytes stored  (device -> host)   : {stored / 2**20:.1f} MiB")
        print(f"bytes loaded  (host -> device)   : {loaded / 2**20:.1f} MiB in {load_s * 1e3:.1f} ms")
        print(f"load errors                      : {worker.stats.load_error_blocks}")
        same = out_a == out_b
        print(f"outputs identical                : {'yes' if same else 'NO'}")
        print(f"total demo time                  : {time.perf_counter() - t_start:.0f} s")
        return 0 if same and hit_tokens > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
