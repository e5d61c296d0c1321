"""Multi-host lockstep: two real JAX processes on loopback (4 CPU devices each, one 8-device mesh).

Every host must allocate, compile and launch the same programs: one that sized
a buffer differently or refused alone stalls the mesh (tpu-inference #3429).
Each process sees different figures, injected through the worker's own
overrides as a host would measure them; registration must end in one decision
(jax_backend/agree.py): identical sizes, or every host refusing with the same
message naming the host and its figure, or an error, never a hang, when a peer
never registers. Then a store and load round trip on both host paths, with a
chunk lost on one host only.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.jax

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT = 400
LAYERS_IN_CHILD = 2  # multihost_child.LAYERS

SCENARIOS = [
    # Different free host memory and slab limits: both start, with the least slab size of the two.
    {"name": "sizes", "kind": "register",
     "worker_by": {"0": {"free_host_bytes": 1 << 30, "max_slab_bytes": 1 << 20},
                   "1": {"free_host_bytes": 20_000, "max_slab_bytes": 6_000}}},
    # Host 1's share of the tier (16 KiB) does not fit its free memory: both refuse.
    {"name": "host", "kind": "register", "worker_by": {"1": {"free_host_bytes": 10_000}}},
    # Host 1's staging does not fit its free HBM: both refuse.
    {"name": "hbm", "kind": "register",
     "worker_by": {"0": {"free_hbm_bytes": 1 << 30}, "1": {"free_hbm_bytes": 1_000}}},
    # Host 1 was started with another staging size (its own TPU_OFFLOAD_NUM_STAGING_BLOCKS): both refuse.
    {"name": "settings", "kind": "register", "config_by": {"1": {"staging_blocks": 8}}},
    {"name": "program", "kind": "roundtrip", "config": {"transfer_path": "program"}, "lose": {"on": 1, "slot": 1}},
    {"name": "device_put", "kind": "roundtrip", "config": {"transfer_path": "device_put"},
     "lose": {"on": 1, "slot": 1}},
    {"name": "control", "kind": "control"},
    # (the DMA kernel's TPU interpret mode does not run across JAX processes: it hung here)
    {"name": "dp", "kind": "dp", "kernel": "loop"},
    {"name": "snapshot", "kind": "snapshot"},  # "dir": the test's tmp dir
    {"name": "snapshot_save", "kind": "snapshot_save"},
    # Host 1 never registers (stuck or dead before it): host 0 gives up after the timeout, naming it.
    {"name": "stall", "kind": "stall", "on": 1, "seconds": 15, "config": {"multihost_timeout_s": 3.0}},
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    port = free_port()
    scenarios = [dict(sc, dir=str(tmp_path_factory.mktemp("snap"))) if sc["kind"].startswith("snapshot") else sc
                 for sc in SCENARIOS]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_child.py"), str(pid), str(port),
                               json.dumps(scenarios)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for pid in (0, 1)]
    out = {}
    try:
        for pid, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            out[pid] = {m["scenario"]: m for m in lines if "scenario" in m}
            assert out[pid] or pid == 1, f"process {pid} exited {p.returncode}:\n{stderr[-3000:]}"
            out[pid]["_stderr"] = stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return out


def both(results, name):
    got = [results[pid].get(name) for pid in (0, 1)]
    assert all(got), f"scenario {name} missing: {got}\n{results[0]['_stderr']}\n{results[1]['_stderr']}"
    return got


def test_sizes_are_min_reduced_across_hosts(results):
    a, b = both(results, "sizes")
    assert a["ok"] and b["ok"], (a, b)
    # host 0 alone would make one slab of 8 chunks, host 1 slabs of 2 (6,000 bytes of 2,048-byte chunk shares)
    assert a["rows_per_slab"] == b["rows_per_slab"] == 2
    assert a["slab_rows"] == b["slab_rows"] == [2, 2, 2, 2]
    assert a["slab_shapes"] == b["slab_shapes"]


@pytest.mark.parametrize("name, figure", [("host", "to at most 4"), ("hbm", "only 0.00 MiB is free"),
                                          ("settings", "process 1 (")])
def test_one_host_refusing_makes_every_host_refuse_alike(results, name, figure):
    a, b = both(results, name)
    assert not a["ok"] and not b["ok"], (a, b)
    assert a["type"] == b["type"] == "ConfigError"
    assert a["error"] == b["error"]
    assert "process 1 (" in a["error"] and figure in a["error"], a["error"]
    if name == "settings":
        assert "disagree on staging_blocks" in a["error"] and "has 8" in a["error"] and "has 4" in a["error"]
    else:
        assert "1 of 2 JAX processes refused" in a["error"] and "process 0 (" not in a["error"]


@pytest.mark.parametrize("path", ["program", "device_put"])
def test_round_trip_and_a_chunk_lost_on_one_host(results, path):
    a, b = both(results, path)
    assert a["path"] == b["path"] == path
    assert a["ok"] and b["ok"], "a process's shards were not restored bit-exactly"
    assert a["finished_recving"] == b["finished_recving"] == ["b"]
    assert [s[2] for s in a["stores"]] == [s[2] for s in b["stores"]] == [[]]
    assert [s[2] for s in a["loads"]] == [s[2] for s in b["loads"]] == [[]]
    # host 1 lost slot 1: both launched the same loads (same programs), only host 1 reports the chunk,
    # and the scheduler fails the op on the union of the reports (test_tpu_multiprocess.py)
    assert a["launched"] == b["launched"] == [[0, 1, 2], [0, 1, 2]]
    host = ["store", "load", "load"] if path == "program" else ["take_chunks", "put_chunks", "put_chunks"]
    assert a["programs"] == b["programs"] == ["gather", host[0], host[1], "scatter", host[2], "scatter"]
    assert a["loads_after_loss"] == [[3, 0, []]] and b["loads_after_loss"] == [[3, 1, [1]]]
    assert a["load_errors"] == [] and b["load_errors"] == [14]
    assert a["ok_after_loss"] and b["ok_after_loss"]
    # nothing compiled while serving: on the device_put path the transfers are runtime copies, not programs
    assert a["compiles_while_serving"] == b["compiles_while_serving"] == []


def test_dp_ranks_on_two_hosts_keep_their_chunks_at_home(results):
    """Attention-DP rank r on host r: each host holds only its own rank's partition of the slots (rows
    [0, 2) on host 0, [2, 4) on host 1), and chunks cross between the hosts only when a load needs them,
    bit-exact on both hosts' shards, with nothing compiled while serving."""
    a, b = both(results, "dp")
    assert a["kernel"] == b["kernel"] == "loop"
    assert a["ok"] and b["ok"], (a, b)
    assert a["slab_rows_here"] == [[0, 2]] and b["slab_rows_here"] == [[2, 4]]
    assert a["slab_shape"] == b["slab_shape"] == [4, 1, LAYERS_IN_CHILD, 4, 8, 16]
    assert a["compiles_while_serving"] == b["compiles_while_serving"] == []


def test_control_device_put_of_a_global_array_is_a_program(results):
    """What the device_put path avoids, seen by the same compile counter."""
    a, b = both(results, "control")
    assert not a["fully_addressable"]
    assert a["compiles"] and a["compiles"] == b["compiles"], (a, b)


def test_warm_start_only_if_every_host_has_a_snapshot(results):
    """Host 0 alone has slabs that fit: a host restoring (or re-allocating) alone would launch a program its
    peer does not. Both start cold, with their slabs as allocated, and launch nothing."""
    a, b = both(results, "snapshot")
    assert a["fits"] and not b["fits"]
    assert a["restored"] is None and b["restored"] is None
    assert a["programs"] == b["programs"] == []
    assert a["slabs_alive"] and b["slabs_alive"]


def test_a_snapshot_save_failing_on_one_host_fails_on_every_host(results):
    """The hosts meet through the coordination service, not a device barrier: host 1 failing to write its
    part ends the save on both with the same error naming it, quickly, and the earlier snapshot stays."""
    a, b = both(results, "snapshot_save")
    assert a["first"] == b["first"] == 0  # nothing valid yet: the slabs and metas all the same
    assert a["saved"] == b["saved"] == ["meta-p0.json", "meta-p1.json", "slabs"]
    assert a["error"] and a["error"] == b["error"], (a, b)
    assert "slab snapshot not saved, on any host" in a["error"] and "process 1 (" in a["error"]
    assert "process 0 (" not in a["error"] and "No space left on device" in a["error"]
    assert a["seconds"] < 20 and b["seconds"] < 20
    assert a["kept"] == b["kept"] == "first"
    assert a["left_behind"] == [], a["left_behind"]  # the failed save's temporary directory is gone


def test_a_peer_that_never_registers_is_an_error_not_a_hang(results):
    a = results[0].get("stall")
    assert a is not None, results[0]["_stderr"]
    assert not a["ok"] and a["type"] == "AgreementError", a
    assert "process 1" in a["error"] and "3 s" in a["error"] and "multihost_timeout_s" in a["error"]
    assert a["seconds"] < 20
