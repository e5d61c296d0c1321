"""Images in the real engine on CPU: a chunk is keyed by what its tokens saw, image included.

Our connector keys chunks by vLLM's ``request.block_hashes``. For a block that
overlaps an image placeholder, vLLM folds the image's content hash into the
block's hash (``generate_block_hash_extra_keys``), so two prompts with the same
token ids (text and placeholder tokens) but different images must not share
chunks past the first image token. Checked on Qwen2.5-VL (tpu-inference's JAX
model: M-RoPE, the vision tower run on CPU with the flash-attention reference
``cpu_support`` installs), TP 1, 16-token blocks:

* without a connector the two images give different tokens (so a wrong hit
  would show);
* with ours, after image A's prompt is stored and vLLM's prefix cache reset,
  the same text with image B hits only the blocks before the image and
  matches no-connector tokens; image A again hits every full block, its image
  KV restored from our tier, identical tokens;
* a control drops the image keys from vLLM's block hashes: image B then takes
  image A's chunks and its tokens change.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpu_offload.testing.engine_run import Shape, kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, ExternalHits, delta, hit_tokens, settle, totals
from test_tpu_engine_families import engine, family_env  # noqa: F401  (family_env: autouse, this module too)
from tpu_offload.testing.tiny_families import QWEN_VL_TOKENS
from tpu_offload.testing.workloads import prompt

pytestmark = pytest.mark.engine

BLOCK = 16
SHAPE = Shape("qwen2.5-vl", "float32", tp=1, block_size=BLOCK)
IMAGES = {"A": 1, "B": 2}  # image name -> pixel seed
SIDE = 224  # 16 x 16 patches of 14, merged 2 x 2: 64 image tokens
HEAD, TAIL = prompt(7, 40), prompt(8, 40)
PROMPT = HEAD + [QWEN_VL_TOKENS["<|vision_start|>"], QWEN_VL_TOKENS["<|image_pad|>"],
                 QWEN_VL_TOKENS["<|vision_end|>"]] + TAIL
EXPANDED = len(HEAD) + 1 + 64 + 1 + len(TAIL)  # the prompt once vLLM expands the image placeholder
BEFORE_IMAGE = (len(HEAD) + 1) // BLOCK * BLOCK  # tokens in the blocks that end before the first image token
MM = {"language_model_only": False}  # images on (the family's text tests serve the language model only)


def _image(name: str):
    from PIL import Image

    pixels = np.random.default_rng(IMAGES[name]).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _generate(eng, name: str) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [out] = eng.llm.generate([TokensPrompt(prompt_token_ids=PROMPT, multi_modal_data={"image": _image(name)})], sp,
                             use_tqdm=False)
    assert len(out.prompt_token_ids) == EXPANDED
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def baseline(engines):
    eng = engine(engines, ("mm-baseline", SHAPE), SHAPE, **MM)
    out = {}
    for name in IMAGES:
        eng.reset_prefix_cache()
        out[name] = _generate(eng, name)
    return out


def test_different_images_give_different_tokens_without_a_connector(baseline):
    assert baseline["A"] != baseline["B"], "a hit on the other image's chunks would go unseen"


def test_a_different_image_never_hits_the_other_images_chunks(engines, baseline):
    eng = engine(engines, ("mm-ours", SHAPE), SHAPE, kv_transfer_config("offload.json", **OURS), **MM)
    assert _generate(eng, "A") == baseline["A"]
    settle(eng)
    t0 = totals(eng)
    assert delta(t0, {}, "stored_chunks") == EXPANDED // BLOCK

    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:  # same token ids, image B: only the blocks before the image match
        assert _generate(eng, "B") == baseline["B"]
    assert took.tokens == BEFORE_IMAGE == 32
    settle(eng)

    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:  # image A again: every full block, image KV included, from our tier
        assert _generate(eng, "A") == baseline["A"]
    assert took.tokens == hit_tokens(EXPANDED, BLOCK)

    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:  # and image B's own chunks, stored on its first run
        assert _generate(eng, "B") == baseline["B"]
    assert took.tokens == hit_tokens(EXPANDED, BLOCK)
    t1 = totals(eng)
    assert delta(t1, t0, "load_errors") == 0
    assert delta(t1, t0, "hit_tokens") == BEFORE_IMAGE + 2 * hit_tokens(EXPANDED, BLOCK)


def test_control_without_the_image_in_the_block_hashes_image_b_is_served_image_a(engines, baseline, monkeypatch):
    """What the test above guards against: with vLLM's image keys dropped from the block
    hashes, image B's prompt takes image A's chunks from our tier and its tokens change."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    eng = engine(engines, ("mm-ours", SHAPE), SHAPE, kv_transfer_config("offload.json", **OURS), **MM)
    monkeypatch.setattr(kv_cache_utils, "_gen_mm_extra_hash_keys", lambda request, start, end, mm_idx: ([], mm_idx))
    eng.reset_prefix_cache()
    assert _generate(eng, "A") == baseline["A"]
    settle(eng)
    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:
        wrong = _generate(eng, "B")
    assert took.tokens == hit_tokens(EXPANDED, BLOCK)
    assert wrong != baseline["B"]
