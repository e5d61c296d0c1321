"""Test and demo helpers (never imported by the backend or the adapter)."""

from gpu_offload.testing.hooks import (  # noqa: F401
    corrupt_slot,
    fail_next_loads,
    fail_next_stores,
    live_managers,
    live_workers,
    offloading_config,
    the_manager,
    the_worker,
    valid_slots,
)
