"""Our file tier under vLLM's own ``TieringOffloadingSpec`` (``gpu_offload.vllm.secondary_tier``).

The tier is loaded as vLLM loads an out-of-tree tier (``type`` +
``module_path`` in ``secondary_tiers``) and driven through vLLM's
scheduler-side ``TieringOffloadingManager``: stores cascade from the CPU
primary tier, loads promote into it (``gpu_offload.testing.tiering`` plays
the worker, whose copies need CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from gpu_offload.testing.tiering import Engine, new_keys, tiering_spec
from gpu_offload.vllm import metrics
from gpu_offload.vllm.secondary_tier import SharedFileTier
from tpu_offload.core.config import ConfigError
from tpu_offload.core.fs.auth import make_secret_file
from tpu_offload.core.fs.format import HEADER_SIZE

BPB = 64 << 10  # one block (= one chunk) of KV per row
CPU = 4 << 20
MOD = "gpu_offload.vllm.secondary_tier"


@pytest.fixture(scope="module", autouse=True)
def _fresh_process_registry():
    """As in a fresh engine process: the suite's earlier vLLM engines (our HostOffloadSpec, whose
    tpu_offload_fs_* series vLLM's stat logger registers) leave their collectors in the default registry,
    as a restarted engine would find them released (``release_prometheus_names``)."""
    from prometheus_client import REGISTRY

    from gpu_offload.vllm.metrics import release_prometheus_names  # what vLLM's engine restart does
    from tpu_offload.core.fs import metrics as fs_metrics

    release_prometheus_names()
    for collector, names in list(REGISTRY._collector_to_names.items()):  # an earlier FsMetrics' own, too
        if any(n.startswith("tpu_offload_fs_") for n in names):
            REGISTRY.unregister(collector)
    fs_metrics._CACHE.pop(REGISTRY, None)
    yield


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TPU_OFFLOAD_"):
            monkeypatch.delenv(k)


@pytest.fixture
def entry(tmp_path):
    secret = tmp_path / "secret"
    make_secret_file(str(secret))
    return {"type": "SharedFileTier", "module_path": MOD, "shared_storage_path": str(tmp_path / "kv"),
            "fs_secret_file": str(secret)}


@pytest.fixture
def engines():
    made = []

    def make(*tiers, **kw):
        e = Engine(tiering_spec(list(tiers), bytes_per_block=BPB, cpu_bytes=kw.pop("cpu_bytes", CPU), **kw))
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _payloads(e: Engine, n: int) -> list[np.ndarray]:
    return [np.random.randint(0, 256, e.row_bytes, dtype=np.uint8) for _ in range(n)]


def _same(got, keys, data) -> list[bool]:
    return [got[k] is not None and bool((got[k] == d).all()) for k, d in zip(keys, data)]


def test_vllm_loads_the_tier_from_type_and_module_path(engines, entry):
    e = engines(entry)
    (tier,) = e.secondary
    assert type(tier) is SharedFileTier and tier.tier_type == "SharedFileTier"
    assert tier.tier.authenticated and tier.tier.chunk_bytes == e.row_bytes


def test_store_then_load_round_trip_through_the_file_tier(engines, entry):
    e = engines(entry)
    keys = new_keys(6)
    data = _payloads(e, 6)
    assert e.store(keys, data) == 6
    assert e.secondary[0].tier.counters()["writes_ok"] == 6
    e.drop_primary()  # hits can now only come from files
    got = e.load(keys)
    assert _same(got, keys, data) == [True] * 6
    assert e.secondary[0].tier.counters()["reads_ok"] == 6


def test_lookups_answer_off_the_scheduler_thread(engines, entry):
    e = engines(entry)
    keys = new_keys(1)
    e.store(keys, _payloads(e, 1))
    e.drop_primary()
    ctx = ReqContext(req_id="r")
    e.manager.on_new_request(ctx)
    assert e.manager.lookup(keys[0], ctx) is LookupResult.RETRY  # the stat runs on vLLM's lookup thread
    e.manager.on_request_finished(ctx)
    e.settle()


def test_a_second_engine_reads_what_the_first_wrote(engines, entry):
    first, second = engines(entry), engines(entry)
    keys = new_keys(4)
    data = _payloads(first, 4)
    first.store(keys, data)
    assert _same(second.load(keys), keys, data) == [True] * 4


def test_forged_and_junk_files_at_a_chunks_name_are_misses(engines, entry, tmp_path):
    first = engines(entry)
    keys = new_keys(3)
    data = _payloads(first, 3)
    first.store(keys, data)
    ours = first.secondary[0].tier
    # A forger without our secret: a well-formed file (valid checksums) signed with another key.
    other_secret = tmp_path / "other"
    make_secret_file(str(other_secret))
    forger = engines({**entry, "shared_storage_path": str(tmp_path / "forger"), "fs_secret_file": str(other_secret)})
    fake = _payloads(forger, 1)
    forger.store(keys[:1], fake)
    forged = Path(forger.secondary[0].tier.path_of(keys[0])).read_bytes()
    Path(ours.path_of(keys[0])).write_bytes(forged)
    Path(ours.path_of(keys[1])).write_bytes(os.urandom(HEADER_SIZE + first.row_bytes))  # junk of the right size
    reader = engines(entry)
    got = reader.load(keys)
    assert got[keys[0]] is None and got[keys[1]] is None  # never served
    assert _same(got, keys[2:], data[2:]) == [True]
    c = reader.secondary[0].tier.counters()
    assert c.get("auth_failures", 0) + c.get("corrupt", 0) == 2, c  # each rejected, counted
    assert reader.load(keys[:2]) == {keys[0]: None, keys[1]: None}  # and not offered again


def test_byte_budget_is_respected(engines, entry, tmp_path):
    e = engines({**entry, "fs_capacity_bytes": 4 * (HEADER_SIZE + BPB)})
    file_bytes = HEADER_SIZE + e.row_bytes
    keys = new_keys(12)
    for i in range(0, 12, 3):
        e.store(keys[i:i + 3], _payloads(e, 3))
    e.secondary[0].tier.flush()
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size == file_bytes]
    assert 0 < len(files) * file_bytes <= 4 * (HEADER_SIZE + BPB)
    assert e.secondary[0].tier.usage()["used_bytes"] <= 4 * (HEADER_SIZE + BPB)
    assert e.secondary[0].tier.counters()["evicted"] >= 8


def test_no_secret_is_refused_unless_opted_out(engines, entry):
    bare = {k: v for k, v in entry.items() if k != "fs_secret_file"}
    with pytest.raises(ConfigError, match="without a secret"):
        engines(bare)
    e = engines({**bare, "fs_allow_unauthenticated": True})
    assert not e.secondary[0].tier.authenticated


@pytest.mark.parametrize("key,value,allowed", [
    ("fs_capacity_bytes", "lots", "a byte count"),
    ("fs_threads", 0, "an integer >= 1"),
    ("locality", "mars", "LOCAL or REMOTE"),
    ("fs_capacty_bytes", 1, "allowed keys"),
])
def test_a_bad_entry_is_one_error_naming_key_value_and_allowed(engines, entry, key, value, allowed):
    with pytest.raises(ConfigError) as err:
        engines({**entry, key: value})
    msg = str(err.value)
    assert f"secondary_tiers entry key {key!r}" in msg and repr(value) in msg and allowed in msg, msg


def test_kv_events_for_stores_and_evictions(engines, entry):
    e = engines({**entry, "enable_kv_events": True, "fs_capacity_bytes": 2 * (HEADER_SIZE + BPB)}, events=True)
    keys = new_keys(4)
    e.store(keys, _payloads(e, 4))
    e.secondary[0].tier.flush()
    events = list(e.secondary[0].take_events())
    stored = [k for ev in events if not ev.removed for k in ev.keys]
    removed = [k for ev in events if ev.removed for k in ev.keys]
    assert sorted(stored) == sorted(keys) and len(removed) >= 2
    assert all(ev.medium.name == "STORAGE" for ev in events)


def test_store_jobs_feed_vllms_backpressure_detector(engines, entry):
    bp = {"backpressure_cls": "EMABackpressureDetector", "warmup_completions": 1}
    e = engines({**entry, "backpressure": bp})
    det = e.secondary[0].bp_detector
    assert det is not None and det.stats["store_latency_ema"] == 0.0
    e.store(new_keys(4), _payloads(e, 4))
    assert det.stats["store_latency_ema"] > 0.0  # from the bytes and time our finished store jobs report


REPO = Path(__file__).resolve().parents[2]


def _doc_configs() -> list[dict]:
    import json
    import re

    text = (REPO / "docs/vllm-tiers.md").read_text()
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, re.S) if '"kv_connector"' in b]


def test_the_docs_show_the_shipped_configs():
    import json

    shipped = [json.loads((REPO / f"configs/vllm/{n}.json").read_text())
               for n in ("offload-host-fs", "tiering-shared-fs")]
    assert _doc_configs() == shipped


def test_both_documented_configs_load(tmp_path, engines):
    from gpu_offload.testing.hooks import offloading_config

    host, tiering = _doc_configs()
    secret = tmp_path / "secret"
    make_secret_file(str(secret))
    here = {"shared_storage_path": str(tmp_path / "kv"), "fs_secret_file": str(secret)}
    # Our whole stack: HostOffloadSpec (host budget shrunk to this machine's).
    from gpu_offload.spec import HostOffloadSpec

    extra = {**host["kv_connector_extra_config"], **here, "cpu_bytes_to_use": 16 << 20}
    manager = HostOffloadSpec(offloading_config(extra, blocks_per_chunk=2)).get_manager()
    assert manager.files is not None
    manager.shutdown()
    # vLLM's own offloading with only our file tier under it.
    extra = tiering["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and "spec_module_path" not in extra  # vLLM's own spec
    (tier,) = extra["secondary_tiers"]
    e = engines({**tier, **here})
    (ours,) = e.secondary
    assert type(ours) is SharedFileTier and ours.tier.capacity_bytes == 4 << 40
    assert ours.locality.value == "REMOTE" and ours.bp_detector is not None
    keys = new_keys(2)
    data = _payloads(e, 2)
    e.store(keys, data)
    e.drop_primary()
    assert _same(e.load(keys), keys, data) == [True, True]


def test_reads_and_writes_never_run_on_the_scheduler_thread(engines, entry):
    """vLLM's contract: submit_store / submit_load return at once; the I/O runs on the tier's threads."""
    import threading
    import time

    e = engines(entry)
    files = e.secondary[0].tier.files
    gate, io_threads = threading.Event(), set()

    def held(fn):
        def run(*a, **kw):
            io_threads.add(threading.get_ident())
            assert gate.wait(30)
            return fn(*a, **kw)
        return run

    keys = new_keys(3)
    data = _payloads(e, 3)
    write, read = files.write, files.read
    files.write = held(write)
    e.store(keys, data, settle=False)  # returns while every write is held
    assert e.manager.has_pending_work()
    gate.set()
    e.settle()
    files.write = write
    assert e.secondary[0].tier.counters()["writes_ok"] == 3
    e.drop_primary()
    gate.clear()
    files.read = held(read)
    ctx = ReqContext(req_id="held")
    e.manager.on_new_request(ctx)
    for _ in range(200):  # lookups resolve, promotions are submitted, every read is held
        states = [e.manager.lookup(k, ctx) for k in keys]
        e.step()
        if all(s is LookupResult.HIT_PENDING for s in states):
            break
        time.sleep(0.02)
    assert all(s is LookupResult.HIT_PENDING for s in states), states
    gate.set()
    e.manager.on_request_finished(ctx)
    e.settle()
    files.read = read
    assert threading.get_ident() not in io_threads and io_threads
    assert _same(e.load(keys), keys, data) == [True] * 3


def test_file_metrics_reach_the_process_registry(engines, entry):
    from prometheus_client import REGISTRY

    e = engines(entry)
    labels = {"tier": e.secondary[0].tier.name, "op": "write"}
    before = REGISTRY.get_sample_value("tpu_offload_fs_bytes_total", labels) or 0.0
    e.store(new_keys(2), _payloads(e, 2))
    assert REGISTRY.get_sample_value("tpu_offload_fs_bytes_total", labels) - before == 2 * e.row_bytes


@pytest.mark.parametrize("hint", [True, False])
def test_a_lease_hint_keeps_a_sessions_files_through_other_traffic(engines, entry, hint):
    """The hint in kv_transfer_params reaches the file tier (it runs in the scheduler's process): the leased
    prefix's files outlive other traffic that evicts them without it."""
    from tpu_offload.core.leases import HINT_KEY

    e = engines({**entry, "fs_capacity_bytes": 8 * (HEADER_SIZE + BPB)})
    tier = e.secondary[0].tier
    mine = new_keys(4)
    e.store(mine, _payloads(e, 4), params={HINT_KEY: {"session": "agent", "ttl_s": 120}} if hint else None)
    tier.flush()
    assert all(tier.contains(k) for k in mine)
    for _ in range(3):  # another session: 12 chunks through an 8-file tier
        e.store(new_keys(4), _payloads(e, 4))
        tier.flush()
    assert [tier.contains(k) for k in mine] == [hint] * 4
    assert tier.leases.sessions() == int(hint) and (tier.leases.honoured > 0) == hint
    # what vLLM's stats channel carries to its API server, through the tiering manager's get_stats
    values = e.manager.get_stats()._values
    label = (tier.name,)
    assert values[metrics.LEASED_BYTES][label] == (4 * tier.chunk_bytes if hint else 0)
    assert values.get(metrics.LEASE_HONOURED, {}).get(label, 0) == tier.leases.honoured
    e.manager.get_stats()  # counters are increases since the last call
    assert label not in e.manager.get_stats()._values.get(metrics.LEASE_HONOURED, {})


def test_the_lease_series_are_declared_to_vllm(entry):
    """vLLM builds its Prometheus series from the spec's definitions, each secondary tier's included."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    defs = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [entry]})
    for name in (metrics.LEASED_BYTES, metrics.LEASE_HONOURED, metrics.LEASES_EXPIRED):
        assert defs[name].labelnames == ("tier",), name
