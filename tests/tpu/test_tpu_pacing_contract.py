"""The per-step contract, end to end: vLLM's real scheduler, our scheduler and worker halves, the real
``Pacer`` and transfer engine (paced, program path) on the emulated 8-device mesh, every restored position
checked by the stand-in's forward, and an in-order device model timing what the worker sends.

The device model is the TPU7x queue: one in-order queue for programs and DMAs, a 15 ms forward, host
copies costing their bytes at the link's bandwidth (one device's share of a chip's link, each direction;
the link is full duplex, so a step's loads and stores flow side by side). The pieces the pacer sends after
forward N are queued before forward N+1, so forward N+1 is delayed by their link time, and the harness
waits for them before it runs forward N+1;
the contract says that delay stays within the configured stall, that a 1,000-block hit lands within
ceil(its bytes / the step budget) + 2 steps, that prefill stores of 32 and 64 blocks a step are all
stored, and that a second large hit 10 steps later is deferred, never refused.

Scale: the deployment's ratios (Qwen3-32B at TP 8 on TPU7x: 4 MiB per device and block, a 380 MB budget =
90 blocks, 16 MiB pieces = 4 blocks, 1,000 staging blocks) on the stand-in's 8 KiB per device and block.
"""

import math

import pytest
from prometheus_client import REGISTRY

from tpu_standin import prompt

pytestmark = pytest.mark.engine

BS = 16
HIT = 1000  # blocks of each large prompt
FORWARD_S = 0.015
STALL_MS = 20.0
DEVICE_BLOCK = 2 * BS * 1 * 64 * 4  # 2 layers x 16 tokens x 1 K/V row per device (8 over 8) x 64 x f32
BUDGET_BLOCKS = 90
# a chip's link such that one device's share of 20 ms is 90 blocks (2 devices per chip, as TPU7x)
CHIP_GBPS = (BUDGET_BLOCKS + 0.5) * DEVICE_BLOCK * 2 / (STALL_MS / 1e3) / 1e9


class DeviceModel:
    """Records every piece the pacer sends, by engine step; times the queue they form behind each forward."""

    def __init__(self, h):
        self.h = h
        self.sent: dict[int, dict[str, int]] = {}  # step -> direction -> bytes per device sent after its forward
        pacer = h.wrk.pacer
        assert pacer is not None, "the worker must be paced"
        pacer.on_send.append(self._on_send)
        self.device_gbps = CHIP_GBPS / h.sch.s.config.devices_per_chip
        # The queue is in order: forward N+1 runs only after the copies sent behind forward N. Here steps
        # take microseconds and JAX CPU copies land on threads, so without this wait what lands by a step
        # would depend on the machine's load (a busy 2-core VM landed B 11 steps late).
        execute = h.runner.execute

        def in_order(*a, **k):
            for p in list(pacer.flying):
                if p.done is not None:
                    p.done.block_until_ready()
            return execute(*a, **k)

        h.runner.execute = in_order

    def _on_send(self, piece) -> None:
        per = self.sent.setdefault(self.h.steps, {"load": 0, "store": 0})
        per["load" if piece.kind == "scatter" else piece.kind] += piece.nbytes

    def delay_ms(self, step: int) -> float:
        """What forward ``step + 1`` waits, in the in-order queue, behind the copies sent after forward ``step``."""
        return max(self.sent.get(step, {"": 0}).values()) / (self.device_gbps * 1e9) * 1e3

    def step_ms(self, step: int) -> float:
        return FORWARD_S * 1e3 + self.delay_ms(step)


@pytest.fixture
def harnesses(mesh, tmp_path):
    """As conftest's, on the tiny model with room for 16,000-token prompts."""
    import json

    from tpu_standin import Harness, write_tiny_model

    cfg = tmp_path / "config.json"
    write_tiny_model(tmp_path)
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "max_position_embeddings": 32768}))
    made = []

    def build(extra: dict, **kw):
        made.append(Harness(mesh, str(tmp_path), block_size=BS, extra=extra, **kw))
        return made[-1]

    yield build
    for h in made:
        h.conn_w.shutdown()


def harness(harnesses, blocks_per_step: int):
    return harnesses(
        {"num_cpu_chunks": 2 * HIT + 64, "staging_blocks": 1000, "transfer_path": "program",
         "transfer_pacing": "on", "transfer_piece_bytes": 4 * DEVICE_BLOCK, "transfer_bandwidth_gbps": CHIP_GBPS,
         "transfer_stall_ms": STALL_MS, "devices_per_chip": 2, "load_decision": "always",
         "interleaved_lookups": False, "blocks_per_chunk": 1},
        num_blocks=2 * HIT + 100, max_num_batched_tokens=blocks_per_step * BS, max_model_len=HIT * BS + 64, tp=8)


def spy(h, obj, name, record):
    orig = getattr(obj, name)

    def wrapper(*a, **k):
        r = orig(*a, **k)
        record(h.steps, a, r)
        return r

    setattr(obj, name, wrapper)


def deferred(direction: str) -> float:
    return REGISTRY.get_sample_value("tpu_offload_deferred_bytes_total", {"direction": direction}) or 0.0


@pytest.mark.parametrize("blocks_per_step", [32, 64])
def test_step_contract_in_an_in_order_device_model(harnesses, blocks_per_step):
    h = harness(harnesses, blocks_per_step)
    s = h.sch.s
    assert s.device_block_bytes == DEVICE_BLOCK and s.step_budget_blocks == BUDGET_BLOCKS, \
        (s.device_block_bytes, s.step_budget_blocks)
    assert h.wrk.pacer.step_bytes == s.step_budget_bytes  # one figure, both halves
    model = DeviceModel(h)
    metas: list[tuple[int, object]] = []
    spy(h, h.conn_s, "build_connector_meta", lambda step, a, r: metas.append((step, r)))
    landed: dict[str, int] = {}

    def on_output(step, a, r):
        for rid in getattr(a[0], "finished_recving", None) or ():
            landed.setdefault(rid, step)

    spy(h, h.conn_s, "update_connector_output", on_output)

    # 1. Two 1,000-block prompts prefilled at `blocks_per_step` blocks a step: every block stored.
    a, b = prompt(HIT * BS, 41), prompt(HIT * BS, 42)
    for p in (a, b):
        h.add(p, max_tokens=1)
        h.run(max_steps=400, max_seconds=600)
    w = h.wrk.totals
    assert w.get("stored_chunks", 0) == 2 * HIT and w.get("store_errors", 0) == 0, w
    assert w.get("staging_overdrawn_pieces", 0) == 0, w  # the pacer never had to pass its budget
    assert h.sch.manager.stats().used_chunks == 2 * HIT

    # 2. HBM forgets them; A hits, and B hits 10 steps later while A is still loading.
    assert h.sched.reset_prefix_cache()
    load_deferred = deferred("load")
    first = h.steps
    ra = h.add(a, max_tokens=2)
    for _ in range(10):
        h.step()
    assert ra not in landed  # still loading: 10 steps move 900 of its 1,000 blocks
    rb = h.add(b, max_tokens=2)
    h.run(max_steps=400, max_seconds=600)

    # Nothing refused or recomputed: both hits loaded whole, every position checked by the forward.
    assert w.get("loaded_chunks", 0) == 2 * HIT and w.get("load_errors", 0) == 0, w
    assert ra in h.finished and rb in h.finished
    assert h.runner.checked_positions > 0 and not h.runner.failures and h.runner.excused == 0
    assert deferred("load") > load_deferred  # B waited for the budget A was using
    assert w.get("staging_overdrawn_pieces", 0) == 0, w  # and the pacer kept up with every step's admission

    # A lands within ceil(bytes / step budget) + 2 steps.
    start_a = next(step for step, m in metas if any(op.req_id == ra and op.blocks for op in m.loads))
    assert start_a == first
    bound = math.ceil(HIT * DEVICE_BLOCK / s.step_budget_bytes) + 2
    assert landed[ra] - start_a + 1 <= bound, (landed[ra] - start_a + 1, bound)
    # B's parts began only when the budget had room, and it lands just as fast once it has it.
    start_b = next(step for step, m in metas if any(op.req_id == rb and op.blocks for op in m.loads))
    assert landed[rb] - start_a + 1 <= 2 * math.ceil(HIT / BUDGET_BLOCKS) + 2, (start_b, landed[rb])

    # Per step and direction the scheduler emitted at most the budget, and the device model's forward
    # never waited longer than the configured stall behind what the pacer sent.
    for step, m in metas:
        assert sum(len(op.blocks) for op in m.loads) <= BUDGET_BLOCKS, step
        assert sum(len(op.blocks) for op in m.stores) <= BUDGET_BLOCKS, step
    worst = max(model.delay_ms(step) for step in model.sent)
    assert 0.5 * STALL_MS < worst <= STALL_MS, worst  # the budget is used, and never passed
    assert all(model.step_ms(step) <= FORWARD_S * 1e3 + STALL_MS for step in model.sent)
