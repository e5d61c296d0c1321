"""In-process vLLM engines for the vLLM-path tests (plain module: imported by name)."""

from __future__ import annotations

import gc

from gpu_offload.vllm import selection


def kv_transfer_config(cpu_bytes: int = 64 << 20, **extra) -> dict:
    return selection.kv_transfer_config(cpu_bytes, **extra)


def start_engine(model_dir: str, **kw):
    """(llm, worker, manager) of a new in-process engine with our spec."""
    from vllm import LLM

    from gpu_offload import testing

    old = {id(x) for x in testing.live_workers() + testing.live_managers()}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              enforce_eager=True, max_num_seqs=4, kv_transfer_config=kv_transfer_config(),
              disable_log_stats=False, **kw)
    (worker,) = [w for w in testing.live_workers() if id(w) not in old]
    (manager,) = [m for m in testing.live_managers() if id(m) not in old]
    return llm, worker, manager


def stop_engine(llm) -> None:
    """Shut an in-process engine down (vLLM's own teardown: connector, workers, dist env)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
