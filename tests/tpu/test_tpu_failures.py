"""Bad host bytes and failed transfers become load errors that vLLM recomputes.

The stand-in forward checks every KV position it would attend to, so a load
error that went unreported (upstream: log and carry on) fails these tests.
"""

import numpy as np
import pytest

from tpu_standin import Harness

pytestmark = pytest.mark.engine

BS = 16


def prompt(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(10, 500, size=n)]


@pytest.fixture
def make(mesh, tiny_model_dir):
    made = []

    def _make(**extra):
        extra.setdefault("num_cpu_chunks", 32)
        extra.setdefault("staging_blocks", 8)
        extra.setdefault("blocks_per_chunk", 1)
        h = Harness(mesh, tiny_model_dir, block_size=BS, extra=extra)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.conn_w.shutdown()


def store_prompt(h, p):
    h.add(p, max_tokens=1)
    h.run()
    assert h.sched.reset_prefix_cache()


def corrupt(h, chunk_idx, p):
    key = h.sch._keys(_Probe(p, h))[chunk_idx]
    slot = h.sch.manager.slot_of(key)
    for view in h.wrk.engine.row_views(slot):
        view[: view.size // 2] ^= 0x5A  # every device's shard of the chunk
    return key


class _Probe:
    def __init__(self, p, h):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        r = Request("probe", p, SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
        self.block_hashes = r.block_hashes


def test_corrupted_host_chunk_is_a_load_error_and_recomputed(make):
    h = make(verify_checksums=True)
    p = prompt(6 * BS, 1)
    store_prompt(h, p)
    key = corrupt(h, 3, p)
    h.add(p, max_tokens=2)
    h.run()  # the forward checks all KV it reads: recomputed blocks are right
    assert h.wrk.totals["load_errors"] == 1
    assert h.sch.get_num_new_matched_tokens(_Req(p, h), 0) == (3 * BS, True)  # bad chunk no longer served
    assert key in h.sch._quarantine
    assert h.sch.manager.stats().pinned_chunks == 0


def test_corruption_without_checksums_is_caught_by_the_model_check(make):
    """Control: the same corruption with checksums off reaches the forward."""
    h = make(verify_checksums=False)
    p = prompt(6 * BS, 2)
    store_prompt(h, p)
    corrupt(h, 3, p)
    h.add(p, max_tokens=2)
    with pytest.raises(AssertionError, match="wrong KV"):
        h.run()


@pytest.mark.parametrize("sync_load", [False, True])
def test_failed_load_dispatch_is_recomputed(make, sync_load):
    h = make(sync_load=sync_load)
    p = prompt(5 * BS, 3)
    store_prompt(h, p)
    eng = h.wrk.engine
    real = eng.load
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("injected: H2D transfer failed")

    eng.load = broken
    h.add(p, max_tokens=2)
    h.run()
    assert calls and h.wrk.totals["load_errors"] == 5
    assert h.sch.manager.stats().pinned_chunks == 0
    eng.load = real
    assert h.sch.get_num_new_matched_tokens(_Req(p, h), 0)[0] == 0  # quarantined, not retried forever


def test_transfer_that_fails_after_dispatch_is_recomputed(make):
    """The done array raising (an asynchronous XLA error) is reported too."""
    h = make()
    p = prompt(4 * BS, 4)
    store_prompt(h, p)
    eng = h.wrk.engine
    real = eng.load

    def fails_later(caches, chunks):
        caches, _ = real(caches, chunks)
        return caches, _FailingDone()

    eng.load = fails_later
    h.add(p, max_tokens=2)
    h.run()
    assert h.wrk.totals["load_errors"] == 4
    assert h.sch.manager.stats().pinned_chunks == 0


def test_failed_store_is_never_served(make):
    h = make()
    p = prompt(4 * BS, 5)
    eng = h.wrk.engine
    real = eng.store

    def broken(*a, **k):
        raise RuntimeError("injected: D2H transfer failed")

    eng.store = broken
    h.add(p, max_tokens=1)
    h.run()
    assert h.wrk.totals["store_errors"] == 4
    assert h.sch.manager.stats().used_chunks == 0  # nothing became loadable
    assert not eng.valid.any()
    eng.store = real
    h.add(p + [1, 2], max_tokens=1)  # stored again by the next request (HBM hit, host miss)
    h.run()
    assert h.sch.manager.stats().used_chunks == 4
    assert h.check_tier() == 4


class _Req(_Probe):
    def __init__(self, p, h):
        super().__init__(p, h)
        self.num_tokens = len(p)


class _FailingDone:
    def is_ready(self):
        return True

    def block_until_ready(self):
        raise RuntimeError("injected: asynchronous transfer error")
