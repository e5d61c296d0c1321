"""The vLLM kernel build the test bed loads must be one this CPU can run.

tpu-inference's platform imports ``vllm._C``, the AVX-512 + BF16 build: on an
AVX2-only x86 CPU that is SIGILL. ``vllm_kernels`` chooses as vLLM's own CPU
platform does; here on given flag sets, and for real with the AVX2 build
forced on this machine (any x86 CPU with AVX-512 also runs AVX2 code).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tpu_offload.testing import vllm_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HASWELL = {"fpu", "sse4_2", "avx", "avx2", "fma", "bmi2"}  # also Zen 1-3: no AVX-512
SKYLAKE_X = HASWELL | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
SAPPHIRE_RAPIDS = SKYLAKE_X | {"avx512_bf16", "avx512_vnni", "amx_bf16"}
KNIGHTS_LANDING = HASWELL | {"avx512f", "avx512cd", "avx512er", "avx512pf"}  # no BW/VL/DQ


@pytest.mark.parametrize("flags,machine,build", [
    (SAPPHIRE_RAPIDS, "x86_64", "_C"),
    (SKYLAKE_X, "x86_64", "_C_AVX512"),
    (HASWELL, "x86_64", "_C_AVX2"),
    (KNIGHTS_LANDING, "x86_64", "_C_AVX2"),
    (HASWELL | {"avx512_bf16"}, "x86_64", "_C_AVX2"),  # BF16 alone is not AVX-512
    ({"fp", "asimd", "bf16"}, "aarch64", "_C"),  # one build off x86
])
def test_choice_per_cpu(flags, machine, build):
    assert vllm_kernels.choose(frozenset(flags), machine) == build


def test_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx avx2 fma\n")
    assert vllm_kernels.cpu_flags(str(info)) == {"fpu", "avx", "avx2", "fma"}
    assert vllm_kernels.choose(vllm_kernels.cpu_flags(str(info)), "x86_64") == "_C_AVX2"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="one build off x86")
def test_this_machine_chosen_as_torch_sees_it(monkeypatch):
    """vLLM decides with torch.cpu._is_avx512_supported / _is_avx512_bf16_supported: agree with it here."""
    import torch

    monkeypatch.delenv(vllm_kernels.ENV, raising=False)
    want = ("_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512") if torch.cpu._is_avx512_supported() \
        else "_C_AVX2"
    assert vllm_kernels.selected() == want


def test_bad_override_named(monkeypatch):
    monkeypatch.setenv(vllm_kernels.ENV, "avx2")
    with pytest.raises(ValueError, match=r"TPU_ENGINE_VLLM_KERNELS='avx2': must be one of _C, _C_AVX512, _C_AVX2"):
        vllm_kernels.selected()


FORCED = """
import os, sys
sys.path.insert(0, {repo!r})
from tpu_offload.testing import cpu_support
cpu_support.prepare_vllm()
import torch
import tpu_inference.platforms.tpu_platform  # runs `import vllm._C`
from vllm.platforms import current_platform
maps = open("/proc/self/maps").read()
assert "/_C_AVX2.abi3.so" in maps and "/_C.abi3.so" not in maps and "/_C_AVX512.abi3.so" not in maps, "wrong build"
assert type(current_platform).__name__ == "TpuPlatform"
x, w = torch.randn(5, 256), torch.rand(256)
out = torch.empty_like(x)
torch.ops._C.rms_norm(out, x, w, 1e-6)  # a kernel from the AVX2 build
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
torch.testing.assert_close(out, want)
print("OK")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 build exists on x86 only")
def test_forced_avx2_build_serves_tpu_inference():
    """A fresh process with the AVX2 build forced: tpu-inference's platform imports
    and a kernel runs from that build, and the AVX-512 builds are never mapped."""
    env = {**os.environ, vllm_kernels.ENV: "_C_AVX2", "JAX_PLATFORMS": "cpu", "VLLM_PLUGINS": ""}
    proc = subprocess.run([sys.executable, "-c", FORCED.format(repo=REPO)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
