"""Torch backend and vLLM ``OffloadingSpec`` for the shared tpu_offload core."""
