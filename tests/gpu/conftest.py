"""Shared fixtures for the vLLM path: one real in-process vLLM engine per session.

vLLM reads its environment at import, so the variables are set here, before
any test module imports it. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tests reach its worker and manager
through ``gpu_offload.testing``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from gpu_offload import selection  # noqa: E402
from gpu_offload.tiny_model import TinyLlama  # noqa: E402

MODEL = TinyLlama()  # hidden 256, 2 layers, 4 heads / 2 KV heads, head_dim 64


def kv_transfer_config(cpu_bytes: int = 64 << 20, **extra) -> dict:
    return selection.kv_transfer_config(cpu_bytes, **extra)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return MODEL.write(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    """(llm, worker, manager) for every e2e test; each test uses its own prompts."""
    from vllm import LLM

    from gpu_offload import testing

    old = {id(x) for x in testing.live_workers() + testing.live_managers()}
    llm = LLM(
        model=tiny_model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        max_num_seqs=4,
        kv_transfer_config=kv_transfer_config(),
        disable_log_stats=False,
    )
    (worker,) = [w for w in testing.live_workers() if id(w) not in old]
    (manager,) = [m for m in testing.live_managers() if id(m) not in old]
    return llm, worker, manager
