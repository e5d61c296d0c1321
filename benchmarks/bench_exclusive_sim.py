"""Trace simulation: exclusive vs write-through host tier vs HBM alone, at deployment scale.

No engine: HBM is modeled as vLLM's prefix cache (a pool of blocks; a
finished request's blocks join the free queue tail-first, so a prompt's tail
is evicted before its head; a hit takes blocks out of the queue; allocation
pops the queue head and drops that block's hash). The host tier is the
project's own ``LRUChunkManager`` and the exclusive policy's bookkeeping is
the project's own ``HbmWatch`` (``tpu_offload.core.policy``), driven the way
the connector drives them:

* write_through: every prompt block not on the host is stored the step it is
  computed (present ones are touched).
* exclusive: a prompt block is watched while HBM caches it; when allocation
  hands its block to other content, it is stored then (if not on the host).
  A host hit is loaded into HBM and its host copy stays (the connector does
  not drop it).
* Hits: vLLM's HBM prefix first, then the host tier continues it (the
  exclusive connector looks the host up from where HBM's hit ends).

Traces (128-token blocks, Qwen3-32B at 256 KiB per token, HBM KV 650 GB,
host 773 GB):

* llm-d's TPU benchmark shape: 250 groups x 5 prompts, a 16K-token shared
  prefix and a 256-token question each, in Poisson (random) order.
* multi-turn chat: conversations whose every turn resends the whole history
  plus a new message; the reply stays in HBM's cache (vLLM caches full
  decode blocks) but is stored by neither policy (decode_save off).

``concurrency`` requests hold their blocks at once (arrival order, FIFO
completion). Prints a table, writes results/exclusive_sim.json. Seconds.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, write_json  # noqa: E402
from tpu_offload.core.keys import make_chunk_key  # noqa: E402
from tpu_offload.core.lru import LRUChunkManager  # noqa: E402
from tpu_offload.core.manager import Lookup  # noqa: E402
from tpu_offload.core.policy import HbmWatch  # noqa: E402

BLOCK_TOKENS = 128
BYTES_PER_TOKEN = 256 * 1024  # Qwen3-32B: 64 layers x 8 KV heads x 128 x 2 (K, V) x bf16
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


class HbmPool:
    """vLLM's block pool as the prefix cache sees it: free queue (LRU), hash per block, ref counts."""

    def __init__(self, num_blocks: int):
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}
        self.ref = [0] * num_blocks

    def tag(self, block: int):
        return self.hash_of[block]

    def hit(self, hashes) -> list[int]:
        out = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def new(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("HBM too small for the running requests")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evicted from the prefix cache
                del self.block_of[h]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, h: bytes) -> None:
        if h not in self.block_of and self.hash_of[block] is None:
            self.block_of[h] = block
            self.hash_of[block] = h

    def release(self, blocks) -> None:
        for b in reversed(blocks):  # tail first: evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None


def _h(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def llmd_trace(groups: int, prompts: int, prefix_tokens: int, question_tokens: int, seed: int):
    """(request id, block hashes, prompt blocks, output blocks, shared-prefix blocks) per request."""
    order = [g for g in range(groups) for _ in range(prompts)]
    random.Random(seed).shuffle(order)  # Poisson arrivals of uniformly drawn groups: a random order
    pb, qb = prefix_tokens // BLOCK_TOKENS, question_tokens // BLOCK_TOKENS
    for i, g in enumerate(order):
        prefix = [_h("g", g, j) for j in range(pb)]
        yield i, prefix + [_h("q", i, j) for j in range(qb)], pb + qb, 0, pb


def chat_trace(users: int, turns: int, system_tokens: int, msg_tokens: int, reply_tokens: int, seed: int):
    """Each turn resends the history: system prompt, then (message, reply) pairs, then a new message."""
    rng = random.Random(seed)
    pending = [u for u in range(users) for _ in range(turns)]
    rng.shuffle(pending)  # Poisson arrivals; a user's turns stay in order (turn = count seen so far)
    seen = [0] * users
    sysb = system_tokens // BLOCK_TOKENS
    per_turn = (msg_tokens + reply_tokens) // BLOCK_TOKENS
    msgb = msg_tokens // BLOCK_TOKENS
    for i, u in enumerate(pending):
        t = seen[u]
        seen[u] += 1
        hashes = [_h("sys", j) for j in range(sysb)]
        hashes += [_h("u", u, j) for j in range(per_turn * t + msgb)]
        outb = reply_tokens // BLOCK_TOKENS
        hashes += [_h("u", u, per_turn * t + msgb + j) for j in range(outb)]
        prompt = sysb + per_turn * t + msgb
        yield i, hashes, prompt, outb, prompt - msgb  # "shared prefix": all but the new message


def simulate(trace, policy: str, hbm_blocks: int, host_blocks: int, concurrency: int, budget_blocks: int):
    pool = HbmPool(hbm_blocks)
    host = LRUChunkManager(host_blocks, BLOCK_BYTES, enable_events=False) if policy != "hbm" else None
    watch = HbmWatch()
    key_of: dict[bytes, object] = {}
    running: collections.deque = collections.deque()
    seen_prefix: set[bytes] = set()
    n = prompt_blocks = hbm_hit = host_hit = stored = loaded = lost = 0
    repeat_blocks = repeat_recomputed = 0

    def key(h):
        k = key_of.get(h)
        if k is None:
            k = key_of[h] = make_chunk_key(h)
        return k

    def store(keys) -> int:
        keys = [k for k in keys if host.lookup(k) is Lookup.MISS]
        if not keys:
            return 0
        alloc = host.prepare_store(keys)
        if alloc is None:
            return -len(keys)
        host.complete_store(alloc.keys)
        return len(alloc.keys)

    for rid, hashes, n_prompt, n_out, n_shared in trace:
        n += 1
        if len(running) >= concurrency:
            pool.release(running.popleft())
        prompt = hashes[:n_prompt]
        local = pool.hit(prompt[: n_prompt - 1])  # vLLM computes at least one token
        nh = len(local)
        ext = 0
        if host is not None:
            keys = [key(h) for h in prompt[: n_prompt - 1]]
            start = 0 if policy == "write_through" else nh  # exclusive: the host continues HBM's hit
            run = host.lookup_prefix(keys[start:]) + start
            if run > nh:
                ext = run - nh
                host.touch(keys[nh:run])
        pool.take(local)
        fresh = pool.new(len(hashes) - nh)
        blocks = local + fresh
        if policy == "exclusive":  # blocks handed out: their old content leaves HBM before this forward
            evicted = watch.check(fresh, pool.tag)
            if evicted:
                room = budget_blocks
                keep = [w.key for w in evicted[:room]]
                got = store(keep)
                stored += max(got, 0)
                lost += len(evicted) - len(keep) + (-got if got < 0 else 0)
        for b, h in zip(blocks[nh:], hashes[nh:]):
            pool.cache(b, h)
        hbm_hit += nh
        host_hit += ext
        loaded += ext
        prompt_blocks += n_prompt
        for j in range(n_shared):
            if prompt[j] in seen_prefix:
                repeat_blocks += 1
                repeat_recomputed += j >= nh + ext
            else:
                seen_prefix.add(prompt[j])
        if policy == "write_through":
            got = store([key(h) for h in prompt])
            stored += max(got, 0)
            host.touch([key(h) for h in prompt])
        elif policy == "exclusive":
            for j, (b, h) in enumerate(zip(blocks[:n_prompt], prompt)):
                if not watch.watch(key(h), (b,), pool.tag):
                    stored += max(store([key(h)]), 0)
        running.append(blocks)
    return {
        "requests": n,
        "hit_rate_pct": 100.0 * (hbm_hit + host_hit) / prompt_blocks,
        "hbm_hit_pct": 100.0 * hbm_hit / prompt_blocks,
        "host_hit_pct": 100.0 * host_hit / prompt_blocks,
        "recompute_pct": 100.0 * repeat_recomputed / max(repeat_blocks, 1),
        "d2h_MB_per_req": stored * BLOCK_BYTES / n / 1e6,
        "h2d_MB_per_req": loaded * BLOCK_BYTES / n / 1e6,
        "moved_MB_per_req": (stored + loaded) * BLOCK_BYTES / n / 1e6,
        "lost_blocks": lost + watch.lost,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hbm-gb", type=float, default=650.0)
    ap.add_argument("--host-gb", type=float, default=773.0)
    ap.add_argument("--groups", type=int, default=250)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=16384)
    ap.add_argument("--question-tokens", type=int, default=256)
    ap.add_argument("--chat-users", type=int, default=400)
    ap.add_argument("--chat-turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1],
                    help="requests holding blocks at once (FIFO; 64 gives the same figures as 1: a uniform shift)")
    ap.add_argument("--budget-blocks", type=int, default=1 << 30,
                    help="eviction copies per step before blocks are lost (default: unbounded)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hbm_blocks = int(args.hbm_gb * 1e9) // BLOCK_BYTES
    host_blocks = int(args.host_gb * 1e9) // BLOCK_BYTES
    traces = {
        "llm-d 250x5 16K": lambda: llmd_trace(args.groups, args.prompts, args.prefix_tokens,
                                               args.question_tokens, args.seed),
        "chat 400x8": lambda: chat_trace(args.chat_users, args.chat_turns, 2048, 1024, 512, args.seed),
    }
    rows = []
    t0 = time.perf_counter()
    for name, make in traces.items():
        ws = len({h for _, hs, p, _o, _s in make() for h in hs[:p]}) * BLOCK_BYTES / 1e9
        for conc in args.concurrency:
            for policy in ("hbm", "write_through", "exclusive"):
                r = simulate(make(), policy, hbm_blocks, host_blocks, conc, args.budget_blocks)
                rows.append({"trace": name, "working_set_GB": ws, "concurrency": conc, "policy": policy, **r})
    took = time.perf_counter() - t0
    cols = ["trace", "working_set_GB", "concurrency", "policy", "hit_rate_pct", "hbm_hit_pct", "host_hit_pct",
            "recompute_pct", "d2h_MB_per_req", "h2d_MB_per_req", "lost_blocks"]
    print_table(rows, cols, title=f"HBM {args.hbm_gb:g} GB, host {args.host_gb:g} GB, {BLOCK_TOKENS}-token blocks, "
                f"{BYTES_PER_TOKEN // 1024} KiB/token ({took:.1f} s)")
    write_json("exclusive_sim", {"hbm_blocks": hbm_blocks, "host_blocks": host_blocks, "block_bytes": BLOCK_BYTES,
                                 "seconds": took, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
