"""Configuration: llm-d's environment works unchanged, JSON overrides it,
contradictions and impossible sizes fail with a clear message."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tpu_offload.connector.settings import resolve
from tpu_offload.core.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
LLMD_ENV = {  # guides/tiered-prefix-cache TPU v7 overlay, plus knobs tpu-inference reads
    "TPU_OFFLOAD_NUM_CPU_CHUNKS": "25000",
    "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "1000",
    "TPU_OFFLOAD_DECODE_SAVE": "1",
    "TPU_OFFLOAD_SKIP_JAX_PRECOMPILE": "0",
    "TPU_OFFLOAD_BATCHED_SAVE": "1",
    "TPU_OFFLOAD_SAVE_THREADS": "1",
    "SKIP_JAX_PRECOMPILE": "0",
}


def page(block_size=128, kv_heads=8, head=128, layers=64, itemsize=2):
    """vLLM's spec for Qwen3-32B-like KV: 32 KiB/token per rank x 8 ranks in one process."""
    spec = SimpleNamespace(page_size_bytes=2 * block_size * kv_heads * head * itemsize)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])])


def vllm_config(extra=None, block_size=128, pp=1, dp=1, policy="recompute"):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}, kv_load_failure_policy=policy),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, data_parallel_size=dp),
        cache_config=SimpleNamespace(block_size=block_size),
    )


def test_llmd_overlay_env_unchanged():
    s = resolve(vllm_config(), page(), env=LLMD_ENV)
    assert s.num_slots == 25000 and s.staging_blocks == 1000 and s.blocks_per_chunk == 1
    assert s.config.decode_save and not s.config.skip_precompile
    assert s.chunk_bytes == 64 * 2 * 128 * 8 * 128 * 2  # 32 MiB: one 128-token block, all layers


def test_extra_config_overrides_env_and_sizes_in_bytes():
    s = resolve(vllm_config({"cpu_bytes": "720GiB", "staging_blocks": 512, "decode_save": False}), page(), env=LLMD_ENV)
    assert s.num_slots == 720 * 1024 // 32  # bytes replace the env's chunk count
    assert s.staging_blocks == 512 and not s.config.decode_save
    s = resolve(vllm_config({"block_size": 512}), page(), env=LLMD_ENV)  # vLLM's tokens-per-chunk key
    assert s.blocks_per_chunk == 4 and s.chunk_tokens == 512
    assert s.staging_blocks == 1000  # whole chunks of 4 blocks


@pytest.mark.parametrize("extra,env,needle", [
    ({"num_cpu_chunks": 10, "cpu_bytes": "1GiB"}, {}, "both size the host tier"),
    ({"blocks_per_chunk": 8, "staging_blocks": 4, "num_cpu_chunks": 4}, {}, "at least 8"),
    ({"block_size": 100}, {}, "multiple of the engine block size 128"),
    ({"num_cpu_chunk": 10}, {}, "did you mean 'num_cpu_chunks'"),
    ({}, {"TPU_OFFLOAD_NUM_STAGING_BLOCK": "8"}, "did you mean"),
    ({"host_memory_kind": "device"}, {}, "pinned_host"),
])
def test_bad_settings_fail_clearly(extra, env, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve(vllm_config(extra), page(), env=env)


def test_parallelism_guards():
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        resolve(vllm_config({"num_cpu_chunks": 4}, pp=2), page(), env={})
    with pytest.raises(ConfigError, match="data_parallel_size"):
        resolve(vllm_config({"num_cpu_chunks": 4}, dp=2), page(), env={})


def test_names_what_the_tpu_connector_does_not_read(monkeypatch):
    """llm-d's tpu-inference variables and vLLM's own keys are accepted, and named once as having no effect."""
    import tpu_offload.connector.settings as settings_mod

    seen = []
    monkeypatch.setattr(settings_mod.log, "warning", lambda msg, *a: seen.append(msg % a))
    resolve(vllm_config({"eviction_policy": "lru"}), page(), env=LLMD_ENV)
    (msg,) = [m for m in seen if "no effect with the TPU connector" in m]
    assert "TPU_OFFLOAD_BATCHED_SAVE" in msg and "TPU_OFFLOAD_SAVE_THREADS" in msg and "'eviction_policy'" in msg, msg
    assert "TPU_OFFLOAD_NUM_STAGING_BLOCKS" not in msg and "DECODE_SAVE" not in msg


def test_snapshot_path_without_orbax_is_refused_at_start(monkeypatch):
    """Not at the first save at shutdown (after which the next start would be silently cold)."""
    import importlib.util

    extra = {"num_cpu_chunks": 4, "snapshot_path": "/mnt/snap"}
    assert resolve(vllm_config(extra), page(), env={}).config.snapshot_path == "/mnt/snap"  # [tpu] installed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "orbax" else real(name, *a))
    with pytest.raises(ConfigError, match=r"snapshot_path='/mnt/snap' .*needs orbax-checkpoint.*\[tpu\] extra"):
        resolve(vllm_config(extra), page(), env={})
    resolve(vllm_config({"num_cpu_chunks": 4}), page(), env={})


def test_unpinned_host_env():
    s = resolve(vllm_config({"num_cpu_chunks": 4}), page(), env={"TPU_OFFLOAD_USE_UNPINNED_HOST": "1"})
    assert s.config.host_memory_kind == "unpinned_host"
    with pytest.raises(ConfigError, match="TPU_OFFLOAD_HOST_MEMORY_KIND='pinned_host' and "
                                          "TPU_OFFLOAD_USE_UNPINNED_HOST='1' contradict each other"):
        resolve(vllm_config({"num_cpu_chunks": 4}), page(),
                env={"TPU_OFFLOAD_USE_UNPINNED_HOST": "1", "TPU_OFFLOAD_HOST_MEMORY_KIND": "pinned_host"})


@pytest.mark.parametrize("name", ["offload.json", "offload-fs.json"])
def test_shipped_kv_transfer_configs(name, tmp_path):
    from tpu_offload.core.fs.auth import make_secret_file

    cfg = json.loads((REPO / "configs" / "tpu-inference" / name).read_text())
    assert cfg["kv_connector"] == "TPUOffloadConnector"
    assert cfg["kv_connector_module_path"] == "tpu_offload.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    extra = cfg["kv_connector_extra_config"]
    if name == "offload-fs.json":  # a shared tier starts only with its secret: the pod mounts it there
        assert extra["fs_secret_file"] == "/etc/tpu-offload/fs-secret/secret"
        with pytest.raises(ConfigError, match="fs_allow_unauthenticated"):
            resolve(vllm_config({k: v for k, v in extra.items() if k != "fs_secret_file"}), page(), env=LLMD_ENV)
        extra["fs_secret_file"] = str(tmp_path / "secret")
        make_secret_file(extra["fs_secret_file"])
    s = resolve(vllm_config(extra), page(), env=LLMD_ENV)
    assert s.num_slots > 0 and s.staging_blocks >= s.blocks_per_chunk
    if name == "offload-fs.json":
        assert s.config.shared_storage_path


def test_reporting_workers_follow_tpu_inference_executors(monkeypatch):
    """One report per JAX process (host), whatever the TP size (vLLM's world_size)."""
    from tpu_offload.connector.compat import reporting_workers

    def cfg(backend, bundles=None):
        pg = SimpleNamespace(bundle_specs=bundles) if bundles is not None else None
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend,
                                                               placement_group=pg, world_size=16))

    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES", raising=False)
    assert reporting_workers(cfg("uni")) == 1
    assert reporting_workers(cfg(None)) == 1
    hosts = [{"TPU": 8.0, "node:10.0.0.1": 0.001}, {"TPU": 8.0}]
    assert reporting_workers(cfg("ray", hosts)) == 2
    assert reporting_workers(cfg("ray", hosts + [{"CPU": 1.0}])) == 2  # a head node without chips runs no worker

    class RayDistributedExecutorV2:  # tpu-inference passes the executor class itself
        pass

    assert reporting_workers(cfg(RayDistributedExecutorV2, hosts)) == 2
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "0,1,2,3")
    assert reporting_workers(cfg("ray", hosts)) == 4
    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES")
    with pytest.raises(RuntimeError, match="placement group"):
        reporting_workers(cfg("ray"))
    with pytest.raises(RuntimeError, match="mp"):
        reporting_workers(cfg("mp"))


def _tpu_inference_sharding():
    """tpu-inference's real ShardingConfigManager (its package needs the CPU support's torchax shim)."""
    try:
        from tpu_offload.testing import cpu_support

        cpu_support._import_torchax()
        from tpu_inference.layers.common.sharding import ShardingConfigManager
    except Exception as e:  # the .venv environment has no working tpu-inference
        pytest.skip(f"tpu-inference cannot be imported here: {e!r}")
    return ShardingConfigManager


@pytest.mark.parametrize("strategy,dp", [
    ({"enable_dp_attention": True}, 1),  # attention DP: 8 chips, 2 KV heads -> attn_dp 4
    ({}, 2),  # plain DP: tpu-inference resets data_parallel_size to 1 behind our back
])
def test_data_parallelism_as_tpu_inference_configures_it(tiny_model_dir, monkeypatch, strategy, dp):
    """DP inside tpu-inference's mesh runs its DPScheduler: one scheduler per rank, each owning an equal
    share of the one host tier (connector/dp.py); what DP attention cannot do yet is refused at start."""
    from tpu_offload.connector.compat import data_parallel
    from tpu_standin import make_vllm_config

    monkeypatch.setenv("NEW_MODEL_DESIGN", "1" if strategy else "0")  # tpu-inference: attention DP needs it
    manager = _tpu_inference_sharding()
    vc = make_vllm_config(tiny_model_dir, block_size=16, num_blocks=16, extra={"num_cpu_chunks": 7})
    vc.parallel_config.tensor_parallel_size = 8
    vc.parallel_config.data_parallel_size = dp
    vc.additional_config = {"sharding": {"sharding_strategy": strategy}}
    vc.sharding_config = manager.from_vllm_config(vc)  # what TpuPlatform.check_and_update_config does
    assert vc.parallel_config.data_parallel_size == 1  # so a data_parallel_size guard alone never fires
    ranks = vc.sharding_config.total_dp_size
    assert ranks > 1 and data_parallel(vc)[0] == ranks
    s = resolve(vc, page(), env={})
    assert s.dp == ranks and s.failures_by_request and s.num_slots == 7 - 7 % ranks
    for key, value in (("sync_load", True), ("shared_storage_path", "/nonexistent"), ("snapshot_path", "/x"),
                       ("store_policy", "exclusive")):
        # (no secret: this refusal, not the unauthenticated tier's, is under test)
        vc.kv_transfer_config.kv_connector_extra_config = {"num_cpu_chunks": 8, key: value,
                                                           "fs_allow_unauthenticated": True}
        with pytest.raises(ConfigError, match=f"{key}=.*attention-DP ranks"):
            resolve(vc, page(), env={})
    vc.kv_transfer_config.kv_connector_extra_config = {"num_cpu_chunks": 8}
    vc.cache_config.enable_prefix_caching = False  # vLLM's EngineCore would give requests no block hashes
    with pytest.raises(ConfigError, match="enable_prefix_caching=False with .* attention-DP ranks.*DPScheduler"):
        resolve(vc, page(), env={})


def test_data_parallelism_seen_before_tpu_inference_configures_it():
    from tpu_offload.connector.compat import data_parallel

    vc = vllm_config({"num_cpu_chunks": 4})
    vc.additional_config = {"sharding": {"sharding_strategy": {"enable_dp_attention": True, "attn_dp_size": 2}}}
    assert data_parallel(vc)[0] == 2
    vc.additional_config = {"sharding": {"sharding_strategy": {"enable_dp_attention": False}}}
    assert data_parallel(vc)[0] == 1
    vc.scheduler_config = SimpleNamespace(scheduler_cls="tpu_inference.core.sched.dp_scheduler.DPScheduler")
    with pytest.raises(ConfigError, match="outside tpu-inference's sharding.*DPScheduler"):
        resolve(vc, page(), env={})


@pytest.mark.parametrize("attrs,needle", [
    ({"additional_config": {"enable_continue_decode": True}}, "enable_continue_decode=True"),
    ({"speculative_config": SimpleNamespace(method="eagle3")}, "speculative_config.method='eagle3'"),
    ({"speculative_config": SimpleNamespace(method="dflash")}, "draft model"),
])
def test_runner_modes_that_break_ordering_are_refused(attrs, needle):
    vc = vllm_config({"num_cpu_chunks": 4})
    for k, v in attrs.items():
        setattr(vc, k, v)
    with pytest.raises(ConfigError, match=needle):
        resolve(vc, page(), env={})


def test_model_free_speculation_is_allowed():
    vc = vllm_config({"num_cpu_chunks": 4})
    vc.speculative_config = SimpleNamespace(method="ngram")
    vc.additional_config = {"enable_continue_decode": False}
    assert resolve(vc, page(), env={}).num_slots == 4


def _tpu_inference_model_free_methods() -> set[str]:
    """The speculative methods tpu-inference's runner accepts with a host-side vLLM proposer (no draft model),
    read from its source: the ``method == "..."`` branches of ``_init_speculative_decoding`` whose drafter
    class is imported from vLLM (the others are tpu-inference's JAX draft models)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("tpu_inference")  # the source only: importing the runner needs an engine
    tree = ast.parse((Path(spec.origin).parent / "runner" / "tpu_runner.py").read_text())
    from_vllm = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and (n.module or "").startswith("vllm.") for a in n.names}
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_init_speculative_decoding")
    raises = [n for n in ast.walk(init) if isinstance(n, ast.Raise)]
    assert raises, "tpu-inference refuses the methods it does not know"
    found = set()
    for node in ast.walk(init):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Attribute) and node.test.left.attr == "method"):
            continue
        (op,), (lit,) = node.test.ops, node.test.comparators
        assert isinstance(op, ast.Eq) and isinstance(lit, ast.Constant), ast.dump(node.test)
        made = [c.func.id for c in ast.walk(ast.Module(body=node.body, type_ignores=[]))
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id.endswith("Proposer")]
        assert made, f"branch {lit.value!r} builds no proposer"
        if all(name in from_vllm for name in made):
            found.add(lit.value)
    return found


def test_model_free_spec_methods_are_exactly_those_tpu_inference_runs_without_a_draft_model():
    from tpu_offload.connector.compat import MODEL_FREE_SPEC_METHODS

    accepted = _tpu_inference_model_free_methods()
    assert accepted, "the runner's speculative-decoding branches were found"
    assert set(MODEL_FREE_SPEC_METHODS) == accepted
    assert len(MODEL_FREE_SPEC_METHODS) == len(accepted)


@pytest.mark.parametrize("method", ["ngram_gpu", "suffix"])
def test_model_free_methods_tpu_inference_cannot_run_are_refused(method):
    vc = vllm_config({"num_cpu_chunks": 4})
    vc.speculative_config = SimpleNamespace(method=method)
    with pytest.raises(ConfigError, match=f"speculative_config.method='{method}'"):
        resolve(vc, page(), env={})


def test_replicated_heads_size_the_tier_by_the_real_kv():
    """Llama-3-8B (8 KV heads) at TP 16: tpu-inference's spec counts 16 padded heads; a chunk
    costs the real 8 heads' bytes, so cpu_bytes buys twice the chunks."""
    spec = SimpleNamespace(page_size_bytes=2 * 128 * 16 * 128 * 2, num_kv_heads=16)
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(32)])])
    vc = vllm_config({"cpu_bytes": "64GiB"})
    vc.model_config = SimpleNamespace(get_total_num_kv_heads=lambda: 8, use_mla=False)
    s = resolve(vc, kcc, env={})
    assert s.kv_replicas == 2
    assert s.chunk_bytes == 32 * 2 * 128 * 8 * 128 * 2  # 16 MiB: K and V of 8 heads, 128 tokens, 32 layers
    assert s.num_slots == 64 * 1024 // 16
    vc.model_config = SimpleNamespace(get_total_num_kv_heads=lambda: 16, use_mla=False)
    assert resolve(vc, kcc, env={}).kv_replicas == 1


def test_transfer_path_auto_is_program_everywhere_and_bad_values_are_named():
    from tpu_offload.core.config import OffloadConfig

    from tpu_offload.connector.worker import transfer_path

    tpu, cpu = [SimpleNamespace(platform="tpu")], [SimpleNamespace(platform="cpu")]
    assert transfer_path(OffloadConfig(), tpu) == "program"  # its programs scale with the pass (tests/tpu_compiler)
    assert transfer_path(OffloadConfig(), cpu) == "program"
    assert transfer_path(OffloadConfig(transfer_path="device_put"), tpu) == "device_put"  # opt-in
    assert transfer_path(OffloadConfig(transfer_path="program"), tpu) == "program"
    # under DP attention a chunk lives on one rank's devices: only the program path holds it there
    assert transfer_path(OffloadConfig(), tpu, ranks=2) == "program"
    with pytest.raises(ConfigError, match="transfer_path='device_put' with 2 attention-DP ranks.*'program' or 'auto'"):
        transfer_path(OffloadConfig(transfer_path="device_put"), tpu, ranks=2)
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_TRANSFER_PATH": "device_put"}).transfer_path == "device_put"
    with pytest.raises(ConfigError, match="'transfer_path': value 'dma' is not allowed; allowed: one of 'auto', 'program', 'device_put'"):
        OffloadConfig.from_sources({"transfer_path": "dma"}, env={})


def test_step_budget_is_the_chips_link_times_stall_shared_by_its_devices():
    """Defaults (38 GB/s per chip x 20 ms, 2 devices per chip: 380 MB per device and direction) at the
    deployment shape: Qwen3-32B blocks of 32 MiB over 8 devices. The old names still set the same figure."""
    vc = vllm_config({"num_cpu_chunks": 100, "staging_blocks": 1000})
    s = resolve(vc, page(), env={})
    assert s.config.step_budget_bytes == s.step_budget_bytes == 380_000_000
    assert s.device_block_bytes == 32 << 20 and s.step_budget_blocks == 11  # TP 1: one device holds all
    vc.parallel_config.tensor_parallel_size = 8
    s = resolve(vc, page(), env={})
    assert s.device_block_bytes == 4 << 20 and s.step_budget_blocks == 380_000_000 // (4 << 20) == 90
    env = {"TPU_OFFLOAD_LOAD_BANDWIDTH_GBPS": "10", "TPU_OFFLOAD_LOAD_STALL_MS": "5"}
    s = resolve(vllm_config({"num_cpu_chunks": 100, "staging_blocks": 1000, "blocks_per_chunk": 4}), page(), env=env)
    assert s.step_budget_bytes == 25_000_000 and s.step_budget_blocks == 4  # at least one chunk
    s = resolve(vllm_config({"num_cpu_chunks": 100, "staging_blocks": 1000, "transfer_bandwidth_gbps": 10,
                             "transfer_stall_ms": 5, "devices_per_chip": 1}), page(), env={})
    assert s.step_budget_bytes == 50_000_000
    s = resolve(vllm_config({"num_cpu_chunks": 100, "staging_blocks": 8, "load_stall_ms": 1000}), page(), env={})
    assert s.step_budget_blocks == 8  # never more than staging
    with pytest.raises(ConfigError, match="both set transfer_stall_ms"):
        resolve(vllm_config({"num_cpu_chunks": 4, "load_stall_ms": 5, "transfer_stall_ms": 6}), page(), env={})


@pytest.mark.parametrize("key,env,value", [
    ("load_bandwidth_gbps", "TPU_OFFLOAD_LOAD_BANDWIDTH_GBPS", "0"),
    ("load_stall_ms", "TPU_OFFLOAD_LOAD_STALL_MS", "-1"),
    ("load_stall_ms", "TPU_OFFLOAD_LOAD_STALL_MS", "fast"),
    ("devices_per_chip", "TPU_OFFLOAD_DEVICES_PER_CHIP", "0"),
])
def test_bad_load_budget_settings_name_key_value_and_allowed(key, env, value):
    allowed = "an integer >= 1 and <= 64" if key == "devices_per_chip" else "a number >= 0.001"
    for extra, environ, where in (({key: value}, {}, key), ({}, {env: value}, env)):
        with pytest.raises(ConfigError) as e:
            resolve(vllm_config({"num_cpu_chunks": 4, **extra}), page(), env=environ)
        msg = str(e.value)
        assert where in msg and value in msg and allowed in msg, msg
