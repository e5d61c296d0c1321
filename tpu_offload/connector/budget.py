"""The per-step budget in blocks: how many blocks one step's loads, and one step's stores, may send.

The budget itself is bytes per device and direction, from the config alone (core/step_budget.py: a chip's
link x the accepted stall, shared by its devices). Here it becomes whole chunks of blocks, from the bytes
each device holds of one block: the scheduler admits that many blocks per step and direction, and the
worker's pacer sends the same bytes per step, so what the scheduler emits leaves the worker's queue in
the step it was emitted.
"""

from __future__ import annotations


def chunk_devices(vllm_config, kv_replicas: int) -> int:
    """Devices that split one chunk's distinct bytes: the KV-head shards (MLA: one copy, on every device)."""
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "use_mla", False):
        return 1
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    return max(1, tp // max(1, kv_replicas))


def device_block_bytes(chunk_bytes: int, blocks_per_chunk: int, devices: int) -> int:
    """Bytes one device holds of one block (rounded up; 0: unknown)."""
    return -(-chunk_bytes // (blocks_per_chunk * max(1, devices))) if chunk_bytes else 0


# Devices that share one chip's host link, by device kind (TPU7x: two TensorCores, each its own device).
DEVICES_PER_CHIP = {"TPU7x": 2, "TPU v7": 2}


def devices_per_chip(device_kind: str) -> int:
    """What the devices' kind says (the worker checks the config's ``devices_per_chip`` against it)."""
    return next((n for k, n in DEVICES_PER_CHIP.items() if k.lower() in (device_kind or "").lower()), 1)
