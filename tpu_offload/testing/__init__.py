"""The real tpu-inference engine on JAX's CPU backend, for tests, demos and benchmarks.

The test suite (``tests/tpu_engine``), the demo (``demos/tpu_inference_demo.py``) and the
real-engine benchmarks all start the same engine the same way: ``cpu_support`` replaces what
cannot run without a TPU, ``engine_run`` starts and tears down one engine, ``tiny_models`` and
``tiny_families`` write random-weight checkpoints, ``workloads`` names the prompts,
``offload_helpers`` reaches our connector inside the engine, ``serve`` runs the OpenAI
server (``python -m tpu_offload.testing.serve``), and ``pass_counts`` counts what one pass dispatches
per host path (``benchmarks/bench_tpu_aot.py`` and ``tests/tpu_compiler``), ``compile_cache``
gives a test session a fresh persistent compile cache, and ``file_times`` (a pytest plugin) ends
every suite with its slowest files. They live in the package, not under
``tests/``, so demos and benchmarks import them as modules instead of putting a test
directory on ``sys.path``.

An engine-harness layer: it imports JAX, vLLM and tpu-inference. Nothing else in
``tpu_offload`` imports it (``tests/core/test_core_testing_layer.py`` checks), and importing this
package imports nothing: each module says what its import costs.
"""
