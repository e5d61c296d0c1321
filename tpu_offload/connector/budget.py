"""The load budget per step: how many blocks one step's loads may send.

A load makes the next forward wait for its host-to-device bytes, so a large
hit sent whole stalls every running decode. The budget is bytes per device
(``load_bandwidth_gbps`` x ``load_stall_ms``, config), turned into whole
chunks of blocks from the bytes each device holds of one block. Never less
than one chunk (a step always makes progress), never more than staging.
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
    """Bytes one device receives per loaded block (0: unknown)."""
    return -(-chunk_bytes // (blocks_per_chunk * max(1, devices))) if chunk_bytes else 0


def load_budget_blocks(budget_bytes: int, block_bytes: int, blocks_per_chunk: int, staging_blocks: int) -> int:
    """Whole chunks of blocks within ``budget_bytes`` per device; at least one chunk, at most staging."""
    if block_bytes <= 0:
        return staging_blocks
    chunks = budget_bytes // (block_bytes * blocks_per_chunk)
    return min(staging_blocks, max(1, chunks) * blocks_per_chunk)


# Devices that share one chip's host link, by device kind (TPU7x: two TensorCores, each its own device).
DEVICES_PER_CHIP = {"TPU7x": 2, "TPU v7": 2}


def devices_per_chip(device_kind: str) -> int:
    return next((n for k, n in DEVICES_PER_CHIP.items() if k.lower() in (device_kind or "").lower()), 1)


def step_bytes(bandwidth_gbps: float, stall_ms: float, device_kind: str) -> int:
    """Bytes per device one step may send one way: a chip's link bandwidth x the acceptable stall, shared
    by the chip's devices."""
    return max(1, int(bandwidth_gbps * 1e9 * stall_ms / 1e3 / devices_per_chip(device_kind)))
