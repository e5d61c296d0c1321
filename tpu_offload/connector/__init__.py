"""tpu-inference connector: ``kv_connector_module_path = "tpu_offload.connector"``.

The connector class imports vLLM, so it is loaded on first access (vLLM's
factory does ``getattr(module, "TPUOffloadConnector")``): the self-check's
offline mode imports this package's vLLM-free and JAX-free modules
(``shapes``, ``budget``) on machines without either. The worker half imports
JAX lazily (scheduler processes never do).
"""

__all__ = ["TPUOffloadConnector"]


def __getattr__(name: str):
    if name == "TPUOffloadConnector":
        from tpu_offload.connector.connector import TPUOffloadConnector

        return TPUOffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
