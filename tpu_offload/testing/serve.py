"""tpu-inference's OpenAI server on JAX CPU: ``python -m tpu_offload.testing.serve <server args>``.

The same arguments as ``python -m vllm.entrypoints.openai.api_server``
(``--model``, ``--kv-transfer-config``, ``--port`` ...). ``cpu_support`` is
applied at import, so it is applied again in the engine-core process: that
process is spawned (forking after JAX has started its threads can deadlock)
and a spawned child re-imports this module as its main module. TP up to
``engine_run.DEVICES`` emulated devices. In ``tpu_offload.testing`` so that the
serving benchmark (``benchmarks/bench_serving_tpu.py``) starts it as a module.
"""

from __future__ import annotations

import os
import sys

from tpu_offload.testing import engine_run

engine_run.prepare_process(keep_offload_vars=True)  # the operator's settings, as `vllm serve` would
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

from tpu_offload.testing import cpu_support  # noqa: E402

cpu_support.apply()


def main() -> None:
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    serve()


if __name__ == "__main__":
    main()
