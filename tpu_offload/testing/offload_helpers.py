"""Reaching our connector's halves inside a running engine, and waiting for it.

The shapes and sizes the tests use, and the counters they read; in ``tpu_offload.testing``
because the real-engine benchmarks read the same counters the same way.
"""

from __future__ import annotations

import time

import numpy as np

from tpu_offload.testing.engine_run import Shape

# One shape per TP: TP 1 in bf16 with 16-token blocks; TP 2 in float32 with
# 128-token blocks (the tpu-v7 overlay's block size).
SETUPS = {
    "tp1-bf16-bs16": Shape("kv4", "bfloat16", tp=1, block_size=16, num_blocks=40),
    "tp2-f32-bs128": Shape("kv4", "float32", tp=2, block_size=128, num_blocks=8, max_model_len=768),
}

# Sizes for the tiny model; everything else comes from configs/tpu-inference/*.json.
OURS = {"cpu_bytes": "64MiB", "staging_blocks": 32, "verify_checksums": True}


def hit_tokens(prompt_len: int, block_size: int) -> int:
    """Tokens a whole-prompt hit reports: every full block, but the last token is always computed."""
    return min(prompt_len // block_size * block_size, prompt_len - 1)


def sch(eng):
    return eng.scheduler_connector.scheduler


def wrk(eng):
    return eng.worker_connector.worker


def totals(eng) -> dict[str, float]:
    """Scheduler and worker counters since the engine started."""
    return {**sch(eng).totals, **wrk(eng).totals}


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def settle(eng, timeout_s: float = 60.0) -> None:
    """Step the engine until every store has completed (the engine keeps
    stepping for them itself; a test must not reset the cache before)."""
    deadline = time.monotonic() + timeout_s
    while sch(eng).has_pending_work():
        if time.monotonic() > deadline:
            raise AssertionError("stores still pending after %.0f s" % timeout_s)
        eng.llm.llm_engine.step()


def valid_slots(eng) -> set[int]:
    return set(np.flatnonzero(wrk(eng).engine.valid).tolist())


def zero_slots(eng, slots, *, keep_checksums: bool) -> None:
    """Overwrite host chunks with zeros (every local shard). ``keep_checksums``
    refreshes their checksums, as a corruption no checksum can see would."""
    engine = wrk(eng).engine
    for s in slots:
        for view in engine.row_views(int(s)):
            view[:] = 0
        if keep_checksums and engine.checksums is not None:
            engine.checksums[int(s)] = engine._checksum(int(s))


class LookupSpy:
    """Records what our scheduler answers vLLM: (tokens hit, load asynchronously?)."""

    def __init__(self, eng):
        self.conn = eng.scheduler_connector
        self.real = self.conn.get_num_new_matched_tokens
        self.answers: list[tuple[int, bool]] = []

    def __enter__(self):
        def spy(request, num_computed_tokens):
            out = self.real(request, num_computed_tokens)
            self.answers.append(out)
            return out

        self.conn.get_num_new_matched_tokens = spy
        return self

    def __exit__(self, *exc):
        del self.conn.get_num_new_matched_tokens  # back to the class method


class ExternalHits:
    """Sums the tokens vLLM takes from a connector (either connector: the same measure)."""

    def __init__(self, eng):
        self.conn = eng.scheduler_connector
        self.real = self.conn.update_state_after_alloc
        self.tokens = 0

    def __enter__(self):
        def spy(request, blocks, num_external_tokens):
            self.tokens += num_external_tokens
            return self.real(request, blocks, num_external_tokens)

        self.conn.update_state_after_alloc = spy
        return self

    def __exit__(self, *exc):
        del self.conn.update_state_after_alloc


class CompileCounter:
    """Every XLA compile in this process, by function name, as JAX reports it
    (the ``backend_compile`` event ``jax_log_compiles`` logs; a persistent
    compile cache hit is still counted: the program was not ready in memory).
    Install it before the engine starts; ``mark()`` and ``since()`` bracket a phase."""

    _installed: "CompileCounter | None" = None

    def __init__(self):
        self.names: list[str] = []

    @classmethod
    def install(cls) -> "CompileCounter":
        if cls._installed is None:
            import jax

            counter = cls()

            def on_event(event, duration, **kw):
                if event == "/jax/core/compile/backend_compile_duration":
                    counter.names.append(str(kw.get("fun_name", "?")))

            jax.monitoring.register_event_duration_secs_listener(on_event)
            cls._installed = counter
        return cls._installed

    def mark(self) -> int:
        return len(self.names)

    def since(self, mark: int) -> list[str]:
        return self.names[mark:]


def store_then_hit_every_block(eng, w, base, block_size: int) -> None:
    """Pass 1 stores, vLLM's prefix cache is reset, pass 2 hits every full block from our tier:
    identical tokens both passes, and what vLLM took is what we counted, with no load error."""
    t0 = totals(eng)
    assert w.run(eng) == base
    settle(eng)
    t1 = totals(eng)
    assert delta(t1, t0, "stored_chunks") > 0
    eng.reset_prefix_cache()
    with ExternalHits(eng) as took:
        assert w.run(eng) == base
    t2 = totals(eng)
    want = sum(hit_tokens(len(p), block_size) for p in w.prompts)
    assert delta(t2, t1, "hit_tokens") == want
    assert took.tokens == want, "what vLLM took from our tier is what we counted"
    assert delta(t2, t1, "load_errors") == 0


def zero_device_kv(eng) -> None:
    """Overwrite the engine's whole KV cache with zeros, in place: after vLLM's prefix cache is
    reset, a later pass's tokens then come from what a connector loaded, not from KV the device
    still held. In place (donated, same buffers), because a connector may hold the cache's raw
    buffers (tpu-inference's RaidenOffloadConnector registers them once)."""
    import jax

    caches = eng.runner.kv_caches

    def pointers(cs):
        return [s.data.unsafe_buffer_pointer() for c in cs for s in c.addressable_shards]

    before = pointers(caches)
    zero = jax.jit(lambda cs: [c.at[:].set(0) for c in cs], donate_argnums=0,
                   out_shardings=[c.sharding for c in caches])
    eng.runner.kv_caches = jax.block_until_ready(zero(caches))
    assert pointers(eng.runner.kv_caches) == before, "zeroing moved the KV cache's buffers"
