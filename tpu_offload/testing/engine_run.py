"""One real tpu-inference engine in this process, and the handles tests, demos and benchmarks use.

vLLM keeps the worker's KV connector in a process-wide global, so only one
engine with a connector can live in a process at a time: ``EngineRun.close``
tears the engine down completely before the next one starts. Imports neither
JAX nor vLLM until an engine starts, so a caller can set the environment first
(``prepare_process``). In ``tpu_offload.testing`` so that the demo and the
benchmarks start their engines as the tests do.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
from pathlib import Path

from tpu_offload.testing import cpu_support  # imports neither JAX nor vLLM until apply()

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "tpu-inference"
DEVICES = 4  # emulated CPU devices: TP 1, 2 and 4 in one process
# A child engine process (tests/tpu_engine/engine_child.py: run_jobs) may ask for another device
# count (TP 8 needs 8) and for the engine's own precompile, through these:
DEVICES_ENV = "TPU_ENGINE_DEVICES"
PRECOMPILE_ENV = "TPU_ENGINE_PRECOMPILE"  # "1": tpu-inference precompiles, as a served engine does

ENV = {
    "JAX_PLATFORMS": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SKIP_JAX_PRECOMPILE": "1",
    "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false",
}


def prepare_process(keep_offload_vars: bool = False) -> None:
    """Environment for an engine process; call before JAX or vLLM is imported.

    A server keeps TPU_OFFLOAD_*: tpu-inference's own connector is configured only by them."""
    devices = int(os.environ.get(DEVICES_ENV, DEVICES))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()
    os.environ.update(ENV)
    if os.environ.get(PRECOMPILE_ENV) == "1":
        os.environ["SKIP_JAX_PRECOMPILE"] = "0"
    if not keep_offload_vars:
        env_without_offload_vars()


@dataclasses.dataclass(frozen=True)
class Shape:
    """What an engine is started with (besides its connector)."""

    model: str  # a tiny_models name
    dtype: str  # "bfloat16" | "float32"
    tp: int
    block_size: int
    num_blocks: int = 96  # KV cache blocks (the device "HBM" under test)
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    max_model_len: int = 512  # must fit in num_blocks - 1 (vLLM keeps one null block)


def kv_transfer_config(name: str = "offload.json", **overrides) -> dict:
    """A shipped config from configs/tpu-inference/, its extra config merged with
    ``overrides`` (sizes for the tiny model; paths for the test's directories)."""
    cfg = json.loads((CONFIGS / name).read_text())
    cfg["kv_connector_extra_config"] = {**cfg["kv_connector_extra_config"], **overrides}
    return cfg


def their_kv_transfer_config() -> dict:
    """tpu-inference's own offload connector (configured by TPU_OFFLOAD_* env)."""
    return {"kv_connector": "TPUOffloadConnector", "kv_connector_module_path":
            "tpu_inference.offload.tpu_offload_connector", "kv_role": "kv_both"}


class EngineRun:
    def __init__(self, model_dir: str, shape: Shape, kv_transfer_config: dict | None = None, **engine_kw):
        cpu_support.apply()
        from vllm import LLM

        self.shape = shape
        engine_kw.setdefault("skip_tokenizer_init", True)  # prompts are token ids
        self.llm = LLM(
            model=model_dir, dtype=shape.dtype, seed=0,
            tensor_parallel_size=shape.tp, block_size=shape.block_size,
            num_gpu_blocks_override=shape.num_blocks, max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens, max_model_len=shape.max_model_len,
            kv_transfer_config=kv_transfer_config, disable_log_stats=False, **engine_kw,
        )

    # ---- driving -------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        """Forget vLLM's HBM prefix cache (and, with ``reset_connector``, our tier's index)."""
        assert self.llm.reset_prefix_cache(reset_connector=reset_connector), "vLLM refused to reset its prefix cache"

    # ---- handles ---------------------------------------------------------------
    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core  # in-process EngineCore

    @property
    def scheduler_connector(self):
        return self.core.scheduler.connector

    @property
    def worker_connector(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    @property
    def runner(self):
        return self.core.model_executor.driver_worker.worker.model_runner

    # ---- teardown ----------------------------------------------------------------
    def stop(self) -> None:
        """Shut the engine down exactly as a tpu-inference server's exit does."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def close(self) -> None:
        """``stop()``, then make sure vLLM's process-wide worker connector is gone
        (as vLLM's GPU worker does; tpu-inference's does not), so the next
        engine in this process gets a fresh one."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.stop()
        kv_transfer_state.ensure_kv_transfer_shutdown()
        gc.collect()


def refused_start(model_dir: str, shape: Shape, kv_transfer_config: dict | None = None, **engine_kw) -> Exception:
    """Start an engine that must fail to start; its error, after tearing down what a failed
    start leaves in this process (a started one's shutdown does the same): vLLM's worker
    connector and its model-parallel groups. Left behind, the groups built for this model
    are reused by the next engine (``ensure_model_parallel_initialized`` sees them): a MoE
    model after a dense one then finds no expert-parallel group ("expert parallel group is
    not initialized")."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        EngineRun(model_dir, shape, kv_transfer_config, **engine_kw).close()
    except Exception as err:  # noqa: BLE001  (the test judges the error)
        return err
    finally:
        kv_transfer_state.ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    raise AssertionError(f"the engine for {model_dir} started")


def env_without_offload_vars() -> None:
    """Both connectors read TPU_OFFLOAD_* env: a test's env must not leak into ours."""
    for k in [k for k in os.environ if k.startswith("TPU_OFFLOAD_")]:
        del os.environ[k]
