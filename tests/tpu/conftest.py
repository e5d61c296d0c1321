"""TPU-path tests on CPU: an emulated 8-device JAX mesh and vLLM's real scheduler.

XLA_FLAGS must be set before jax is first imported, so it is set here at
import time; TPU_OFFLOAD_* from the caller's shell would leak into configs,
so they are cleared. Runs under ``.venv-tpu`` (jax 0.11.2, the version
tpu-inference pins) and ``.venv`` (jax 0.10).
"""

import os

from tpu_offload.testing.compile_cache import use_fresh_cache

use_fresh_cache("tpu-xla-cache-", "JAX_COMPILATION_CACHE_DIR")  # imports no JAX

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The stand-in runs under vLLM's CPU platform; with libtpu installed (the
# tpu-inference environment) vLLM would otherwise detect both and refuse.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
    del os.environ[_k]

import pytest  # noqa: E402


MESH_KINDS = ("auto", "explicit", "manual")


def make_mesh(kind: str = "auto", shape=(1, 8), names=("data", "model")):
    """An emulated CPU mesh with ``kind`` axes.

    ``auto`` is what tpu-inference builds (``jax.sharding.Mesh(devices, names)``
    / ``make_optimized_mesh(..., AxisType.Auto)``); ``jax.make_mesh`` defaults
    to ``explicit``; ``manual`` is what code inside ``shard_map`` sees.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.fail(f"need {n} emulated CPU devices, got {len(jax.devices())}: jax was imported before "
                    "tests/tpu/conftest.py could set XLA_FLAGS; run tests/tpu on its own")
    axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit, "manual": AxisType.Manual}[kind]
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names, axis_types=(axis_type,) * len(names))


@pytest.fixture(scope="session")
def mesh():
    """tpu-inference's kind of mesh: Auto axes."""
    return make_mesh("auto")


@pytest.fixture(scope="session", params=MESH_KINDS)
def any_mesh(request):
    """The data path must work on every axis type."""
    return make_mesh(request.param)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tpu_standin import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def harnesses(mesh, tiny_model_dir):
    """Builds stand-in harnesses (16-token blocks; ``Harness`` keywords pass through) and
    shuts their worker halves down after the test."""
    from tpu_standin import Harness

    made = []

    def build(extra: dict, **kw):
        h = Harness(mesh, tiny_model_dir, block_size=16, extra=extra, **kw)
        made.append(h)
        return h

    yield build
    for h in made:
        h.conn_w.shutdown()


@pytest.fixture
def fs_harness(harnesses, tmp_path):
    """A stand-in harness with a file tier under ``tmp_path/kv`` and 32 host chunks; keywords are
    the extra config (each file-tier module binds its own defaults with ``functools.partial``)."""
    from tpu_standin import fs_secret_file

    return lambda **extra: harnesses({"num_cpu_chunks": 32, "shared_storage_path": str(tmp_path / "kv"),
                                      "fs_secret_file": fs_secret_file(tmp_path), **extra})
