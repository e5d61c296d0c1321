"""Greedy decoding with HF transformers in float32: the reference the engine must match."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each step: how far from a tie


def greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[Greedy]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens, margins = [], []
            past = None
            step = ids
            for _ in range(max_tokens):
                res = model(input_ids=step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                top = torch.topk(res.logits[0, -1].float(), 2)
                tokens.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                step = top.indices[:1].view(1, 1)
            out.append(Greedy(tokens, margins))
    return out


def agreed_prefix(ref: Greedy, margin: float) -> int:
    """Tokens up to (excluding) the first step whose top-2 margin is below ``margin``:
    a different but equally right float rounding may pick either token there,
    and every later token then has a different context."""
    for i, m in enumerate(ref.margins):
        if m < margin:
            return i
    return len(ref.tokens)
