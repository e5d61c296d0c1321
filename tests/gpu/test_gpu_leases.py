"""Session leases on the vLLM path: the hint in ``kv_transfer_params`` reaches our manager through vLLM's own
request context, and in a real engine the leased session's prefix survives a gap in which another session's
traffic evicts it without the lease."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.kv_offload.base import make_offload_key

from gpu_offload.vllm import metrics
from gpu_offload.vllm.manager import HostTierManager
from tpu_offload.core import leases
from tpu_offload.core.leases import HINT_KEY


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def _ctx(req_id: str, params: dict | None, keys=()):
    """A request context as vLLM's offloading scheduler makes it (``_create_req_context``), positions recorded."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _create_req_context
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    ctx = _create_req_context(Request(request_id=req_id, prompt_token_ids=[1, 2, 3], sampling_params=sp,
                                      pooling_params=None))
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def _store(m: HostTierManager, keys, ctx) -> None:
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx)


@pytest.mark.parametrize("hint", [True, False])
def test_a_hint_in_kv_transfer_params_leases_the_prefix(hint):
    m = HostTierManager(8, 1024)
    params = {HINT_KEY: {"session": "agent", "ttl_s": 60}} if hint else None
    mine = [key(i) for i in range(4)]
    ctx = _ctx("a", params, mine)
    m.on_new_request(ctx)
    _store(m, mine, ctx)
    m.on_request_finished(ctx)
    other = _ctx("b", None)
    for j in range(3):  # another session: 12 chunks through an 8-chunk tier
        _store(m, [key(100 + 4 * j + i) for i in range(4)], other)
    kept = [m.index.lookup(k).name == "HIT" for k in mine]
    assert kept == [hint] * 4
    values = m.get_stats()._values
    if hint:
        assert m.leases.sessions() == 1 and m.leases.honoured > 0
        assert values[metrics.LEASED_BYTES] == {metrics.TIER: 4 * 1024}
        assert values[metrics.LEASE_HONOURED][metrics.TIER] == m.leases.honoured
    else:
        assert m.leases.sessions() == 0


def test_the_session_coming_back_renews_and_a_reset_empties_the_table():
    clock = [0.0]
    m = HostTierManager(8, 1024)
    m.leases = leases.LeaseTable(16, 4, lambda: clock[0])
    m._lru = m._new_index()
    params = {HINT_KEY: {"session": "agent", "ttl_s": 30}}
    mine = [key(i) for i in range(4)]
    ctx = _ctx("a", params, mine)
    m.on_new_request(ctx)
    _store(m, mine, ctx)
    m.on_request_finished(ctx)
    clock[0] = 25
    m.on_new_request(_ctx("a2", params))  # the next turn arrives: 30 s from now
    clock[0] = 50
    assert m.leases.expire() == 0 and len(m.leases) == 4
    m.reset_cache()
    assert m.leases.sessions() == 0 and m.index.leases is m.leases


# ---- a real engine ------------------------------------------------------------------------------------------

BLOCK = 128  # vLLM CPU block size, in tokens (one chunk per block here)
TIER = 16  # chunks: the host tier this test shrinks the engine's to


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 500, size=n).tolist()


def _generate(llm, prompt: list[int], params: dict | None = None) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.fixture
def small_tier(engine):
    """The shared engine's manager on a 16-chunk index (a subset of the workers' slots), restored after."""
    llm, worker, manager = engine
    saved = manager.num_chunks, manager.leases
    manager.num_chunks = TIER
    manager.leases = leases.table_for(0.5, 64, TIER)
    _new_index(manager)
    try:
        yield llm, manager
    finally:
        manager.num_chunks, manager.leases = saved
        _new_index(manager)


def _new_index(manager) -> None:
    evictions = manager.index.evictions  # monotonic, as reset_cache keeps it
    manager._lru = manager._new_index()
    manager._lru.evictions = evictions


@pytest.mark.engine
@pytest.mark.parametrize("lease", [True, False])
def test_a_leased_session_keeps_its_prefix_through_a_tool_gap(small_tier, lease):
    llm, manager = small_tier
    seed = 7000 if lease else 8000
    params = {HINT_KEY: {"session": f"agent-{seed}", "ttl_s": 300}} if lease else None
    turn1 = _prompt(seed, 4 * BLOCK + 20)  # 4 full chunks
    _generate(llm, turn1, params)
    # the tool gap: another session's turns push 20 chunks through the 16-chunk tier
    for i in range(5):
        _generate(llm, _prompt(seed + 1 + i, 4 * BLOCK + 20))
    llm.reset_prefix_cache()  # vLLM's own cache forgets everything: the next turn can hit only our tier
    hits = manager.hit_chunks
    turn2 = turn1 + _prompt(seed + 99, 100)
    _generate(llm, turn2, params)
    assert manager.hit_chunks - hits == (4 if lease else 0)
    if lease:
        assert manager.leases.honoured > 0 and manager.leases.sessions() == 1
