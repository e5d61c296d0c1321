"""vLLM's model-inspection process, with the platform this test bed runs.

``cpu_support.apply()`` points vLLM's ``registry._SUBPROCESS_COMMAND`` here.
vLLM runs ``python -m vllm.model_executor.models.registry`` to import a model
class away from the engine process; on its own, that process would see both
the ``tpu`` and ``cpu`` platform plugins and refuse. This one prepares vLLM
exactly as the engine process did, then hands over to vLLM's own ``_run``.
It runs as ``python -m tpu_offload.testing.registry_child``, beside
``cpu_support``, which every engine process here imports (tests, demos and
benchmarks alike).
"""

from __future__ import annotations

from tpu_offload.testing import cpu_support

if __name__ == "__main__":
    cpu_support.prepare_vllm()
    from vllm.model_executor.models.registry import _run

    _run()
