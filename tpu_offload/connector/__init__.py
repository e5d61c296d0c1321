"""tpu-inference connector: ``kv_connector_module_path = "tpu_offload.connector"``.

Imports vLLM; the worker half imports JAX lazily (scheduler processes never do).
"""

from tpu_offload.connector.connector import TPUOffloadConnector

__all__ = ["TPUOffloadConnector"]
