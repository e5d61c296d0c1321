"""The real tpu-inference engine on JAX CPU (run with .venv-tpu, in one process).

XLA_FLAGS must hold 4 emulated devices before JAX is first imported, so TP 1,
2 and 4 share this process; cpu_support.apply() must run before vLLM
resolves its platform. Both happen here, at import. Engines are expensive
(20-40 s to start on 2 cores), so they are shared: ``engines.get(key, make)``
keeps one engine alive (vLLM's worker connector is process-global) and test
files are laid out so consecutive tests ask for the same one. Baseline tokens
(no connector) are computed once per engine shape for every workload.
The engine harness is ``tpu_offload.testing`` (the demo and the benchmarks
start the engine with it too); the modules beside this file are the tests' own.

Compiles: tpu-inference turns on JAX's persistent compile cache at
``VLLM_XLA_CACHE_PATH`` (by default in the user's home); here that is a fresh
directory per session (``tpu_offload.testing.compile_cache``), every compile kept.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tpu_offload.testing.compile_cache import use_fresh_cache  # noqa: E402

use_fresh_cache("tpu-engine-xla-cache-", "VLLM_XLA_CACHE_PATH")  # where tpu-inference points JAX's cache

from tpu_offload.testing import engine_run  # noqa: E402

engine_run.prepare_process()

from tpu_offload.testing import cpu_support  # noqa: E402

cpu_support.apply()

import pytest  # noqa: E402

from tpu_offload.testing.tiny_families import FAMILIES  # noqa: E402
from tpu_offload.testing.tiny_models import KV1, KV4, QWEN3, QWEN3_SERVED  # noqa: E402
from tpu_offload.testing.workloads import Workload  # noqa: E402

from tiny_hybrids import REGISTRY_EXTRA  # noqa: E402

MODELS = {m.name: m for m in (KV4, KV1, QWEN3, QWEN3_SERVED)} | FAMILIES | REGISTRY_EXTRA

from tiny_drafts import EAGLE3_TARGET  # noqa: E402
from tiny_kimi import KIMI_K25  # noqa: E402

MODELS[EAGLE3_TARGET.name] = EAGLE3_TARGET
MODELS[KIMI_K25.name] = KIMI_K25


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    made: dict[tuple[str, str], str] = {}

    def get(name: str, dtype: str) -> str:
        if (name, dtype) not in made:
            made[name, dtype] = MODELS[name].write(str(tmp_path_factory.mktemp(f"{name}-{dtype}")), dtype)
        return made[name, dtype]

    return get


class Engines:
    """At most one live engine; a request for another key closes the current one."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.key = None
        self.run: engine_run.EngineRun | None = None
        self.baselines: dict[tuple, list[list[int]]] = {}
        self.started = 0

    def get(self, key, shape: engine_run.Shape, kv_transfer_config: dict | None = None, **kw) -> engine_run.EngineRun:
        if self.key != key or self.run is None:
            self.close()
            self.run = engine_run.EngineRun(self.model_dir(shape.model, shape.dtype), shape, kv_transfer_config, **kw)
            self.key = key
            self.started += 1
        return self.run

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
        self.run, self.key = None, None

    def baseline(self, shape: engine_run.Shape, workload: Workload, *, only: bool = False) -> list[list[int]]:
        """Tokens without any connector, each workload on a cold prefix cache.
        Every registered workload for the shape's block size runs in the same
        engine session (``only``: just this one), so each shape starts one
        baseline engine per session."""
        k = (shape, workload.name)
        if k not in self.baselines:
            eng = self.get(("baseline", shape), shape)
            todo = [workload] if only else [w for w in Workload.registry.values()
                                            if w.block_size in (None, shape.block_size)]
            for w in todo:
                eng.reset_prefix_cache()
                self.baselines[shape, w.name] = w.run(eng)
        return self.baselines[k]


@pytest.fixture(scope="session")
def engines(model_dir):
    e = Engines(model_dir)
    yield e
    e.close()
