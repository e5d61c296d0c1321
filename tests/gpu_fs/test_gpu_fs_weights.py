"""Files and snapshots are bound to the weights at start, not only at a reset.

A replica started on new weights under the same model name (the operator
rewrote ``fs_reset_epoch_file``, or the model revision changed) must never
find KV the old weights wrote: its namespace differs from the start.
"""

from __future__ import annotations

import types

from gpu_fs_helpers import offloading_config
from gpu_offload.vllm.fs_specs import fingerprint as vllm_fingerprint
from tpu_offload.connector.fs import fingerprint as tpu_fingerprint


def test_vllm_namespaces_follow_the_epoch_file_at_start(tmp_path):
    epoch = tmp_path / "epoch"
    epoch.write_text("weights-v1\n")
    base = vllm_fingerprint(offloading_config({"num_cpu_chunks": 4}), 0)
    v1 = vllm_fingerprint(offloading_config({"num_cpu_chunks": 4, "fs_reset_epoch_file": str(epoch)}), 0)
    again = vllm_fingerprint(offloading_config({"num_cpu_chunks": 4, "fs_reset_epoch_file": str(epoch)}), 1)
    epoch.write_text("weights-v2\n")
    v2 = vllm_fingerprint(offloading_config({"num_cpu_chunks": 4, "fs_reset_epoch_file": str(epoch)}), 0)
    assert len({base.namespace(), v1.namespace(), v2.namespace()}) == 3
    assert again.cache_salt == v1.cache_salt  # every rank (and the scheduler) agrees


def _tpu_config(revision=None, extra=None):
    spec = types.SimpleNamespace(dtype="bfloat16", num_kv_heads=8, head_size=128)
    kv = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec, layer_names=["a", "b"])])
    vc = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="org/m", revision=revision),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=16),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra or {}),
    )
    return vc, kv


def test_tpu_namespace_and_snapshot_follow_the_revision_and_epoch_file(tmp_path):
    epoch = tmp_path / "epoch"
    epoch.write_text("2026-11-26")
    digests = {
        tpu_fingerprint(*_tpu_config(), 2).digest(),
        tpu_fingerprint(*_tpu_config(revision="abc123"), 2).digest(),
        tpu_fingerprint(*_tpu_config(revision="def456"), 2).digest(),
        tpu_fingerprint(*_tpu_config(extra={"fs_reset_epoch_file": str(epoch)}), 2).digest(),
    }
    assert len(digests) == 4  # the snapshot's index carries this digest, so a snapshot follows too
