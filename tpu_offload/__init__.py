"""KV-cache offloading for tpu-inference (JAX) and vLLM (torch), one shared core.

Importing this package imports nothing heavy; the JAX backend lives in
``tpu_offload.jax_backend`` and the tpu-inference connector in
``tpu_offload.connector``. ``tpu_offload.testing`` runs the real tpu-inference
engine on JAX CPU for tests, demos and benchmarks; nothing else imports it.
"""

__version__ = "0.1.0"
