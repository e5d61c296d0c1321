"""Side by side with tpu-inference's own TPUOffloadConnector, same engine, same workload.

Both must give the no-connector tokens after a store -> reset -> load round
trip, and we must serve at least as many prefix tokens from the host tier as
it does (counted where vLLM takes them, the same way for both). Theirs runs
in a child process: it is configured by TPU_OFFLOAD_* environment, and both
connectors export the same ``tpu_inference:prefix_cache_*`` metric names, so
they cannot share one process's Prometheus registry. (Step-time overhead:
benchmarks/bench_tpu_engine.py.)
"""

from __future__ import annotations

import pytest

from engine_child import round_trip, run_jobs
from tpu_offload.testing.engine_run import kv_transfer_config, their_kv_transfer_config
from tpu_offload.testing.offload_helpers import OURS, SETUPS
from tpu_offload.testing.workloads import ROUNDTRIP

pytestmark = pytest.mark.engine

THEIR_ENV = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "256", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "32",
             "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "1"}


@pytest.fixture(scope="module")
def theirs(model_dir, tmp_path_factory):
    jobs = [{"shape": s.__dict__, "model_dir": model_dir(s.model, s.dtype), "kv": their_kv_transfer_config(),
             "workload": ROUNDTRIP[s.block_size].name, "env": THEIR_ENV, "round_trip": True}
            for _, s in sorted(SETUPS.items())]
    return dict(zip(sorted(SETUPS), run_jobs(jobs, tmp_path_factory.mktemp("theirs"))))


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_both_connectors_keep_tokens_and_we_hit_at_least_as_much(setup, engines, theirs):
    shape = SETUPS[setup]
    w = ROUNDTRIP[shape.block_size]
    base = engines.baseline(shape, w)
    eng = engines.get(("ours-side-by-side", shape), shape, kv_transfer_config("offload.json", **OURS))
    ours = round_trip(eng, w)
    assert ours["first"] == base and ours["second"] == base
    t = theirs[setup]
    assert t["first"] == base, "tpu-inference's connector, first pass"
    assert t["second"] == base, "tpu-inference's connector, after loading from its host tier"
    assert t["external_hits"] > 0, "tpu-inference's connector served nothing: the comparison is void"
    assert ours["external_hits"] >= t["external_hits"]
    print(f"{setup}: prefix tokens from the host tier: ours {ours['external_hits']}, "
          f"tpu-inference's {t['external_hits']}")
