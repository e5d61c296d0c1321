"""JAX data path: HBM staging buffer, host-memory slabs, compiled transfers.

Imported only on the worker side (it imports jax); the scheduler side and
``tpu_offload.core`` never need it. The names below load on first access, so
``jax_backend.memory``'s host-RAM checks import without JAX (the self-check's
offline mode).
"""

_EXPORTS = {"LoadChunk": "engine", "StoreChunk": "engine", "TransferEngine": "engine", "KVLayout": "layout",
            "LayerGroup": "layout"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
