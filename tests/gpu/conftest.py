"""Shared fixtures for the vLLM path: real in-process vLLM engines, one at a time.

vLLM reads its environment at import, so the variables are set here, before
any test module imports it. Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tests reach their worker and
manager through ``gpu_offload.testing``. vLLM keeps one worker-side KV
connector per process, so only one offloading engine may be alive at a time:
``engines`` starts the kind a test asks for and shuts the previous one down
(an engine start costs 30-60 s here, so tests of one kind share it).
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is explicit so every engine, with or
without a kv-transfer-config, gets the same cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from gpu_engines import start_engine, stop_engine  # noqa: E402
from gpu_offload.testing.tiny_model import TinyGemma3, TinyLlama  # noqa: E402

MODEL = TinyLlama()  # hidden 256, 2 layers, 4 heads / 2 KV heads, head_dim 64
HYBRID_MODEL = TinyGemma3()  # one sliding-window + one full-attention layer: two KV-cache groups


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return MODEL.write(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory) -> str:
    return HYBRID_MODEL.write(str(tmp_path_factory.mktemp("tiny_gemma3")))


class Engines:
    def __init__(self, dirs: dict):
        self.dirs = dirs
        self.kind: str | None = None
        self.parts = None

    def get(self, kind: str):
        if self.kind != kind:
            self.close()
            self.parts = start_engine(self.dirs[kind])
            self.kind = kind
        return self.parts

    def close(self) -> None:
        if self.parts is not None:
            llm = self.parts[0]
            self.parts = self.kind = None
            stop_engine(llm)


@pytest.fixture(scope="session")
def engines(tiny_model_dir, hybrid_model_dir):
    e = Engines({"llama": tiny_model_dir, "hybrid": hybrid_model_dir})
    yield e
    e.close()


@pytest.fixture
def engine(engines):
    """(llm, worker, manager) of the tiny Llama engine; each test uses its own prompts."""
    return engines.get("llama")


@pytest.fixture
def hybrid_engine(engines):
    """(llm, worker, manager) of the tiny Gemma-3-like engine (two KV-cache groups)."""
    return engines.get("hybrid")
