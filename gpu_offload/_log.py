"""Loggers for every gpu_offload layer (a leaf: imports nothing of ours, not vLLM).

Under vLLM, a child of vLLM's ``vllm`` logger, so our lines carry its format
and follow ``VLLM_LOGGING_LEVEL``; plain ``logging`` otherwise (a benchmark
on a bare CUDA box).
"""

from __future__ import annotations

import importlib.util
import logging

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.{name}" if HAVE_VLLM else name)
