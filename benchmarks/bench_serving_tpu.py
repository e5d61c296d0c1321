"""The llm-d guides' benchmark on tpu-inference: inference-perf against its real OpenAI server.

    python benchmarks/bench_serving_tpu.py [--configs none theirs ours] [--repeats 2] ...
    python benchmarks/bench_serving_tpu.py --soak 2000
    python benchmarks/bench_serving_tpu.py --workload agentic --configs none theirs ours ours-lease

The same harness, workload, checks and report as ``bench_serving_vllm.py`` (see there),
against the real tpu-inference 0.32 engine on JAX's CPU backend: vLLM's OpenAI server in
``.venv-tpu`` (Python 3.12), started through ``python -m tpu_offload.testing.serve``, which
applies the CPU support (``tpu_offload/testing/cpu_support.py``) in the server process.
Configurations: no connector; tpu-inference's own ``TPUOffloadConnector`` (sized with its
``TPU_OFFLOAD_*`` environment); ours (``configs/tpu-inference/offload.json``, sizes
overridden for the tiny model). The host tier gets the same bytes in both connectors.
The model has head_dim 128 (tpu-inference's RPA v3 cache layout). On CPU every "memory
kind" is the same RAM: these figures show the engines' overheads, not a TPU's transfers.
Results: ``results/serving_tpu.{json,png}``.

``--workload agentic``: inference-perf's agentic sessions over the chat API, as in
``bench_serving_vllm.py`` (the same tool-call parser and ``serving/lease_middleware.py`` in
every configuration); ``ours-lease`` is ``ours`` with every request carrying its agent
session's lease hint (``ttl_s`` 120). ``ours-sync`` is ``ours`` with ``sync_load`` on: a hit is
loaded within the step that needs it (as tpu-inference's connector loads), not overlapped with
compute while its request waits for the load (our default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from benchmarks.serving import lease_middleware, matrix  # noqa: E402
from benchmarks.serving.model import tiny_llama_class  # noqa: E402
from benchmarks.serving.server import Server, free_port  # noqa: E402

BLOCK = 128
TPU_PY = ROOT / ".venv-tpu" / "bin" / "python"
SERVE = "tpu_offload.testing.serve"  # run with -m from the code under test (PYTHONPATH)
# ours-fs: opt in (--configs), with --host-fraction < 1; ours-lease: ours, every request with its
# agent session's lease hint (--workload agentic; serving/lease_middleware.py adds it); ours-sync:
# ours with sync_load (hits loaded within the step that needs them, as tpu-inference's connector does)
CONFIGS = ("none", "theirs", "ours", "ours-fs", "ours-lease", "ours-sync")


def tpu_model():
    """head_dim 128 (the RPA v3 layout tpu-inference uses on TPU); otherwise the vLLM
    benchmark's model."""
    return tiny_llama_class()(hidden_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=128,
                              intermediate_size=1408, vocab_size=2048, max_position=8192)


def start(name: str, model: str, blocks: int, host_bytes: int, w, work: Path, args):
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    serve = Path(code, *SERVE.split(".")).with_suffix(".py")  # in the code under test
    for path, what in ((TPU_PY, "the .venv-tpu environment (make .venv-tpu)"), (serve, "the serve wrapper")):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: {what} is needed to run tpu-inference's OpenAI server on CPU")
    port = free_port()
    endpoint = f"ipc://{work / 'kv-events.sock'}"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": code,
        "JAX_PLATFORMS": "cpu", "SKIP_JAX_PRECOMPILE": "1",
        "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
    }
    if os.environ.get("TPU_ENGINE_VLLM_KERNELS"):  # a forced kernel build (tpu_offload/testing/vllm_kernels.py)
        env["TPU_ENGINE_VLLM_KERNELS"] = os.environ["TPU_ENGINE_VLLM_KERNELS"]
    # The engine core is its own process: our connector's Prometheus series reach the API
    # server's /metrics only through prometheus_client's multiprocess mode.
    if args.multiproc_metrics:
        prom_dir = work / "prometheus"
        prom_dir.mkdir(parents=True, exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    kvpt = tpu_model().kv_bytes_per_token(4 if args.dtype == "float32" else 2)
    chunk_tokens = 0
    ktc = None
    if name == "theirs":  # configured by environment; one chunk = one block
        ktc = {"kv_connector": "TPUOffloadConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "tpu_inference.offload.tpu_offload_connector"}
        env.update(TPU_OFFLOAD_NUM_CPU_CHUNKS=str(host_bytes // (BLOCK * kvpt)), TPU_OFFLOAD_NUM_STAGING_BLOCKS="128",
                   TPU_OFFLOAD_SKIP_JAX_PRECOMPILE="1")
    elif name in ("ours", "ours-fs", "ours-lease", "ours-sync"):
        fs = name == "ours-fs"
        ktc = json.loads((ROOT / f"configs/tpu-inference/offload{'-fs' if fs else ''}.json").read_text())
        ktc["kv_connector_extra_config"].update(cpu_bytes=host_bytes, staging_blocks=128)
        if name == "ours-sync":
            ktc["kv_connector_extra_config"]["sync_load"] = True
        if fs:  # the shipped sizes are for real hosts
            from tpu_offload.core.fs.auth import make_secret_file

            secret = work / "kv-files-secret"  # in place of the pod's mounted Secret
            if not secret.exists():
                make_secret_file(str(secret))
            ktc["kv_connector_extra_config"].update(shared_storage_path=str(work / "kv-files"),
                                                    fs_capacity_bytes=4 * host_bytes, fs_secret_file=str(secret))
        chunk_tokens = int(ktc["kv_connector_extra_config"].get("blocks_per_chunk", 1)) * BLOCK
    cmd = [
        str(TPU_PY), "-m", SERVE, "--model", model, "--dtype", args.dtype, "--seed", "0",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(blocks),
        "--max-model-len", str(w.max_model_len),
        "--max-num-seqs", str(max(w.concurrency, 4)), "--max-num-batched-tokens", str(args.max_batched_tokens),
        "--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(ev),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    if w.kind == "agentic":
        cmd += lease_middleware.server_args()
    env.update(lease_middleware.server_env(name == "ours-lease"))
    return Server(cmd, env, work / "server.log", port, startup_s=900), endpoint, chunk_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix.add_args(ap, CONFIGS, "serving_tpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-multiproc-metrics", dest="multiproc_metrics", action="store_false",
                    help="leave PROMETHEUS_MULTIPROC_DIR unset (our tier's series then stay in the engine process)")
    # The engine on JAX CPU serves ~0.2-0.5 requests/s here: the guides' shape, scaled so a
    # configuration still finishes in a few minutes on 2 cores.
    ap.set_defaults(groups=8, system_prompt_len=512, question_len=32, output_len=8, prompts_per_group=3,
                    concurrency=2, repeats=1, probes=2, configs=["none", "theirs", "ours"])
    args = ap.parse_args(argv)
    if "ours-lease" in args.configs and args.workload != "agentic":
        ap.error(f"--configs ours-lease: the lease hint comes from inference-perf's agent session header, which only "
                 f"--workload agentic sends (got --workload {args.workload})")
    eng = matrix.Engine("tpu-inference", BLOCK, tpu_model(), args.dtype, CONFIGS, start,
                        "tpu-inference 0.32 OpenAI server on JAX CPU", soak_config="ours")
    return matrix.run(eng, args)


if __name__ == "__main__":
    raise SystemExit(main())
