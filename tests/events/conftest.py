"""In-process vLLM engines with the KV-event publisher: set before vLLM is imported."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
