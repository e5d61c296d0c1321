"""Linear-attention hybrids (Qwen3.5-MoE) in the real engine: refused at start, with the reason.

tpu-inference 0.32 serves ``Qwen3_5MoeForConditionalGeneration`` on its
vLLM-model path; its gated-delta-net layers keep a recurrent state in
``MambaSpec`` KV-cache groups beside the attention group. A prefix hit
would need that state at the hit's end, which our connector does not store
(``tpu_offload/connector/models.py``), so the engine must refuse to start
with one clear error naming the model and the reason, reached with the
engine's own KV-cache config for the model.
"""

from __future__ import annotations

import re

import pytest

from tpu_offload.testing.engine_run import kv_transfer_config
from tiny_hybrids import ARCHITECTURE, write_qwen3_5_moe

pytestmark = pytest.mark.engine


def test_qwen3_5_moe_is_refused_at_start_naming_the_model_and_reason(engines, tmp_path_factory):
    from vllm import LLM
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    path = write_qwen3_5_moe(str(tmp_path_factory.mktemp("qwen3_5_moe")))
    engines.close()  # one engine (and worker connector) per process
    try:
        with pytest.raises(Exception) as refused:
            LLM(model=path, dtype="bfloat16", seed=0, tensor_parallel_size=1, block_size=16,
                num_gpu_blocks_override=96, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                language_model_only=True,  # text only; vLLM's multimodal processor still needs a tokenizer
                kv_transfer_config=kv_transfer_config("offload.json", cpu_bytes="64MiB", staging_blocks=32))
    finally:  # what a failed start leaves in the process (see engine_run.refused_start)
        kv_transfer_state.ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    err = refused.value
    assert type(err).__name__ == "ConfigError", repr(err)
    msg = str(err)
    assert f"model {path!r} ({ARCHITECTURE})" in msg
    # the engine's own KV-cache groups: its gated-delta-net layers' state in MambaSpec groups
    assert re.search(r"keeps a recurrent state besides its attention KV: 3 layers in MambaSpec KV-cache groups", msg)
    assert "linear_attn" in msg and "without --kv-transfer-config" in msg
