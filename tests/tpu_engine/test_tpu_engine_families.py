"""Every model family tpu-inference 0.32 serves, in the real engine on CPU (tiny random checkpoints).

Per family (``tiny_families``: gpt-oss, Gemma 4, DeepSeek-V3, Llama 4, and the
multimodal architectures as their checkpoints name them: Gemma 4 as
``Gemma4ForConditionalGeneration``, Llama Guard 4, Qwen2.5-VL, text prompts):

* TP 1, no connector: greedy tokens agree with HF transformers (float32)
  at every step where HF's top-2 margin is clear of the engine's rounding,
  and two more runs on a cold prefix cache give identical tokens;
* TP 1 with our connector: identical tokens, and after vLLM's prefix cache
  is reset the second pass takes every full block from our tier (a negative
  control then zeroes those chunks: the tokens change). DeepSeek-V3 (MLA)
  at TP 1 has one attention-DP rank (DP 2 is in test_tpu_engine_dp.py). gpt-oss
  keeps vLLM's hybrid KV cache manager (a sliding-window group beside the
  full one) only if our connector supports it (xfail, strict, while not);
* TP 2, no connector: tokens agree with HF as at TP 1, and equal TP 1's
  (bit for bit in float32; in bf16 any divergence starts at a near-tie);
* tpu-inference's own connector (a child process: it is configured by
  environment and exports the same metric names as ours): a round trip
  with the no-connector tokens and every full block from its tier;
* gpt-oss's own JAX model (not the one tpu-inference serves it with) fails
  to load with the flax tpu-inference pins: the exact error, so the day it
  loads is noticed.

The HF check is teacher-forced: HF reads the engine's own output and must
choose each of its tokens wherever HF's top-2 margin is at least the
family's ``MARGIN``, so every step is compared, not only those before a
first near-tie. The margins are the largest engine-vs-HF disagreement seen
for the family, with room: float32 (Gemma 4) differs from HF only in
summation order; the bf16 families round every activation (gpt-oss and
DeepSeek-V3 go through tpu-inference's vLLM-model path, which cannot load
float32 weights; Llama 4's JAX model fixes bf16), and DeepSeek-V3 also keeps
its latent KV and queries in fp8.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest

from tpu_offload.testing.engine_run import REPO, Shape, kv_transfer_config, their_kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, hit_tokens, store_then_hit_every_block, valid_slots, zero_slots
from tpu_offload.testing.tiny_families import ENGINE_ENV_KEYS, FAMILIES, use_engine_env
from tpu_offload.testing.workloads import DETERMINISM, ROUNDTRIP

pytestmark = pytest.mark.engine

NAMES = sorted(FAMILIES)
TP1 = {n: Shape(n, "bfloat16" if f.bf16_only else "float32", tp=1, block_size=f.block_size)
       for n, f in FAMILIES.items()}
TP2 = {n: dataclasses.replace(s, tp=2) for n, s in TP1.items()}
# Largest engine-vs-HF disagreement seen (TP 1 and 2): gemma4 none at any margin, gpt-oss 0.009,
# llama4 0.012, deepseek-v3 0.068 (fp8 latent cache), qwen3-moe 0.013.
MARGIN = {"gemma4": 1e-3, "gpt-oss": 0.03, "llama4": 0.03, "deepseek-v3": 0.1, "qwen3-moe": 0.03,
          "gemma4-mm": 1e-3, "llama-guard4": 0.03, "qwen2.5-vl": 1e-3}
MIN_COMPARED = {"deepseek-v3": 0.3}  # share of generated tokens clear of a near-tie (default 0.5)
THEIR_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "256", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "32",
             "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}


@pytest.fixture(scope="module", autouse=True)
def family_env(engines):
    """Each family's engine environment, for as long as its engine runs (tpu-inference
    reads some of it when a step is first traced); the process's own afterwards."""
    saved = {k: os.environ.get(k) for k in ENGINE_ENV_KEYS}
    yield
    engines.close()  # the next module's engine starts in the process's own environment
    use_engine_env(None)
    os.environ.update({k: v for k, v in saved.items() if v is not None})


def engine(engines, key, shape: Shape, kv=None, **kw):
    """The family's engine (its environment and arguments; ``kw`` overrides them)."""
    family = FAMILIES[shape.model]
    if engines.key != key or engines.run is None:  # a new engine: this family's environment only
        engines.close()
        use_engine_env(family)
    return engines.get(key, shape, kv, **{**dict(family.engine_kwargs), **kw})


def baseline(engines, shape: Shape, w) -> list[list[int]]:
    if (shape, w.name) not in engines.baselines:
        engine(engines, ("baseline", shape), shape)  # started with the family's arguments
    return engines.baseline(shape, w, only=True)


@functools.cache
def _hf_model(name: str, model_dir: str):
    import torch

    return FAMILIES[name].hf_model_class().from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_decisions(name: str, model_dir: str, prompts, outputs) -> list[list[tuple[int, float]]]:
    """HF's greedy choice and top-2 margin at each step of the engine's own output."""
    import torch

    model = _hf_model(name, model_dir)
    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, outputs):
            logits = model(input_ids=torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0, len(prompt) - 1:]
            top = torch.topk(logits.float(), 2)
            out.append([(int(i), float(v[0] - v[1])) for i, v in zip(top.indices[:, 0], top.values)])
    return out


def assert_agrees_with_hf(name: str, model_dir: str, outputs) -> list[list[tuple[int, float]]]:
    decisions = hf_decisions(name, model_dir, DETERMINISM.prompts, outputs)
    compared = 0
    for i, (tokens, steps) in enumerate(zip(outputs, decisions)):
        for j, (token, (hf, margin)) in enumerate(zip(tokens, steps)):
            if margin >= MARGIN[name]:
                assert token == hf, f"prompt {i} step {j}: engine {token}, HF {hf} (HF margin {margin:.4f})"
                compared += 1
    total = sum(map(len, outputs))
    assert compared >= MIN_COMPARED.get(name, 0.5) * total, f"{compared} of {total} clear decisions: other prompts"
    return decisions


# ---- the CPU kernels these families need ----------------------------------------------------------
@pytest.mark.parametrize("dtype,window", [("float32", None), ("float32", 16), ("bfloat16", 16)])
def test_attention_sinks_match_tpu_inference_reference(dtype, window):
    """gpt-oss's sinks in the head_dim-64 CPU attention, against the kernel's own reference."""
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64

    from tpu_offload.testing import cpu_attention
    from test_tpu_engine_cpu_support import make_inputs

    args, n = make_inputs(np.random.default_rng(0), q_heads=8, kv_heads=2, head_dim=64, dtype=dtype, page_size=16,
                          layout="hd64")
    sinks = jnp.asarray(np.random.default_rng(1).standard_normal(8) * 2, jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=window)
    want, want_cache = kernel_hd64.ref_ragged_paged_attention_hd64(*args, sinks, **kw)
    got, got_cache = cpu_attention.ragged_paged_attention_hd64(*args, sinks, **kw)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    plain, _ = cpu_attention.ragged_paged_attention_hd64(*args, **kw)
    assert np.abs(np.asarray(plain[:n], np.float32) - np.asarray(got[:n], np.float32)).max() > 0.1, "sinks matter"


MLA_SEQS = [(1, 37), (1, 5), (23, 23), (9, 40)]  # (q_len, kv_len), decode first


@pytest.mark.parametrize("dtype,page_size", [("float32", 16), ("bfloat16", 32), ("bfloat16", 16)])
def test_mla_matches_tpu_inference_reference(dtype, page_size):
    """The CPU MLA kernel against tpu-inference's pure-JAX MLA reference (``kernels/mla/v1``,
    token-major; v2 takes and returns head-major queries): padded tokens and sequences, a
    compressed KV (64) and rope part (32) each padded to 128 lanes in the cache."""
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.mla.v1 import kernel as v1

    from tpu_offload.testing import cpu_mla

    rng = np.random.default_rng(0)
    heads, lkv, r, tokens, max_seqs, pages_per_seq, num_pages = 4, 64, 32, 64, 6, 4, 24
    cache = rng.standard_normal(v1.get_kv_cache_shape(num_pages, page_size, 256, jnp.dtype(dtype)))
    q = jnp.asarray(rng.standard_normal((tokens, heads, lkv)), dtype)
    q_pe = jnp.asarray(rng.standard_normal((tokens, heads, r)), dtype)
    c = jnp.asarray(rng.standard_normal((tokens, lkv)), dtype)
    k_pe = jnp.asarray(rng.standard_normal((tokens, r)), dtype)
    kv_lens = np.zeros(max_seqs, np.int32)
    pages = np.zeros((max_seqs, pages_per_seq), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for i, (q_len, kv_len) in enumerate(MLA_SEQS):
        kv_lens[i] = kv_len
        pages[i, : -(-kv_len // page_size)] = [free.pop() for _ in range(-(-kv_len // page_size))]
        cu[i + 1] = cu[i] + q_len
    cu[len(MLA_SEQS) + 1:] = cu[len(MLA_SEQS)]
    n = int(cu[len(MLA_SEQS)])
    meta = [jnp.asarray(x) for x in (kv_lens, pages.reshape(-1), cu, np.array([2, 2, len(MLA_SEQS)], np.int32))]
    fresh = lambda: jnp.asarray(cache, dtype)  # noqa: E731  (both donate the cache)
    want, want_cache = v1.ref_mla_ragged_paged_attention(q, q_pe, c, k_pe, fresh(), *meta, sm_scale=0.1)
    got, got_cache = cpu_mla.mla_ragged_paged_attention(jnp.transpose(q, (1, 0, 2)), q_pe, c, k_pe, fresh(), *meta,
                                                        sm_scale=0.1)
    got = jnp.transpose(got, (1, 0, 2))
    tol = 1e-5 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want[..., :lkv], np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    assert not np.asarray(got[n:], np.float32).any(), "padding tokens produce zeros"


# ---- TP 1 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_tp1_greedy_tokens_agree_with_hf_and_repeat(name, engines, model_dir):
    shape = TP1[name]
    first = baseline(engines, shape, DETERMINISM)
    baseline(engines, shape, ROUNDTRIP[shape.block_size])  # for the connector tests, from the same engine
    assert_agrees_with_hf(name, model_dir(shape.model, shape.dtype), first)
    eng = engine(engines, ("baseline", shape), shape)
    for _ in range(2):
        eng.reset_prefix_cache()
        assert DETERMINISM.run(eng) == first


@pytest.mark.parametrize("name", NAMES)
def test_tp1_our_connector_round_trip(name, engines):
    shape = TP1[name]
    w = ROUNDTRIP[shape.block_size]
    base = baseline(engines, shape, w)
    eng = engine(engines, ("ours", shape), shape, kv_transfer_config("offload.json", **OURS))
    before = valid_slots(eng)
    store_then_hit_every_block(eng, w, base, shape.block_size)

    # negative control: the restored bytes are what attention reads (every layer's, whatever its shape)
    zero_slots(eng, valid_slots(eng) - before, keep_checksums=True)
    eng.reset_prefix_cache()
    assert w.run(eng) != base


def _ours_supports_hma() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from tpu_offload.connector.connector import TPUOffloadConnector

    return issubclass(TPUOffloadConnector, SupportsHMA)


@pytest.mark.xfail(not _ours_supports_hma(), strict=True,
                   reason="our connector does not subclass vLLM's SupportsHMA, so vLLM turns its hybrid KV cache "
                   "manager off ('Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV "
                   "connector that does not support it'): gpt-oss's sliding-window layers are then allocated as "
                   "full attention, in one KV cache group instead of two")
def test_tp1_our_connector_keeps_the_hybrid_kv_cache_manager(engines):
    """gpt-oss on tpu-inference's vLLM-model path: sliding-window layers get their own KV
    cache group (vLLM frees their blocks past the window) without a connector."""
    shape = TP1["gpt-oss"]
    eng = engine(engines, ("ours", shape), shape, kv_transfer_config("offload.json", **OURS))
    groups = eng.core.scheduler.kv_cache_config.kv_cache_groups
    assert not eng.core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]


# ---- TP 2 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_tp2_tokens_agree_with_hf_and_tp1(name, engines, model_dir):
    shape = TP2[name]
    tp1 = baseline(engines, TP1[name], DETERMINISM)
    got = baseline(engines, shape, DETERMINISM)
    path = model_dir(shape.model, shape.dtype)
    assert_agrees_with_hf(name, path, got)
    if shape.dtype == "float32":
        assert got == tp1
        return
    # bf16 over 2 devices sums in another order: where the two first differ, HF was near a tie
    for i, (a, b, steps) in enumerate(zip(got, tp1, hf_decisions(name, path, DETERMINISM.prompts, tp1))):
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is not None:
            assert steps[d][1] < MARGIN[name], f"prompt {i}: TP 2 left TP 1 at step {d}, HF margin {steps[d][1]:.4f}"


# ---- gpt-oss's own JAX model ----------------------------------------------------------------------
_JAX_GPT_OSS = """
from tpu_offload.testing import engine_run
engine_run.prepare_process()
engine_run.EngineRun({path!r}, engine_run.Shape("gpt-oss", "bfloat16", tp=1, block_size=16))
"""


def test_gpt_oss_jax_model_cannot_load_with_the_flax_tpu_inference_pins(model_dir):
    """tpu-inference serves gpt-oss through vLLM's model by default; its own JAX model
    (``MODEL_IMPL_TYPE=flax_nnx``) fails to load an unquantized checkpoint with the flax it
    pins (0.12.10): ``GptOss._load_regular_param`` takes the partition spec from
    ``param.sharding``, which is now the (abstract) array's sharding, None. When this test
    fails, that path loads: run gpt-oss through it too. (A child process: the failed
    start leaves vLLM's process-wide parallel state behind.)"""
    code = _JAX_GPT_OSS.format(path=model_dir("gpt-oss", "bfloat16"))
    env = {**os.environ, "MODEL_IMPL_TYPE": "flax_nnx",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0
    assert "_load_regular_param" in proc.stderr
    assert "jax.P() argument after * must be an iterable, not NoneType" in proc.stderr


# ---- tpu-inference's own connector ----------------------------------------------------------------
_CHILD = """
import sys
sys.path.insert(0, {here!r})
import engine_child
from tpu_offload.testing import engine_run
from tpu_offload.testing.tiny_families import FAMILIES, use_engine_env

class FamilyEngine(engine_run.EngineRun):  # each family's environment and engine arguments
    def __init__(self, model_dir, shape, kv=None, **kw):
        use_engine_env(FAMILIES[shape.model])
        super().__init__(model_dir, shape, kv, **dict(FAMILIES[shape.model].engine_kwargs), **kw)

engine_run.EngineRun = FamilyEngine
engine_child.main(sys.argv[1])
"""


@pytest.fixture(scope="module")
def theirs(model_dir, tmp_path_factory):
    """``engine_child.run_jobs``, with each family's engine arguments (``engine_kwargs``)."""
    work = tmp_path_factory.mktemp("theirs-families")
    jobs = [{"shape": dataclasses.asdict(TP1[n]), "model_dir": model_dir(TP1[n].model, TP1[n].dtype),
             "kv": their_kv_transfer_config(), "workload": ROUNDTRIP[TP1[n].block_size].name, "round_trip": True,
             "env": THEIR_ENV} for n in NAMES]
    path = work / "jobs.json"
    path.write_text(json.dumps(jobs))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    for k in ENGINE_ENV_KEYS:  # each engine sets its own
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(here=here), str(path)], capture_output=True,
                          text=True, timeout=1200, env=env)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(jobs):
        raise AssertionError(f"engine child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(zip(NAMES, results))


@pytest.mark.parametrize("name", NAMES)
def test_their_connector_round_trip(name, engines, theirs):
    shape = TP1[name]
    w = ROUNDTRIP[shape.block_size]
    base = baseline(engines, shape, w)
    t = theirs[name]
    assert t["first"] == base
    assert t["second"] == base
    assert t["external_hits"] == sum(hit_tokens(len(p), shape.block_size) for p in w.prompts)
