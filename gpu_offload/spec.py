"""``spec_module_path`` for vLLM: ``"spec_module_path": "gpu_offload.spec"``.

The spec lives in ``gpu_offload.vllm.spec``; this name is what deployments
configure, so it stays stable. Importing it changes nothing in vLLM: our
patches of vLLM's ``OffloadingConnector`` are put in place when vLLM builds
the spec (see ``gpu_offload.vllm.patches``).
"""

from gpu_offload.vllm.spec import HostOffloadSpec

__all__ = ["HostOffloadSpec"]
