"""Torch transfer engine: engine KV blocks <-> host slab slots <-> chunk files.

No vLLM import here: the vLLM adapter (``gpu_offload.vllm``) wraps it.
"""
