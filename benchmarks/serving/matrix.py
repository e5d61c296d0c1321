"""The run matrix shared by both engines: arguments, sizes, the rotated loop, checks, report.

An engine script supplies an ``Engine``: its block size, its model, which configurations
it has and how to start a server for one; everything else is here so both engines are
measured and judged the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.serving import harness, perf, plot
from benchmarks.serving.model import build
from benchmarks.serving.router_values import capacity_chunks, render


@dataclasses.dataclass
class Engine:
    name: str  # "vllm" | "tpu-inference"
    block: int  # engine block size, tokens
    model: object  # a TinyLlama (kv_bytes_per_token, vocab_size, write)
    dtype: str
    configs: tuple[str, ...]  # "none" first
    # (config, model dir, device blocks, host bytes, workload, workdir, args)
    #   -> (Server, events endpoint or None, chunk tokens of OUR tier: 0 for none / another connector)
    start: Callable
    title: str
    soak_config: str = ""  # ours, for --soak (default: the first after "none")


def add_args(ap: argparse.ArgumentParser, configs: tuple[str, ...], out: str) -> None:
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prompts-per-group", type=int, default=6)
    ap.add_argument("--requests", type=int, default=None, help="default: groups x prompts per group")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--high-ratio", type=float, default=3.0, help="High Cache: working set / device cache")
    ap.add_argument("--scenarios", nargs="+", default=["high", "low"], choices=["high", "low"])
    ap.add_argument("--configs", nargs="+", default=list(configs), choices=list(configs))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--soak", type=int, default=0, help="N requests on our tier only (High Cache)")
    ap.add_argument("--host-fraction", type=float, default=None,
                    help="host tier = this x working set (default: it holds the working set; --soak: 0.5, "
                         "so the tier evicts all the time)")
    ap.add_argument("--workload", default="shared_prefix", choices=["shared_prefix", "conversations", "agentic"],
                    help="conversations: inference-perf's conversation_replay (multi-turn sessions, growing contexts); "
                         "agentic: its synthetic_agentic generator (themed agent sessions, tool loops, tool gaps)")
    ap.add_argument("--sessions", type=int, default=8, help="agentic: agent sessions (--concurrency at a time)")
    ap.add_argument("--tool-loop-depth", type=int, default=1, help="agentic: tool calls per turn")
    ap.add_argument("--tool-gap-s", type=float, default=2.0, help="agentic: seconds a tool runs (the session waits)")
    ap.add_argument("--think-s", type=float, default=4.0, help="agentic: seconds before each next user turn")
    ap.add_argument("--tools-per-agent", type=int, default=1, help="agentic: tools in each agent's catalog")
    ap.add_argument("--background-rate", type=float, default=0.0,
                    help="other traffic beside the workload (a second inference-perf run): unique prompts per "
                         "second, never leased (0: none); results go to <out>_pressure")
    ap.add_argument("--background-duration", type=float, default=160.0, help="seconds the other traffic runs")
    ap.add_argument("--background-len", type=int, default=1024, help="tokens of each other-traffic prompt")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shared-system-len", type=int, default=512)
    ap.add_argument("--dynamic-system-len", type=int, default=256)
    ap.add_argument("--turn-input-len", type=int, default=96)
    ap.add_argument("--turn-output-len", type=int, default=32)
    ap.add_argument("--code", default=None, help="import gpu_offload/tpu_offload from this directory")
    ap.add_argument("--label", default="", help="stored with the results (machine, conditions)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--report", metavar="JSON", help="only print/redraw a stored result")


def sizes(w, ratio: float, block: int) -> dict:
    """Device blocks per scenario and host-tier blocks, from the workload's working set."""
    request_blocks = w.request_blocks(block)
    ws_blocks = w.working_set_blocks(block)
    running = getattr(w, "running_requests", w.concurrency) * request_blocks
    high = max(int(ws_blocks / ratio), running + request_blocks)
    return {
        "working_set_blocks": ws_blocks, "running_blocks": running,
        "high": high,  # working set = ratio x device cache
        "low": ws_blocks + running + 2 * request_blocks,  # all of it fits
        # working set < device + host; the probes and their filler (~1.5 x High device) fit after the run
        "host_blocks": int(ws_blocks * 1.5) + 2 * high,
    }


def run(eng: Engine, args) -> int:
    from _common import write_json

    if args.report:
        return rereport(args.report, eng.title)
    if args.soak:
        args.configs = [eng.soak_config or [c for c in eng.configs if c != "none"][0]]
        # No probes: a tier at half the working set cannot keep them while the filler runs.
        args.scenarios, args.repeats, args.probes = ["high"], 1, 0
        args.out = f"{args.out}_soak"
    w = workload(args)
    if w.kind != "shared_prefix" and not args.out.endswith(f"_{w.kind}"):  # named once, whoever names it
        args.out = f"{args.out}_{w.kind}"
    bg = background(args)
    if bg is not None:
        args.out = f"{args.out}_pressure"
        print(bg.describe(), flush=True)
    m, block = eng.model, eng.block
    sz = sizes(w, args.high_ratio, block)
    fraction = args.host_fraction if args.host_fraction is not None else (0.5 if args.soak else None)
    if fraction is not None:
        sz["host_blocks"] = max(int(sz["working_set_blocks"] * fraction), 1)
    kvpt = m.kv_bytes_per_token(4 if eng.dtype == "float32" else 2)
    host_bytes = sz["host_blocks"] * block * kvpt
    print(f"workload: {w}\nsizes (blocks of {block} tokens): {sz}; host tier {host_bytes / 2**20:.0f} MiB", flush=True)

    records: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_serving_{eng.name}_"))
    try:
        model = build(str(tmp / "model"), m, eng.dtype, tokenizer="text" if w.kind == "agentic" else "wordlevel")
        probe_len = w.probe_len
        probe_set = harness.probe_prompts(args.probes, probe_len, m.vocab_size)
        t0 = time.time()
        for rep in range(args.repeats):
            for scenario in args.scenarios:
                order = args.configs[rep % len(args.configs):] + args.configs[: rep % len(args.configs)]
                for name in order:
                    blocks = sz[scenario]
                    work = tmp / f"{scenario}-{name}-{rep}"
                    srv, endpoint, chunk_tokens = eng.start(name, model, blocks, host_bytes, w, work, args)
                    filler = harness.probe_prompts(filler_count(blocks, block, probe_len), probe_len, m.vocab_size,
                                                   seed=99 + rep)
                    print(f"[{time.time() - t0:5.0f} s] {scenario} cache, {name}, repeat {rep + 1}/{args.repeats}: "
                          f"starting server ({blocks} device blocks)", flush=True)
                    with srv:
                        cell = harness.Cell(eng.name, name, scenario, rep, srv, endpoint, model, block,
                                            max(chunk_tokens // block, 1), chunk_tokens > 0)
                        rec = harness.run_cell(cell, w, work, sample=bool(args.soak), background=bg,
                                               probe=(probe_set, filler) if scenario == "high" and args.probes else None)
                    rec["device_blocks"] = blocks
                    if name != "none" and chunk_tokens:  # the figure the router's lruCapacityPerServer needs
                        rec["router"] = {"chunk_tokens": chunk_tokens,
                                         "capacity_chunks_gauge": rec["tier"]["capacity_chunks"],
                                         "capacity_chunks_expected": capacity_chunks(host_bytes, chunk_tokens, kvpt)}
                    records.append(rec)
                    f = rec["figures"]
                    print(f"    TTFT mean {f['ttft_mean'] * 1e3:.0f} ms, total {f['total_tps']:.0f} tok/s, "
                          f"failed {f['requests_failed']}, {hits_line(rec)}", flush=True)
                    if bg is not None:
                        t = rec["tier"]
                        print(f"    cached tokens: workload {f['cached_prompt_tokens']:.0f}, other traffic "
                              f"{rec['background']['cached_prompt_tokens'] or 0:.0f} "
                              f"({rec['background']['requests_ok']} requests); tier evicted {t['evicted_chunks']}, "
                              f"lease kept {t['lease_honoured_chunks']} chunk(s), leases expired {t['leases_expired']}", flush=True)
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    verdict, rows = report(records, eng.title, w, bg, block)
    path = write_json(args.out, {"label": args.label, "engine": eng.name, "workload": dataclasses.asdict(w),
                                 "background": dataclasses.asdict(bg) if bg else None,
                                 "sizes": sz, "block_tokens": block, "host_bytes": host_bytes, "model": repr(m),
                                 "dtype": eng.dtype, "table": rows, "verdict": verdict, "records": records,
                                 "args": vars(args)})
    plot.draw(rows, records, args.out, f"{eng.title}: inference-perf {w.kind}")
    fig = next((r["router"] for r in records if r.get("router") and r["router"]["capacity_chunks_gauge"]), None)
    if fig:  # router values for this benchmark's own server, from its gauge
        (path.parent / f"{args.out}_router.values.yaml").write_text(
            render(int(fig["capacity_chunks_gauge"]), fig["chunk_tokens"], "cpu"))
    print(f"wrote {path}")
    return 0 if verdict["ok"] else 1


def background(args) -> perf.Background | None:
    if args.background_rate < 0 or args.background_duration <= 0 or args.background_len < 1:
        raise SystemExit(f"--background-rate {args.background_rate}, --background-duration "
                         f"{args.background_duration}, --background-len {args.background_len}: the rate must be >= 0 "
                         "(0: no other traffic), the duration > 0 s and the length >= 1 token")
    if not args.background_rate:
        return None
    if args.soak:
        raise SystemExit("--background-rate with --soak: the soak measures our tier alone; drop one of them")
    return perf.Background(rate=args.background_rate, duration_s=args.background_duration,
                           prompt_len=args.background_len)


def workload(args):
    if args.workload == "agentic":  # --turns, --system-prompt-len, --turn-input-len, --turn-output-len shape it
        return perf.Agentic(sessions=args.sessions, turns=args.turns, tool_loop_depth=args.tool_loop_depth,
                            system_len=args.system_prompt_len, turn_input_len=args.turn_input_len,
                            output_len=args.turn_output_len, tools_per_agent=args.tools_per_agent,
                            tool_gap_s=args.tool_gap_s, think_s=args.think_s, concurrency=args.concurrency)
    if args.workload == "conversations":
        return perf.Conversations(conversations=args.conversations, shared_system_len=args.shared_system_len,
                                  dynamic_system_len=args.dynamic_system_len, turns=args.turns,
                                  turn_input_len=args.turn_input_len, output_len=args.turn_output_len,
                                  rounds=args.rounds, concurrency=args.concurrency)
    requests = args.soak or args.requests or args.groups * args.prompts_per_group
    return perf.Workload(groups=args.groups, system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                         output_len=args.output_len, prompts_per_group=args.prompts_per_group, requests=requests,
                         concurrency=args.concurrency)


def stored_workload(d: dict):
    if "sessions" in d:
        return perf.Agentic(**{**d, "themes": tuple(d["themes"])})
    return perf.Conversations(**d) if "conversations" in d else perf.Workload(**d)


def filler_count(device_blocks: int, block: int, probe_len: int) -> int:
    """Prompts sent between a probe's two visits: enough to push it out of the device cache."""
    return int(1.5 * device_blocks * block / probe_len) + 1


def report(records: list[dict], title: str, w, bg=None, block: int | None = None) -> tuple[dict, list[dict]]:
    from _common import print_table

    verdict = check(records, w.probe_len, block)
    rows = harness.compare(records)
    print_table(rows, title=f"{title}: {w.describe()}" + (f"; {bg.describe()}" if bg else ""))
    for line in verdict["lines"]:
        print(line)
    return verdict, rows


def rereport(path: str, title: str) -> int:
    """Print the table and checks of a stored result again and redraw its plot."""
    import json

    data = json.loads(Path(path).read_text())
    w = stored_workload(data["workload"])
    bg = perf.Background(**data["background"]) if data.get("background") else None
    verdict, rows = report(data["records"], title, w, bg, data.get("block_tokens"))
    plot.draw(rows, data["records"], Path(path).stem, f"{title}: inference-perf {w.kind}")
    return 0 if verdict["ok"] else 1


def hits_line(rec: dict) -> str:
    h = rec["hits"]
    return (f"hits: device {h['device_hit_tokens']:.0f} + tier cpu {h['tier_hit_tokens_cpu']:.0f} / fs "
            f"{h['tier_hit_tokens_fs']:.0f} + other external {h['external_hit_tokens'] - h['tier_hit_tokens_cpu'] - h['tier_hit_tokens_fs']:.0f}"
            f" of {h['reusable_tokens']} reusable tokens")


def loads_nothing(config: str) -> bool:
    """A configuration named ``*-never`` runs our tier with ``load_decision: never``: it stores every
    chunk and loads none, so it is expected to serve no hits (the benchmarks' one naming rule for it)."""
    return config.endswith("-never")


def tier_holds_probes(r: dict, probe_len: int | None, block: int | None) -> bool:
    """Whether the run's tier could keep its probes while their filler ran (False where its
    capacity is known and smaller than probes and filler: a revisit must then miss it)."""
    cap, rt, p = (r.get("tier") or {}).get("capacity_chunks"), r.get("router") or {}, r.get("probes") or {}
    if not (cap and rt.get("chunk_tokens") and probe_len and block and p.get("tokens_first") and r.get("device_blocks")):
        return True
    prompts = len(p["tokens_first"]) + filler_count(r["device_blocks"], block, probe_len)
    return cap * rt["chunk_tokens"] >= prompts * probe_len


def check(records: list[dict], probe_len: int | None = None, block: int | None = None) -> dict:
    """Correctness and accounting checks; ``ok`` is False if any fails. GAP lines name what
    the connector does not export (reported, not failed)."""
    lines, ok = [], True

    def fail(msg: str) -> None:
        nonlocal ok
        ok = False
        lines.append("FAIL " + msg)

    base = {(r["scenario"], r["repeat"]): r for r in records if r["config"] == "none"}
    for r in records:
        tag = f"{r['engine']}/{r['scenario']}/{r['config']}/r{r['repeat']}"
        f, h = r["figures"], r["hits"]
        if f["requests_failed"]:
            fail(f"{tag}: {f['requests_failed']} failed requests")
        bgr = r.get("background") or {}
        if bgr.get("requests_failed"):
            fail(f"{tag}: {bgr['requests_failed']} failed requests in the other traffic")
        if bgr and bgr["wall_seconds"] < bgr["agents_wall_seconds"]:
            lines.append(f"NOTE {tag}: the other traffic ended {bgr['agents_wall_seconds'] - bgr['wall_seconds']:.0f} s "
                         "before the workload did: its last part ran without it (--background-duration)")
        if h["perf_prompt_tokens"] != h["server_prompt_tokens"]:
            fail(f"{tag}: inference-perf counted {h['perf_prompt_tokens']} prompt tokens, the server "
                 f"{h['server_prompt_tokens']}")
        if h["server_vs_perf_cached_diff"]:
            lines.append(f"NOTE {tag}: server hits (device + external) differ from inference-perf's cached tokens "
                         f"by {h['server_vs_perf_cached_diff']:.0f}")
        preempted = (r.get("scheduling") or {}).get("preemptions") or 0
        if r["config"] != "none" and h["ours_vs_external_diff"] and h["ours_vs_external_diff"] > 0 and preempted:
            # vLLM counts a request's hits at its first scheduling only: a preempted request's hits when it
            # is scheduled again go to PrefixCacheStats.preempted_hits, which it does not export
            lines.append(f"NOTE {tag}: our tier counted {h['ours_vs_external_diff']:.0f} hit tokens more than vLLM's "
                         f"external-hit counter, which leaves out the hits of the {preempted:.0f} preempted and "
                         "rescheduled request(s)")
        elif r["config"] != "none" and h["ours_vs_external_diff"]:
            fail(f"{tag}: our tier counted {h['tier_hit_tokens_cpu'] + h['tier_hit_tokens_fs']:.0f} hit tokens, "
                 f"vLLM {h['external_hit_tokens']:.0f}")
        lg = r.get("log") or {}
        if lg.get("errors"):
            fail(f"{tag}: the server logged {lg['errors']} error line(s), first: {lg['first_error']}")
        if lg.get("recompute_warnings"):
            lines.append(f"NOTE {tag}: {lg['recompute_warnings']} recompute warning(s) in the server log")
        p = r.get("probes")
        if p:
            if not p["stable"]:
                fail(f"{tag}: probe tokens changed between the first visit and the revisit")
            b = base.get((r["scenario"], r["repeat"])) or next(iter(base.values()), None)
            if b and b.get("probes") and r is not b and p["tokens_revisit"] != b["probes"]["tokens_revisit"]:
                fail(f"{tag}: probe tokens differ from the no-connector run")
            if r["config"] != "none" and not loads_nothing(r["config"]) and p.get("revisit_external_hit_tokens", p["revisit_tier_hit_tokens"]) <= 0:
                if tier_holds_probes(r, probe_len, block):
                    fail(f"{tag}: probe revisits were not served by the connector")
                else:
                    lines.append(f"NOTE {tag}: probe revisits missed the tier, which is smaller than the probes and "
                                 "their filler (--host-fraction); their tokens are still compared")
        ev = (r.get("events") or {}).get("checks")
        if ev:
            for k in ("every_store_announced", "every_eviction_announced", "resident_match"):
                if not ev[k]:
                    fail(f"{tag}: KV events: {k} is false ({ev})")
            if "fs" in r["config"] and ev["storage_medium_events"] == 0:
                fail(f"{tag}: no KV event carries the file tier's medium (STORAGE)")
            for k in ("storage_resident_match", "storage_payloads_complete"):
                if k in ev and not ev[k]:
                    fail(f"{tag}: KV events: {k} is false ({ev})")
        elif (r.get("events") or {}).get("missing_gauges"):
            lines.append(f"GAP  {tag}: our tier's gauges are not on the server's /metrics: the KV events "
                         f"({(r['events']['by_medium'].get('CPU') or {}).get('stored_events', 0)} CPU stores) "
                         "cannot be checked against the tier, nor the router figure read")
        if r["config"] not in ("none", "theirs") and h["ours_vs_external_diff"] is None and h["external_hit_tokens"]:
            lines.append(f"GAP  {tag}: {h['external_hit_tokens']:.0f} connector hit tokens (vLLM's count) "
                         "have no per-tier counterpart on /metrics")
        rt = r.get("router")
        if rt and rt["capacity_chunks_gauge"] is not None and rt["capacity_chunks_gauge"] != rt["capacity_chunks_expected"]:
            fail(f"{tag}: capacity gauge {rt['capacity_chunks_gauge']} chunks, the sizing says "
                 f"{rt['capacity_chunks_expected']}: the router figure would be wrong")
        t = r.get("tier") or {}
        if t.get("used_bytes") is not None and t["used_bytes"] > t["capacity_bytes"]:
            fail(f"{tag}: host tier holds {t['used_bytes']} B > capacity {t['capacity_bytes']} B")
        if t.get("pinned_or_pending_fraction"):
            fail(f"{tag}: pins/pending stores left at the end: {t['pinned_or_pending_fraction']}")
        if t.get("pinned_chunks") or t.get("pending_chunks"):
            fail(f"{tag}: {t['pinned_chunks']} pinned and {t['pending_chunks']} pending chunk(s) left at the end")
        for s in r.get("samples", []):
            if s["used_bytes"] is not None and s["capacity_bytes"] and s["used_bytes"] > s["capacity_bytes"]:
                fail(f"{tag}: host tier above budget at t={s['t']:.0f}s")
                break
        if r.get("samples"):
            lines.append(soak_line(tag, r["samples"]))
    lines.append("all checks passed" if ok else "SOME CHECKS FAILED")
    return {"ok": ok, "lines": lines}


def soak_line(tag: str, samples: list[dict]) -> str:
    rss = [s["rss"] for s in samples]
    warm = rss[len(rss) // 4:] or rss
    used = [s["used_bytes"] for s in samples if s["used_bytes"] is not None]
    cap = next((s["capacity_bytes"] for s in samples if s["capacity_bytes"]), None)
    return (f"SOAK {tag}: {len(samples)} samples; RSS after warm-up {warm[0] / 2**20:.0f} -> {warm[-1] / 2**20:.0f} MiB "
            f"({(warm[-1] - warm[0]) / 2**20:+.0f} MiB), max {max(rss) / 2**20:.0f} MiB; host tier max "
            f"{max(used, default=0) / 2**20:.1f} of {(cap or 0) / 2**20:.1f} MiB")
