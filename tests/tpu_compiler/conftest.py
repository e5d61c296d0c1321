"""The TPU compiler without a TPU: libtpu compiles for compile-only topologies.

Runs under ``.venv-tpu`` (libtpu 0.0.48 with jax 0.11.2, as tpu-inference
pins), in its own pytest process: the environment below must be set before
JAX starts, and vLLM's platform must resolve to tpu-inference's (the other
TPU suites use vLLM's CPU platform or their own device count).
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # the runtime backend; compilation targets the TPU topology
os.environ["TPU_SKIP_MDS_QUERY"] = "1"  # no GCE metadata server here
os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")  # silences libtpu's host-bounds warning
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # no TPU to share: another libtpu process must not lock us out
os.environ["NEW_MODEL_DESIGN"] = "1"  # tpu-inference's 7-axis mesh and its cache sharding
os.environ["VLLM_PLUGINS"] = ""
for _k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
    del os.environ[_k]

from tpu_offload.testing import cpu_support  # noqa: E402

cpu_support.prepare_vllm()  # vLLM's kernels for this CPU, torchax, tpu-inference's platform
