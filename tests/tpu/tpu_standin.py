"""A stand-in for tpu-inference's model runner, driven by vLLM's real scheduler.

The real engine (tests/tpu_engine) now proves the round trip, pressure,
faults, the file tier across processes and warm restart; the tests written
against this stand-in were removed where it covers them. The stand-in stays
for what the real engine cannot reach on CPU here: several JAX processes
(multi-host completion), Explicit and Manual mesh axes, decode_save, staging
deferral, use of freed blocks, preemption, KV events, vLLM without worker
metadata, write-back on eviction, corrupt files and bad snapshots; and it
checks restored bytes position by position, which token equality cannot.

It reproduces the surface the connector touches: ``mesh``, ``devices``, a ``kv_caches`` list of per-layer
``(num_blocks, block_size, 2*kv_heads, head_dim)`` arrays sharded with heads
over the 'model' axis, rebound on every step, ``get_kv_cache_layout()``, and
vLLM's ``KVConnectorModelRunnerMixin`` step lifecycle.

Its "model" is a pure function of the token prefix: the KV written for
position p is derived from a rolling hash of tokens[:p+1]. Before computing
a step, the forward checks that every already-computed position of every
scheduled request holds exactly that KV, which is what attention would read.
A load that put wrong, stale or truncated bytes into a block therefore fails
the step, as does a store that captured a block someone else overwrote.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

VOCAB = 512
_M = (1 << 61) - 1


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids (a seed per prompt, so prompts share no prefix by chance)."""
    return [int(x) for x in np.random.default_rng(seed).integers(10, 500, size=n)]


def chunk_files(root) -> list[str]:
    """Names of the files under ``root``, temporaries (dot-names) left out."""
    import os

    return sorted(f for _, _, fs in os.walk(root) for f in fs if not f.startswith("."))


def write_tiny_model(path: Path) -> str:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
        "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return str(path)


# ---- the deterministic "model" ------------------------------------------------
def prefix_hashes(tokens) -> np.ndarray:
    out = np.empty(len(tokens), dtype=np.int64)
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1000003 + int(t) + 1) % _M
        out[i] = h
    return out


def kv_rows(hashes: np.ndarray, layer: int, heads: int, dim: int, dtype) -> np.ndarray:
    """KV of positions with these prefix hashes in one layer: [n, heads, dim]."""
    base = (hashes % 997)[:, None] + np.arange(heads * dim)[None, :] * 7 + 13 * layer
    return (base % 251).astype(np.float32).reshape(-1, heads, dim).astype(dtype)


def next_token(hashes: np.ndarray) -> int:
    return int(hashes[-1] % (VOCAB - 10)) + 10  # never EOS (2)


def expected_chunk(tokens, chunk_idx: int, chunk_tokens: int, layers: int, heads: int, dim: int, dtype,
                   block_size: int) -> np.ndarray:
    """What the host tier must hold for a chunk: [bpc, layers, block_size, heads, dim]."""
    h = prefix_hashes(tokens[: (chunk_idx + 1) * chunk_tokens])[chunk_idx * chunk_tokens :]
    per_layer = [kv_rows(h, layer, heads, dim, dtype) for layer in range(layers)]
    x = np.stack(per_layer, axis=0)  # [L, chunk_tokens, H, D]
    bpc = chunk_tokens // block_size
    return x.reshape(layers, bpc, block_size, heads, dim).transpose(1, 0, 2, 3, 4)


# ---- the runner ---------------------------------------------------------------
@dataclasses.dataclass
class _ReqState:
    blocks: list[int]
    computed: int = 0  # tokens with KV before this step (from the scheduler output)


class StandInRunner:
    """tpu-inference's runner surface plus a checking toy forward."""

    def __init__(self, mesh, *, num_blocks: int, block_size: int, layers: int = 2, kv_heads: int = 4,
                 head_dim: int = 64, dtype=jnp.float32, max_tokens_per_step: int = 512,
                 window: int | None = None):
        self.mesh = mesh
        # Sliding-window layers (even ones, as gpt-oss): a token at p attends positions > p - window only,
        # so those layers' KV is checked only there.
        self.window = window
        self.sliding = {i for i in range(layers) if i % 2 == 0} if window else set()
        self.devices = list(mesh.devices.flat)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers, self.heads, self.dim = layers, 2 * kv_heads, head_dim
        self.dtype = dtype
        self.sharding = NamedSharding(mesh, P(None, None, "model", None))
        self.kv_caches = [
            jax.device_put(jnp.zeros((num_blocks, block_size, self.heads, head_dim), dtype), self.sharding)
            for _ in range(layers)
        ]
        self.max_tokens = max_tokens_per_step
        self.reqs: dict[str, _ReqState] = {}
        self.checked_positions = 0
        self._sampled: dict[str, int] = {}  # last token sampled per request (async scheduling feeds it)
        self.excused = 0  # steps whose wrong KV was reported as a load error in the same step
        self.failures: list[str] = []
        heads, dim = self.heads, head_dim

        def write(caches, idx, rows):
            out = []
            for layer, c in enumerate(caches):
                flat = c.reshape(num_blocks * block_size, heads, dim)
                flat = flat.at[idx].set(rows[layer], mode="drop")
                out.append(flat.reshape(c.shape))
            return out

        self._write = jax.jit(write, donate_argnums=(0,), out_shardings=[self.sharding] * layers)

    def get_kv_cache_layout(self):
        return "NHD"

    # ---- one engine step ------------------------------------------------------
    def execute(self, so, vllm_config, scheduler):
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for r in so.scheduled_new_reqs:
            self.reqs[r.req_id] = _ReqState(list(r.block_ids[0]), r.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            new = list(new[0]) if new else []
            if rid in cached.resumed_req_ids:
                self.reqs[rid] = _ReqState(new)
            else:
                self.reqs[rid].blocks.extend(new)
            self.reqs[rid].computed = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        suspects: dict[str, tuple[int, int]] = {}
        with set_forward_context(None, vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out:
            if so.total_num_scheduled_tokens:
                sampled = self._forward(so, scheduler, suspects)
        self._judge(suspects, kv_out)
        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], kv_connector_output=kv_out,
        )

    def _judge(self, suspects, kv_out) -> None:
        """Wrong KV is acceptable only in blocks the connector reported as
        failed this step (vLLM then discards the step's output for the
        request and recomputes from the first failed block)."""
        invalid = kv_out.invalid_block_ids if kv_out is not None else set()
        for rid, (pos, layer) in suspects.items():
            blocks = self.reqs[rid].blocks
            first = next((i for i, b in enumerate(blocks) if b in invalid), None)
            if first is None or pos // self.block_size < first:
                self.failures.append(f"{rid}: layer {layer} position {pos} has wrong KV")
                raise AssertionError(self.failures[-1])
            self.excused += 1

    def _forward(self, so, scheduler, suspects) -> dict[str, list[int]]:
        bs = self.block_size
        host = [np.asarray(c) for c in self.kv_caches]  # what attention reads this step
        idx, rows, sampled = [], [[] for _ in range(self.layers)], {}
        for rid, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            tokens = list(req.all_token_ids)
            start = self.reqs[rid].computed
            if start + n > len(tokens) and rid in self._sampled:  # its output is not processed yet
                tokens.append(self._sampled[rid])
            end = min(start + n, len(tokens))
            h = prefix_hashes(tokens[:end])
            blocks = self.reqs[rid].blocks
            if start:
                pos = np.arange(start)
                b = np.asarray(blocks)[pos // bs]
                for layer in range(self.layers):
                    lo = max(0, start - self.window) if layer in self.sliding else 0  # what attention reads
                    want = kv_rows(h[:start], layer, self.heads, self.dim, self.dtype)[lo:]
                    got = host[layer][b[lo:], pos[lo:] % bs]
                    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                        wrong = np.any((got.view(np.uint8) != want.view(np.uint8)).reshape(start - lo, -1), axis=1)
                        bad = lo + int(np.argmax(wrong))
                        suspects[rid] = (bad, layer)
                        break
                self.checked_positions += start
            pos = np.arange(start, end)
            idx.append(np.asarray(blocks)[pos // bs] * bs + pos % bs)
            for layer in range(self.layers):
                rows[layer].append(kv_rows(h[start:end], layer, self.heads, self.dim, self.dtype))
            sampled[rid] = [next_token(h)] if end >= len(tokens) else []
            if sampled[rid]:
                self._sampled[rid] = sampled[rid][0]
        idx = np.concatenate(idx)
        n = len(idx)
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens in one step; raise max_tokens_per_step")
        pad_idx = np.full(self.max_tokens, self.num_blocks * bs, dtype=np.int32)
        pad_idx[:n] = idx
        pad_rows = np.zeros((self.layers, self.max_tokens, self.heads, self.dim), dtype=self.dtype)
        for layer in range(self.layers):
            pad_rows[layer, :n] = np.concatenate(rows[layer])
        self.kv_caches = self._write(self.kv_caches, pad_idx, pad_rows)
        return sampled


# ---- the harness: real vLLM scheduler + our connector on both sides ----------
def make_vllm_config(model_dir: str, *, block_size: int, num_blocks: int, extra: dict,
                     max_num_batched_tokens: int = 512, max_num_seqs: int = 8,
                     failure_policy: str = "recompute", dtype: str = "float32", prefix_caching: bool = True,
                     max_model_len: int = 2048, tp: int = 1):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len, seed=0)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kv = KVTransferConfig(kv_connector="TPUOffloadConnector", kv_connector_module_path="tpu_offload.connector",
                          kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy=failure_policy)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv,
                    device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = num_blocks
    # the KV heads' sharding degree the connector sizes per-device bytes by (the stand-in shards its K/V
    # rows over every device of the mesh: tp = the mesh's 8 makes the scheduler's bytes per device exact)
    vc.parallel_config.tensor_parallel_size = tp
    return vc


class Harness:
    def __init__(self, mesh, model_dir: str, *, block_size: int = 16, num_blocks: int = 64, extra: dict,
                 dtype=jnp.float32, max_num_batched_tokens: int = 512, kv_heads: int = 4, head_dim: int = 64,
                 layers: int = 2, async_scheduling: bool = False, window: int | None = None,
                 prefix_caching: bool = True, max_model_len: int = 2048, tp: int = 1):
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        tdtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
        self.vc = make_vllm_config(model_dir, block_size=block_size, num_blocks=num_blocks, extra=extra,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   dtype="bfloat16" if dtype == jnp.bfloat16 else "float32",
                                   prefix_caching=prefix_caching, max_model_len=max_model_len, tp=tp)
        if window:  # the model config tpu-inference would read: sliding on even layers (as gpt-oss)
            hf = self.vc.model_config.hf_config
            hf.sliding_window, hf.num_hidden_layers = window, layers
            hf.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(layers)],
                                   FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads,
                                                     head_size=head_dim, dtype=tdtype))]
        self.kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.vc.scheduler_config.async_scheduling = async_scheduling
        self.async_scheduling = async_scheduling
        self._prev = None  # async scheduling: the step whose output is processed one step late
        self.sched = (AsyncScheduler if async_scheduling else Scheduler)(vllm_config=self.vc, kv_cache_config=self.kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.vc), block_size=block_size)
        self.conn_s = self.sched.connector
        self.conn_w = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, self.kcc)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.conn_w
        self.runner = StandInRunner(mesh, num_blocks=num_blocks, block_size=block_size, layers=layers,
                                    kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                    max_tokens_per_step=max_num_batched_tokens, window=window)
        self.conn_w.register_runner(self.runner)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.block_size = block_size
        self.tokens: dict[bytes, list[int]] = {}  # chunk key -> token prefix ending at the chunk
        self.finished: dict[str, list[int]] = {}
        self.steps = 0
        self._n = 0

    @property
    def sch(self):
        return self.conn_s.scheduler

    @property
    def wrk(self):
        return self.conn_w.worker

    def add(self, prompt: list[int], max_tokens: int = 4, req_id: str | None = None,
            cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req_id = req_id or f"r{self._n}"
        self._n += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        sp.update_from_generation_config({}, 2)
        self.sched.add_request(Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                                       pooling_params=None, block_hasher=self._hasher, cache_salt=cache_salt))
        return req_id

    def step(self):
        so = self.sched.schedule()
        mro = self.runner.execute(so, self.vc, self.sched)
        for rid in list(so.num_scheduled_tokens):
            self._remember(self.sched.requests.get(rid))
        if self.async_scheduling:  # vLLM's async loop: step t's output after scheduling t+1
            prev, self._prev = self._prev, (so, mro)
            if prev is None:
                self.steps += 1
                return so
            so_done, mro_done = prev
        else:
            so_done, mro_done = so, mro
        outs = self.sched.update_from_output(so_done, mro_done)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = list(self.sched.requests[o.request_id].all_token_ids) \
                        if o.request_id in self.sched.requests else []
        self.steps += 1
        return so

    def run(self, max_steps: int = 400, max_seconds: float = 60.0):
        """Step until idle. Steps here take microseconds, unlike a real engine's
        milliseconds, so file reads on I/O threads are waited for by time: after
        ``max_steps`` each step yields 1 ms, until ``max_seconds``."""
        deadline = time.monotonic() + max_seconds
        steps = 0
        while steps < max_steps or time.monotonic() < deadline:
            if not self.sched.has_requests():
                if self._prev is not None:
                    self.sched.update_from_output(*self._prev)
                    self._prev = None
                    continue
                return
            self.step()
            steps += 1
            if steps >= max_steps:
                time.sleep(0.001)
        raise AssertionError(f"engine still busy after {steps} steps and {max_seconds} s")

    def _remember(self, req):
        if req is None:
            return
        ct = self.sch.chunk_tokens
        for i, key in enumerate(self.sch._keys(req)):
            self.tokens.setdefault(bytes(key), list(req.all_token_ids[: (i + 1) * ct]))

    def check_tier(self) -> int:
        """Every ready chunk in the tier holds exactly its prefix's KV. Returns chunks checked."""
        eng = self.wrk.engine
        slabs = [[np.asarray(s) for s in per_group] for per_group in eng.slabs] if eng.slabs is not None else None
        r = self.runner
        n = 0
        for key in self.sch.manager.keys_lru_order():
            slot = self.sch.manager.slot_of(key)
            if slot is None or key not in self.tokens:
                continue
            want_all = expected_chunk(self.tokens[key], self._chunk_index(key), self.sch.chunk_tokens, r.layers,
                                      r.heads, r.dim, r.dtype, self.block_size)
            for gi, g in enumerate(eng.layout.groups):
                if g.kv_group in self.wrk.sliding_classes and not self.sch.tails.held.get(key):
                    continue  # sliding-window layers of a chunk stored without them: nothing to check
                if slabs is None:  # device_put path: the slot's own host array
                    got = np.asarray(eng.host[slot][gi])
                else:
                    k, row = divmod(slot, eng.rows_per_slab)
                    got = slabs[gi][k][row]
                want = want_all[:, list(g.layers)]
                # Host layout: the cache's own block shape and dtype, sharded over heads like the cache.
                assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                    f"host slot {slot} holds the wrong KV for its key"
            n += 1
        return n

    def _chunk_index(self, key: bytes) -> int:
        return len(self.tokens[key]) // self.sch.chunk_tokens - 1


def fs_secret_file(tmp_path) -> str:
    """A fresh secret file under ``tmp_path`` (a shared tier starts only with one)."""
    from tpu_offload.core.fs.auth import make_secret_file

    path = tmp_path / "fs-secret"
    if not path.exists():
        make_secret_file(str(path))
    return str(path)
