"""The per-step byte budget: how much one step may move over the host link, per device and direction.

One figure, used by both halves of the TPU connector: the scheduler admits at most this many bytes of
loads and of stores per step (the rest waits in its queues, counted as deferred), and the worker's pacer
sends at most this many bytes per step and direction after the forward. Both derive it from the config
alone (bytes and steps, nothing measured locally), so every host and DP rank computes the same number.

Why bandwidth x stall: TPU7x runs a TensorCore's DMAs and program launches through one in-order queue,
so the next forward waits behind every host copy queued after the current one. Copies of ``bandwidth x
stall`` bytes delay it by ``stall`` at most.

Units: ``bandwidth_gbps`` is the host link of one **chip** (10^9 bytes per second, one direction).
A chip may expose several JAX **devices** (TPU7x: two TensorCores, each its own device, sharing the
chip's link); each device moves its own shard of every block at the same time, so one device's share of
the step is ``bandwidth x stall / devices_per_chip``. The budget is that share, in bytes **per device**,
and a block costs what one device holds of it.
"""

from __future__ import annotations


def bytes_per_device(bandwidth_gbps: float, stall_ms: float, devices_per_chip: int) -> int:
    """Bytes one device may move per step and direction: a chip's link x the accepted stall, shared by
    the chip's devices. At least 1."""
    return max(1, int(bandwidth_gbps * 1e9 * stall_ms / 1e3 / max(1, int(devices_per_chip))))


def blocks(budget_bytes: int, device_block_bytes: int, blocks_per_chunk: int, staging_blocks: int) -> int:
    """Whole chunks of blocks within ``budget_bytes`` per device (``device_block_bytes``: what one device
    holds of a block; 0: unknown, then staging). At least one chunk (a step always makes progress), at
    most the staging buffer."""
    if device_block_bytes <= 0:
        return staging_blocks
    chunks = budget_bytes // (device_block_bytes * blocks_per_chunk)
    return min(staging_blocks, max(1, chunks) * blocks_per_chunk)


def steps_to_move(n_blocks: int, step_blocks: int) -> int:
    """Steps a transfer of ``n_blocks`` takes at ``step_blocks`` per step (its own link time; the load
    lands in the step after its last part is sent)."""
    return -(-n_blocks // max(1, step_blocks))
