"""Named prompt workloads, so a no-connector baseline can be computed once for all.

A workload is a sequence of rounds; each round is one ``generate`` call (the
prompts of a round are batched together). Prompts are token ids drawn from a
seeded generator: the same workload is the same bytes in every process.
In ``tpu_offload.testing`` so that the demo and the benchmarks draw the tests' prompts.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from tpu_offload.testing.tiny_models import VOCAB


def prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    rounds: tuple[tuple[tuple[int, ...], ...], ...]
    max_tokens: int = 8
    block_size: int | None = None  # the engine block size it is sized for (None: any)

    registry: ClassVar[dict[str, "Workload"]] = {}

    def __post_init__(self):
        Workload.registry[self.name] = self

    @classmethod
    def of(cls, name: str, rounds: list[list[list[int]]], max_tokens: int = 8, block_size: int | None = None):
        return cls(name, tuple(tuple(tuple(p) for p in r) for r in rounds), max_tokens, block_size)

    @property
    def prompts(self) -> list[list[int]]:
        return [list(p) for r in self.rounds for p in r]

    def run(self, eng, rounds=None) -> list[list[int]]:
        """Tokens per prompt, rounds in order (``rounds`` picks a subset by index)."""
        out = []
        for i, r in enumerate(self.rounds):
            if rounds is None or i in rounds:
                out += eng.generate([list(p) for p in r], self.max_tokens)
        return out


def shared_prefix(seed: int, prefix: int, suffixes: int, suffix_len: int) -> list[list[int]]:
    """Prompts sharing one prefix, each with its own suffix."""
    head = prompt(seed, prefix)
    return [head + prompt(seed * 1000 + i, suffix_len) for i in range(suffixes)]


# ---- the workloads the tests run -------------------------------------------------
# block_size 16: prompts of 5-10 blocks; block_size 128: 2-3 blocks.
ROUNDTRIP = {16: Workload.of("roundtrip16", [[prompt(1, 100), prompt(2, 165), prompt(3, 70)]], block_size=16),
             128: Workload.of("roundtrip128", [[prompt(1, 300), prompt(2, 400)]], block_size=128)}
NEGATIVE = {16: Workload.of("negative16", [[prompt(11, 130)]], block_size=16),
            128: Workload.of("negative128", [[prompt(11, 300)]], block_size=128)}
FAULTS = {16: Workload.of("faults16", [[prompt(21, 120), prompt(22, 90)]], block_size=16),
          128: Workload.of("faults128", [[prompt(21, 300), prompt(22, 280)]], block_size=128)}
# Device pressure: more prefixes than the KV cache holds, then the first ones again.
PRESSURE = {16: Workload.of("pressure16", [[prompt(31 + i, 112)] for i in range(8)]
                            + [[prompt(31, 112)], [prompt(32, 112)]], block_size=16),
            128: Workload.of("pressure128", [[prompt(31 + i, 260)] for i in range(5)]
                             + [[prompt(31, 260)], [prompt(32, 260)]], block_size=128)}
DETERMINISM = Workload.of("determinism", [[prompt(41, 40), prompt(42, 100), prompt(43, 170), prompt(44, 70)]],
                          max_tokens=24)
# 32-token blocks (an MLA model's latent cache packs 32 tokens per row): the same prompts as roundtrip16.
ROUNDTRIP[32] = Workload.of("roundtrip32", [[prompt(1, 100), prompt(2, 165), prompt(3, 70)]], block_size=32)
# The load decision (test_tpu_engine_load_decision.py): a writer publishes four prompts to files; a
# replica runs a cold prompt of its own (its steps compile the forward and time it), then the four one by
# one (the file tier's time is learned from the first; the others are decided on).
DECISION_PUBLISH = Workload.of("decision_publish", [[prompt(292 + i, 96) for i in range(4)]], block_size=16)
DECISION_REPLICAS = [Workload.of(f"decision_replica{i}", [[prompt(290 - i, 96)]]
                                 + [[prompt(292 + j, 96)] for j in range(4)], block_size=16) for i in range(2)]
