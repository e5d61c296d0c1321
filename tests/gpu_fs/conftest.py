"""Fixtures for the file-tier tests (helpers live in ``gpu_fs_helpers``).

Every vLLM engine here runs in its own process (``engine_run.py``): that is
what proves the file tier is shared across processes and survives restarts,
and only one offloading engine may be alive in a process at a time.
"""

from __future__ import annotations

import pytest

from gpu_offload.testing.tiny_model import TinyLlama


@pytest.fixture(scope="session")
def fs_model_dir(tmp_path_factory) -> str:
    return TinyLlama().write(str(tmp_path_factory.mktemp("fs_tiny_llama")))
