"""Shared harness of the serving benchmarks (``bench_serving_vllm.py``, ``bench_serving_tpu.py``).

The llm-d tiered-prefix-cache guides judge an offloading connector with inference-perf
(``type: concurrent`` over ``shared_prefix`` data) against an OpenAI server; these modules
start such servers on this machine, drive inference-perf (its own Python 3.12 venv),
scrape ``/metrics``, listen to the KV events and write the guides' table.
"""
