"""Sliding-window layers: which ones, and whether storing only their window is safe.

A token at position ``p`` of a sliding-window layer attends positions
``> p - W``. A later request that reuses a prefix of ``L`` tokens computes
from ``L`` on, so of that prefix its sliding-window layers only ever read the
``ceil(W / block_size)`` blocks before ``L`` (one token more than vLLM's
``cdiv(W - 1, block_size)``: a full-prompt hit recomputes token ``L - 1``).
Storing and loading just those blocks for those layers moves a fraction of
their bytes ("window" mode).

When it is safe. With vLLM's hybrid KV-cache manager on (the connector
supports it), a model whose sliding-window layers get a ``SlidingWindowSpec``
has a KV-cache group for them with a block table of its own (``for_groups``):
vLLM frees their blocks outside the window and asks that group for the window
before any prefix hit, so the window is always safe; tpu-inference's
vLLM-model path does this for gpt-oss. Its JAX models give every layer a
full-attention KV spec (``kv_cache_manager.py``: ``sliding_window = None``,
"re-enable once mixed dims with sliding_window is supported"), so vLLM keeps
one block table for all layers and its prefix cache serves *any* prefix of a
request's blocks. After a window-only load of ``L`` tokens, the blocks before
the window hold no sliding-window KV, and a later request sharing only the
first ``H < L`` tokens would get them from vLLM's prefix cache and attend to
whatever those layers' blocks held before: wrong KV. So there "window" needs
vLLM's prefix caching off (``--no-enable-prefix-caching``); with it on, "auto"
moves every block and says why once at start, and an explicit "window" is
refused.

Which layers. The engine's own rule, read from the model config: gpt-oss in
tpu-inference slides on even layers (``gpt_oss.py``: ``i % 2 == 0``, whatever
``layer_types`` says); other models by ``layer_types[i] ==
"sliding_attention"`` (Gemma 4). Layers map to cache arrays through the
runner's ``layer_name_to_kvcache_index`` (``layer.{i}`` on the JAX path,
``model.layers.{i}.…`` on the vLLM-model path); an array shared by a sliding and
a full layer is treated as full.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from tpu_offload.core.config import ConfigError

log = logging.getLogger(__name__)

SLIDING = "sliding_attention"
# A layer's index in the runner's layer names: "layer.3" (tpu-inference's JAX models),
# "model.layers.3.attn.attn" (its vLLM-model path).
LAYER_INDEX = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")
EVEN_LAYERS_SLIDE = ("GptOssForCausalLM",)  # tpu-inference hard-codes the pattern for these


@dataclasses.dataclass(frozen=True)
class Windows:
    tokens: int  # W
    layers: frozenset[int]  # model layers that attend through the window

    def tail_blocks(self, block_size: int) -> int:
        """Blocks before a prefix's end that a request continuing it can attend to."""
        return -(-self.tokens // block_size)

    def cache_classes(self, runner, num_caches: int) -> list[tuple[int]]:
        """Per cache array: ``(1,)`` if only sliding layers use it, else ``(0,)`` (the layout's groups)."""
        index = dict(getattr(runner, "layer_name_to_kvcache_index", None) or {})
        users: dict[int, set[bool]] = {}
        for name, i in index.items():
            m = LAYER_INDEX.search(name)
            if m is None:
                raise ValueError(f"KV layer name {name!r}: no layer index in it; cannot tell whether it slides")
            users.setdefault(int(i), set()).add(int(m.group(1)) in self.layers)
        if not users:  # no map: layer i uses cache i
            users = {i: {i in self.layers} for i in range(num_caches)}
        return [(1,) if users.get(i) == {True} else (0,) for i in range(num_caches)]


def sliding_layers(vllm_config) -> Windows | None:
    """The model's sliding-window layers as tpu-inference runs them (None: it has none)."""
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_config", None)
    if hf is None:
        return None
    text = getattr(hf, "text_config", None) or hf
    window = getattr(text, "sliding_window", None)
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if not window or not n:
        return None
    archs = tuple(getattr(hf, "architectures", None) or ())
    if any(a in EVEN_LAYERS_SLIDE for a in archs):
        layers = frozenset(i for i in range(n) if i % 2 == 0)
    else:
        types = list(getattr(text, "layer_types", None) or ())
        layers = frozenset(i for i, t in enumerate(types[:n]) if t == SLIDING)
    return Windows(int(window), layers) if layers else None


def for_groups(group_windows: tuple[int | None, ...], cfg, vllm_config) -> Windows | None:
    """The windows for this engine's KV-cache groups (see ``resolve`` for a single group).

    With vLLM's hybrid KV-cache manager (several groups), a sliding-window group
    has its own block table: vLLM frees its blocks outside the window and its
    prefix cache asks that group for the window before any hit, so storing and
    loading the window is safe with prefix caching on, and all there is to load.
    A failed load must then be reported per request (vLLM cannot map block ids
    of several groups back to requests), which it takes from asynchronous loads
    only."""
    if all(w is not None for w in group_windows):
        raise ConfigError(f"every KV-cache group has a sliding window ({', '.join(map(str, group_windows))} tokens): "
                          "vLLM frees their blocks outside the window, and the offload connector needs a "
                          "full-attention group to name a chunk's blocks; serve this model without "
                          "--kv-transfer-config")
    if len(group_windows) <= 1:
        return resolve(cfg.sliding_window, vllm_config)
    if cfg.sync_load:
        raise ConfigError(f"sync_load=True (TPU_OFFLOAD_SYNC_LOAD) with {len(group_windows)} KV-cache groups: vLLM "
                          "recovers a failed load of such a model only as a failed asynchronous load; set sync_load "
                          "to false")
    sliding_windows = [w for w in group_windows if w is not None]
    if not sliding_windows:
        return None
    if cfg.sliding_window == "all":
        log.info("tpu_offload: sliding_window='all' has no effect with vLLM's hybrid KV-cache manager: it frees "
                 "sliding-window blocks outside the window, so only the window is there to store")
    return Windows(max(sliding_windows), frozenset())


def resolve(mode: str, vllm_config) -> Windows | None:
    """The windows to offload by (None: move every block). Raises for a "window" that is not safe."""
    if mode == "all":
        return None
    windows = sliding_layers(vllm_config)
    if windows is None:
        return None
    caching = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True)
    if caching is not False:
        why = ("vLLM's prefix cache is on and tpu-inference gives sliding-window layers full-attention block "
               "tables, so a later request sharing a shorter prefix would read sliding-window KV that a "
               "window-only load never restored")
        if mode == "window":
            raise ConfigError(f"sliding_window='window' (TPU_OFFLOAD_SLIDING_WINDOW): {why}. Serve with "
                              "--no-enable-prefix-caching, or set sliding_window to 'auto' or 'all'")
        log.info("tpu_offload: %d sliding-window layers (window %d tokens) are offloaded whole: %s",
                 len(windows.layers), windows.tokens, why)
        return None
    return windows
