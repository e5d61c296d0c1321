"""KV-cache offloading for vLLM on torch, over the shared ``tpu_offload.core``.

Layers (nothing imports upward; ``tests/gpu/test_gpu_architecture.py`` checks):

* ``gpu_offload.torch_backend``: the transfer engine (engine KV blocks <->
  host slab <-> files). torch, numpy and ``tpu_offload.core`` only; no vLLM.
* ``gpu_offload.vllm``: the vLLM adapter (``OffloadingSpec``, manager,
  worker, metrics; ``patches`` is the one module that changes vLLM's classes). ``gpu_offload.vllm.compat`` is its leaf:
  the only module that imports vLLM's offloading types.
* ``gpu_offload.testing``: test and demo helpers (never imported by the above).
* ``gpu_offload.spec``: what users name as ``spec_module_path``.
"""
