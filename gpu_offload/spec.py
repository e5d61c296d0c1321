"""``spec_module_path`` for vLLM: ``"spec_module_path": "gpu_offload.spec"``.

The spec lives in ``gpu_offload.vllm.spec``; this name is what deployments
configure, so it stays stable. Importing it installs our hooks on vLLM's
``OffloadingConnector`` (see ``gpu_offload.vllm.hooks``).
"""

from gpu_offload.vllm.spec import HostOffloadSpec

__all__ = ["HostOffloadSpec"]
