"""tpu-inference's RaidenOffloadConnector (copies through tpu-sync, no staging), with the ordering fix.

The connector runs through raiden_adapter (the published wheel's import name
and store calls) with ``wait_for_forward``: a step's saves wait until the
step's forward has written the KV cache. After a store -> reset -> load round
trip, with the device KV cache zeroed in place before the load (so the tokens
can only come from what the connector restored), it must give the
no-connector tokens and have served prefix tokens from its host tier. As
shipped (no wait) it restores blocks copied before the forward wrote them;
that result, and each connector's step-thread time per pass, is measured by
benchmarks/bench_step_thread_tpu.py rather than asserted here. It runs in a
child process, as tpu-inference's other connector does (both export the same
``tpu_inference:prefix_cache_*`` metric names).
"""

from __future__ import annotations

import pytest

from tpu_offload.testing import raiden_adapter
from engine_child import run_jobs
from tpu_offload.testing.engine_run import Shape
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine

RAIDEN_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "256", "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}
SHAPES = {"tp1-bf16-bs16": Shape("kv4", "bfloat16", tp=1, block_size=16, num_blocks=40),
          "tp2-bf16-bs16": Shape("kv4", "bfloat16", tp=2, block_size=16, num_blocks=40)}


@pytest.fixture(scope="module")
def raiden(model_dir, tmp_path_factory):
    jobs = [{"shape": s.__dict__, "model_dir": model_dir(s.model, s.dtype),
             "kv": raiden_adapter.kv_transfer_config(ordered=True), "workload": ROUNDTRIP[s.block_size].name,
             "env": RAIDEN_ENV, "round_trip": True, "zero_device": True} for _, s in sorted(SHAPES.items())]
    return dict(zip(sorted(SHAPES), run_jobs(jobs, tmp_path_factory.mktemp("raiden"))))


@pytest.mark.parametrize("setup", sorted(SHAPES))
def test_raiden_with_the_ordering_fix_restores_the_cold_tokens(setup, engines, raiden):
    shape = SHAPES[setup]
    base = engines.baseline(shape, ROUNDTRIP[shape.block_size])
    r = raiden[setup]
    assert r["external_hits"] > 0, "Raiden served nothing from its host tier: the round trip is void"
    assert r["first"] == base, "Raiden's connector, first pass"
    assert r["second"] == base, "Raiden's connector, after restoring into a zeroed KV cache"
