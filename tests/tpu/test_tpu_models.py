"""Models whose requests carry a recurrent state: refused at start by the engine's KV-cache groups
(vLLM's own ``MambaSpec``) or, without a KV-cache config, by the model config's layer types."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tpu_offload.connector.settings import resolve  # noqa: E402
from tpu_offload.core.config import ConfigError  # noqa: E402


def _vc(layer_types=None):
    text = SimpleNamespace(layer_types=layer_types)
    hf = SimpleNamespace(architectures=["Qwen3_5MoeForConditionalGeneration"], text_config=text)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"num_cpu_chunks": 4},
                                           kv_load_failure_policy="recompute"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="/m/qwen3.5", hf_config=hf, use_mla=False,
                                     get_total_num_kv_heads=lambda: 2),
    )


def test_a_mamba_spec_group_is_refused_naming_the_model():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    state = MambaSpec(block_size=16, shapes=((3, 64), (4, 32, 32)), dtypes=(torch.bfloat16, torch.float32))
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layers.3.attn"], attn),
        KVCacheGroupSpec(["layers.0.linear_attn"], state), KVCacheGroupSpec(["layers.1.linear_attn"], state)])
    with pytest.raises(ConfigError, match=r"model '/m/qwen3.5' \(Qwen3_5MoeForConditionalGeneration\) keeps a "
                                          r"recurrent state.*2 layers in MambaSpec KV-cache groups"):
        resolve(_vc(), kcc, env={})


def test_linear_attention_layer_types_are_refused_without_a_kv_cache_config():
    with pytest.raises(ConfigError, match=r"3 linear_attention layers"):
        resolve(_vc(["linear_attention"] * 3 + ["full_attention"]), None, env={})
    assert resolve(_vc(["sliding_attention", "full_attention"]), None, env={}).num_slots == 4
