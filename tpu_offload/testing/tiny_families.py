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
* ``GEMMA4_MM``, ``LLAMA_GUARD4``, ``QWEN2_5_VL``: the multimodal classes of
  tpu-inference's registry (``Gemma4ForConditionalGeneration``,
  ``Llama4ForConditionalGeneration`` -> its ``LlamaGuard4ForCausalLM``,
  ``Qwen2_5_VLForConditionalGeneration``), each with a tiny vision tower the
  engine builds and loads. A KV connector with a consumer role makes vLLM
  accept embedding inputs (``VllmConfig._resolve_mm_embedding_inputs``), so
  it builds the multimodal processor even for a language-model-only engine:
  these engines load the tokenizer and the processor configs written here.

Sizes: hidden 128, 2-3 layers, vocab ``tiny_models.VOCAB``, so an engine
starts in seconds. Sliding windows are 32 tokens, so prompts of a few
hundred tokens reach well past them. Weights use ``tiny_models``' wide init
(0.2), and every parameter HF initializes to a constant (biases, norm
scales, sinks' neighbours) gets noise around that constant, so a weight
the engine loads into the wrong place changes the tokens. A checkpoint is
reused when its marker file (the family's spec and dtype) matches.
In ``tpu_offload.testing`` because the MLA and sliding-window benchmarks serve these families.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from tpu_offload.testing.tiny_models import VOCAB, write_tokenizer

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
    engine_kwargs: tuple[tuple[str, object], ...] = ()  # vllm.LLM arguments the engine needs for this family
    block_size: int = 16  # KV block size the family's engine runs with
    mla: bool = False  # multi-head latent attention (our connector refuses it)

    def hf_config(self, dtype: str):
        raise NotImplementedError

    def write(self, path: str, dtype: str) -> str:
        """Config, weights and tokenizer under ``path`` (reused when already there)."""
        marker = os.path.join(path, f"tiny_{self.name}.json")
        spec = json.dumps({**dataclasses.asdict(self), "dtype": dtype}, sort_keys=True)
        if not (os.path.exists(marker) and open(marker).read() == spec):
            import torch

            torch.manual_seed(self.seed)
            cls = self.hf_model_class()
            cfg = self.hf_config(dtype)
            model = cls.from_config(cfg, dtype=torch.float32) if hasattr(cls, "from_config") else cls(cfg).float()
            assert type(model).__name__ == (self.hf_class or self.architecture), type(model).__name__
            _noise_on_constants(model)
            model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
            if self.served_architecture:
                _serve_as(path, self.served_architecture)
            with open(marker, "w") as f:
                f.write(spec)
        write_tokenizer(path, self.vocab_size)
        self.write_processor(path)
        return path

    def write_processor(self, path: str) -> None:
        """The image (and video) processor configs vLLM's multimodal processor reads (none: text only)."""

    def hf_model_class(self):
        """HF's class for this checkpoint (also what the HF reference loads it with)."""
        import transformers

        return getattr(transformers, self.hf_class) if self.hf_class else transformers.AutoModelForCausalLM


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
                                    num_key_value_heads=2, head_dim=16,
                                    # as Gemma 4's own config.json; tpu-inference's multimodal model reads it
                                    default_output_length=280)
        # Untied: with random weights, logits = final_norm(h) . E and h dominated by the scaled input
        # embedding just copy the last token (the real checkpoints tie them).
        return Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                            initializer_range=self.init_range, tie_word_embeddings=False, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TinyDeepseekV3(TinyFamily):
    """DeepSeek-V3: multi-head latent attention (a 64-wide compressed KV and a
    32-wide roped key per token, one latent cache row per token for all
    heads), a dense first layer (``first_k_dense_replace``), then MoE layers
    with grouped top-k sigmoid routing and a shared expert.

    Served through tpu-inference's vLLM-model path (``MODEL_IMPL_TYPE=vllm``).
    Its JAX model (``models/jax/deepseek_v3.py``) cannot build a tiny one: it
    takes every size from module constants fixed to DeepSeek-V3-671B (hidden
    7168, 256 experts, vocab 129280, kv_lora_rank 512: "TODO: read these
    configs from HF config"), and its MLA weight loader splits ``kv_b_proj``
    only for an FP8 block-quantized checkpoint (``MLAEinsum.load_weights``
    asserts a quant config). tpu-inference serves any MLA model only with
    ``NEW_MODEL_DESIGN=1`` and DP attention on (``TpuPlatform.check_and_update_config``).
    Latent-cache pages hold ``MLA_KV_PACKING_SIZE`` (32) tokens per row, so
    the block size is 32. bf16 only, as every vLLM-model-path family.

    The KV cache is fp8 (``kv_cache_dtype="fp8"``): on that path MLA needs an
    8-bit cache. With ``auto`` (or ``bfloat16``) its MLA layer still
    "quantizes" the absorbed key/value up-projections to the cache dtype
    (``quantize_tensor(self.kv_cache_quantized_dtype, ...)`` with dtype None),
    dividing by ``finfo(None).max`` (float64's), so every scale is 0 in
    float32, every absorbed query 0 and the logits NaN (seen here: token 0
    forever), on any device.

    Routing: top-2 of 8 experts in 4 groups (top-2 groups), sigmoid scores
    with a correction bias. A near-tie between two experts flips under bf16
    and moves the logits by up to ~1 at the default ``routed_scaling_factor``
    2.5 (HF's own bf16 run flips 20 of 380 argmaxes against its float32 run);
    at 0.1 the routed experts still count, and engine and HF agree wherever
    HF's margin is above ~0.07."""

    bf16_only: bool = True
    mla: bool = True
    block_size: int = 32
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    num_experts: int = 8
    experts_per_token: int = 2
    n_group: int = 4
    topk_group: int = 2
    moe_intermediate_size: int = 64
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 0.1

    def hf_config(self, dtype: str):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, n_routed_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
            n_group=self.n_group, topk_group=self.topk_group, n_shared_experts=1,
            moe_intermediate_size=self.moe_intermediate_size, intermediate_size=self.intermediate_size,
            first_k_dense_replace=self.first_k_dense_replace, routed_scaling_factor=self.routed_scaling_factor,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position, initializer_range=self.init_range,
            tie_word_embeddings=False, dtype=dtype,
            # what DeepSeek-V3's own config.json says, and what HF's model always does; vLLM reads
            # them to build the router's score-correction bias and sigmoid scoring
            topk_method="noaux_tc", scoring_func="sigmoid",
        )


@dataclasses.dataclass(frozen=True)
class TinyLlama4(TinyFamily):
    """Llama 4 (Scout/Maverick text model): every 4th layer without rope, the
    others with rope and per-head L2 q/k norms; MoE layers (top-1 sigmoid
    router plus a shared expert) interleaved with dense ones. Written as HF
    writes Llama 4 checkpoints (``Llama4ForConditionalGeneration``, the text
    model under ``language_model``, a tiny vision tower beside it) and served
    text-only as ``Llama4ForCausalLM``, which tpu-inference's JAX model loads
    (it reads ``hf_config.text_config`` and keeps ``language_model`` weights).
    That model hard-codes rope theta 500000, NoPE every 4th layer and top-1
    routing, which this config matches. bf16 only (its dtype is fixed)."""

    bf16_only: bool = True
    served_architecture: str = "Llama4ForCausalLM"
    num_experts: int = 4
    intermediate_size_mlp: int = 256
    interleave_moe_layer_step: int = 2

    def hf_config(self, dtype: str):
        from transformers import Llama4Config, Llama4TextConfig, Llama4VisionConfig

        text = Llama4TextConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            intermediate_size_mlp=self.intermediate_size_mlp, num_local_experts=self.num_experts,
            num_experts_per_tok=1, interleave_moe_layer_step=self.interleave_moe_layer_step,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position,
            initializer_range=self.init_range, tie_word_embeddings=False, dtype=dtype,
        )
        vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                    projector_output_dim=32)
        return Llama4Config(text_config=text, vision_config=vision, initializer_range=self.init_range,
                            tie_word_embeddings=False, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TinyLlamaGuard4(TinyFamily):
    """Llama Guard 4 (``Llama4ForConditionalGeneration``, which tpu-inference's registry maps to
    its JAX ``LlamaGuard4ForCausalLM``): Llama 4's text model made dense (no MoE layer), rope
    and per-head L2 q/k norms on every layer, and the Llama 4 vision tower and projector
    beside it. tpu-inference's model reads the layer count from ``text_config.num_layers``
    (default 48, Llama Guard 4's own), which HF's config does not define, so the tiny config
    carries it too; its dense MLP is ``intermediate_size`` wide, HF's ``intermediate_size_mlp``,
    so both are equal (as in Llama Guard 4's config). bf16 only (its dtype is fixed)."""

    bf16_only: bool = True

    def hf_config(self, dtype: str):
        from transformers import Llama4Config, Llama4TextConfig, Llama4VisionConfig

        text = Llama4TextConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, intermediate_size_mlp=self.intermediate_size,
            moe_layers=[], no_rope_layers=[1] * self.num_layers, vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position, initializer_range=self.init_range,
            tie_word_embeddings=False, dtype=dtype,
        )
        vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                    projector_output_dim=32)
        return Llama4Config(text_config=text, vision_config=vision, initializer_range=self.init_range,
                            tie_word_embeddings=False, dtype=dtype)

    def write_processor(self, path: str) -> None:
        from transformers import Llama4ImageProcessor

        Llama4ImageProcessor().save_pretrained(path)


QWEN_VL_TOKENS = {"<|image_pad|>": VOCAB, "<|video_pad|>": VOCAB + 1, "<|vision_start|>": VOCAB + 2,
                  "<|vision_end|>": VOCAB + 3}


@dataclasses.dataclass(frozen=True)
class TinyQwen25VL(TinyFamily):
    """Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, tpu-inference's JAX model): Qwen2's text
    model (q/k/v biases) with M-RoPE (the head's rotary half split into temporal, height and
    width sections; a text token has all three positions equal), and a one-block vision tower
    whose merger projects into the text model's width. Its image, video and vision-start ids
    lie just past the prompts' range (``VOCAB`` and up), so a random prompt never holds one."""

    mrope_section: tuple[int, ...] = (16, 24, 24)  # Qwen2.5-VL's own, for head_dim 128

    def hf_config(self, dtype: str):
        from transformers import Qwen2_5_VLConfig

        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(self.mrope_section)}
        text = dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                    max_position_embeddings=self.max_position, initializer_range=self.init_range,
                    rope_parameters=rope, tie_word_embeddings=False, dtype=dtype)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=self.hidden_size,
                      fullatt_block_indexes=[0], initializer_range=self.init_range)
        t = QWEN_VL_TOKENS
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=t["<|image_pad|>"],
                                video_token_id=t["<|video_pad|>"], vision_start_token_id=t["<|vision_start|>"],
                                vision_end_token_id=t["<|vision_end|>"], tie_word_embeddings=False, dtype=dtype)

    def write_processor(self, path: str) -> None:
        from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        write_tokenizer(path, self.vocab_size, QWEN_VL_TOKENS)
        Qwen2VLImageProcessor().save_pretrained(path)
        Qwen2VLVideoProcessor().save_pretrained(path)


# bf16 only (see TinyGptOss), and at init 0.2 this model is chaotic in bf16 (HF's own bf16 and
# float32 logits then differ by up to ~4 at the 99th percentile, against a median top-2 margin of
# 0.4); at 0.05 they differ by 0.03 against a median margin of 0.13.
GPT_OSS = TinyGptOss(name="gpt-oss", architecture="GptOssForCausalLM", init_range=0.05)

GEMMA4 = TinyGemma4(name="gemma4", architecture="Gemma4ForCausalLM", hf_class="Gemma4ForConditionalGeneration",
                    head_dim=128)

DEEPSEEK_V3 = TinyDeepseekV3(
    name="deepseek-v3", architecture="DeepseekV3ForCausalLM", num_layers=3, init_range=0.05,
    engine_env=(("MODEL_IMPL_TYPE", "vllm"), ("NEW_MODEL_DESIGN", "1")),
    engine_kwargs=(("additional_config", {"sharding": {"sharding_strategy": {"enable_dp_attention": True}}}),
                   ("kv_cache_dtype", "fp8")),
)

LLAMA4 = TinyLlama4(name="llama4", architecture="Llama4ForCausalLM", hf_class="Llama4ForConditionalGeneration",
                    num_layers=4, head_dim=128, init_range=0.05,
                    # its shardings name the 'expert' mesh axis, which only the new model design's mesh has
                    engine_env=(("NEW_MODEL_DESIGN", "1"),))

# The multimodal architectures, served as their checkpoints name them (text prompts; vLLM's multimodal
# processor needs a real tokenizer, so the engine serves the language model only: the vision tower is
# still built and loaded).
MM = (("language_model_only", True), ("skip_tokenizer_init", False))
GEMMA4_MM = dataclasses.replace(GEMMA4, name="gemma4-mm", architecture="Gemma4ForConditionalGeneration",
                                served_architecture="", engine_kwargs=MM)
LLAMA_GUARD4 = TinyLlamaGuard4(name="llama-guard4", architecture="Llama4ForConditionalGeneration",
                               hf_class="Llama4ForConditionalGeneration", head_dim=128, init_range=0.05,
                               engine_kwargs=MM)
QWEN2_5_VL = TinyQwen25VL(name="qwen2.5-vl", architecture="Qwen2_5_VLForConditionalGeneration",
                          hf_class="Qwen2_5_VLForConditionalGeneration", hidden_size=256, num_heads=2,
                          num_kv_heads=2, head_dim=128, vocab_size=VOCAB + 4, engine_kwargs=MM)

FAMILIES = {f.name: f for f in (GPT_OSS, GEMMA4, DEEPSEEK_V3, LLAMA4, GEMMA4_MM, LLAMA_GUARD4, QWEN2_5_VL)}
ENGINE_ENV_KEYS = frozenset(k for f in FAMILIES.values() for k, _ in f.engine_env)


def use_engine_env(family: TinyFamily | None) -> None:
    """``family``'s engine environment and nothing left from another family's (None: no
    family's). tpu-inference picks its sharding axis names once per process
    (``layers/common/sharding.py:ShardingAxisName``, lazily, from NEW_MODEL_DESIGN): a
    server runs one model, a test process several, so the choice is made afresh."""
    for k in ENGINE_ENV_KEYS:
        os.environ.pop(k, None)
    if family is not None:
        os.environ.update(dict(family.engine_env))
    sharding = sys.modules.get("tpu_inference.layers.common.sharding")  # not imported yet: nothing chosen
    if sharding is not None:
        sharding.ShardingAxisName._cls = None


# ---- tpu-inference's vLLM-preferred MoE families (appended) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class TinyQwen3Moe(TinyFamily):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms, GQA) with a
    sparse MoE in every layer (softmax top-k, renormalized). tpu-inference has no
    JAX model for it and prefers vLLM's (``_VLLM_PREFERRED_ARCHITECTURES``), so
    it runs on the vLLM-model (torchax) path: bf16 only, as gpt-oss.

    Every expert is routed to (top-4 of 4, softmax weights renormalized): with
    top-2, a near-tie between experts flips under bf16 (the engine and HF's own
    bf16 run then left HF's float32 choice in 8 of 96 steps, once at a top-2
    margin of 0.18); with all experts the router's weights still scale each
    expert, and the engine leaves float32 HF only at margins below 0.015."""

    bf16_only: bool = True
    num_experts: int = 4
    experts_per_token: int = 4
    moe_intermediate_size: int = 64

    def hf_config(self, dtype: str):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token, norm_topk_prob=True, decoder_sparse_step=1,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position,
            initializer_range=self.init_range, tie_word_embeddings=False, dtype=dtype,
        )


# init 0.1: varied greedy tokens (at 0.05 they repeat one token), HF's bf16 logits within 0.05 of its
# float32 ones at the 99th percentile against a median top-2 margin of 0.2
QWEN3_MOE = TinyQwen3Moe(name="qwen3-moe", architecture="Qwen3MoeForCausalLM", init_range=0.1)
FAMILIES[QWEN3_MOE.name] = QWEN3_MOE
ENGINE_ENV_KEYS = ENGINE_ENV_KEYS | {k for k, _ in QWEN3_MOE.engine_env}
