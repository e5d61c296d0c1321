"""The kv-transfer-config that selects ``HostOffloadSpec`` (no vLLM import)."""

from __future__ import annotations

from typing import Any


def kv_transfer_config(cpu_bytes: int, **extra: Any) -> dict:
    """``--kv-transfer-config`` for vLLM's OffloadingConnector with our spec.

    ``kv_load_failure_policy`` is ``recompute``: a chunk that cannot be loaded
    is recomputed instead of failing its request.
    """
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "HostOffloadSpec",
            "spec_module_path": "gpu_offload.spec",
            "cpu_bytes_to_use": cpu_bytes,
            **extra,
        },
    }
