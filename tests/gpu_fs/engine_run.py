"""One real vLLM engine in a fresh process, driven by a JSON plan; prints JSON.

    python engine_run.py PLAN.json

The plan: ``{"model": dir, "kv_transfer_config": {...} | null, "fault": {"op": "read",
"hang_s": s} (optional: every such file-tier syscall of this process hangs that long), "steps":
[{"prompts": [[ids...], ...], "reset": "none" | "prefix" | "connector",
"idle_s": 0, "cache_salt": null, "kv_transfer_params": null}, ...]}``. Each step optionally resets (vLLM's prefix cache, or
it and our host tier), runs its prompts greedily in one batch, lets the
deferred stores run, stays idle for ``idle_s`` (no engine step: only the
write-back drainer can write), waits for queued file writes and records the
outputs, how many chunks came from host RAM and from files, and which chunk
files appeared. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the counters are read directly.
The last line of stdout is the result; the process then exits normally, so
vLLM's own shutdown closes the file tier (write-back chunks still in host
RAM are written then: ``dirty_at_exit`` says how many).

Every engine of the file-tier tests runs in its own process: that is what
proves cross-process sharing, and only one offloading engine may be alive in
a process at a time (a second one fails at start; see gpu_offload.vllm.hooks).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same cores with and without offloading
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _fit(cost) -> dict:
    """What the load decision believes of a tier (its learned latency and bandwidth)."""
    return {"latency_s": cost.latency_s, "bytes_per_s": cost.bytes_per_s, "samples": cost.samples}


def main(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    from vllm import LLM, SamplingParams

    from gpu_offload import testing

    ktc = plan.get("kv_transfer_config")
    fault = plan.get("fault")
    if fault:  # a hung mount, injected at the syscall wrapper of the file tier
        from tpu_offload.core.fs import fileio

        fileio.fault = lambda op: time.sleep(fault["hang_s"]) if op == fault["op"] else None
    llm = LLM(model=plan["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              enforce_eager=True, max_num_seqs=4, kv_transfer_config=ktc)
    if ktc is None:
        worker = manager = fs = None
    else:
        worker, manager = testing.the_worker(), testing.the_manager()
        fs = worker.fs
    sp = SamplingParams(max_tokens=plan.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    steps = []
    files = chunk_files(fs.tier.ns_dir) if fs is not None else set()  # what earlier processes wrote
    for step in plan["steps"]:
        if step.get("reset", "none") != "none":
            llm.reset_prefix_cache(reset_connector=step["reset"] == "connector")
        before = (manager.hit_chunks, manager.fs_hit_chunks, worker.stats.load_error_blocks) if manager else None
        salt = {"cache_salt": step["cache_salt"]} if step.get("cache_salt") else {}
        ssp = sp
        if step.get("kv_transfer_params"):  # e.g. a session lease hint
            ssp = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True,
                                 extra_args={"kv_transfer_params": step["kv_transfer_params"]})
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p, **salt} for p in step["prompts"]], ssp, use_tqdm=False)
        rec = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "step_s": time.monotonic() - t0}
        if manager is not None:
            llm.generate([{"prompt_token_ids": [1] * 8}], sp, use_tqdm=False)  # runs the deferred stores
            rec.update(host_hits=manager.hit_chunks - before[0], fs_hits=manager.fs_hit_chunks - before[1],
                       load_error_blocks=worker.stats.load_error_blocks - before[2],
                       decisions={"/".join(k): n for k, n in getattr(manager, "decision_tokens", {}).items()},
                       prefill_echoed=manager.costs.prefill.echoed, prefill_samples=manager.costs.prefill.samples,
                       prefill_s_per_token=manager.costs.prefill.s_per_token,
                       file_fit=_fit(manager.costs.tiers["fs"]), probes=getattr(manager.probe, "probes", None))
        if step.get("idle_s"):
            time.sleep(step["idle_s"])
        if fs is not None:
            rec["flushed"] = fs.flush(60)
            if fs.tier.leases is not None:
                rec["fs_leases"] = {"sessions": fs.tier.leases.sessions(), "chunks": len(fs.tier.leases),
                                    "honoured": fs.tier.leases.honoured}
            now = chunk_files(fs.tier.ns_dir)
            rec["new_files"], files = sorted(now - files), now
        steps.append(rec)
    result = {"steps": steps}
    if fs is not None:
        auth = worker.fs_metrics.registry.get_sample_value("tpu_offload_fs_auth_failures_total",
                                                           {"tier": fs.tier.name}) if worker.fs_metrics else None
        result.update(fs_stats=vars(fs.stats), tier_counters=fs.tier.counters(), ns_dir=fs.tier.ns_dir,
                      auth_failures_metric=auth,
                      chunk_bytes=worker.pool.chunk_bytes, evictions=manager.index.evictions,
                      dirty_at_exit=fs.dirty_chunks)
    print(json.dumps(result), flush=True)
    return 0


def chunk_files(ns_dir: str) -> set[str]:
    """Published chunk files (paths relative to the namespace)."""
    out = set()
    for d, _, names in os.walk(ns_dir):
        out.update(os.path.relpath(os.path.join(d, n), ns_dir) for n in names if not n.startswith("."))
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
