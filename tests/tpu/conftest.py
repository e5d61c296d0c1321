"""TPU-path tests on CPU: an emulated 8-device JAX mesh and vLLM's real scheduler.

XLA_FLAGS must be set before jax is first imported, so it is set here at
import time; TPU_OFFLOAD_* from the caller's shell would leak into configs,
so they are cleared.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
for _k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
    del os.environ[_k]

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mesh():
    import jax

    if len(jax.devices()) < 8:
        pytest.fail(f"need 8 emulated CPU devices, got {len(jax.devices())}: jax was imported before "
                    "tests/tpu/conftest.py could set XLA_FLAGS; run tests/tpu on its own")
    return jax.make_mesh((1, 8), ("data", "model"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tpu_standin import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
