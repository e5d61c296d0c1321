"""Fixtures for the file-tier tests: tiers on the real disk."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from prometheus_client import CollectorRegistry

# The repo root, so a plain `pytest` finds the package without an install.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from fs_helpers import CHUNK, layout  # noqa: E402
from tpu_offload.core.fs import FileTier  # noqa: E402
from tpu_offload.core.fs.metrics import FsMetrics  # noqa: E402


@pytest.fixture
def fp():
    return layout()


@pytest.fixture
def root():
    """A directory on the real disk (not tmpfs), removed afterwards."""
    d = tempfile.mkdtemp(prefix="fs-tier-test-", dir="/var/tmp")
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture
def make_tier(fp):
    made = []

    def make(root, *, fingerprint=None, chunk_bytes=CHUNK, capacity_bytes=None, **kw):
        if kw.get("metrics") is None and kw.get("fs_metrics") is None:
            kw["fs_metrics"] = FsMetrics(CollectorRegistry())
        t = FileTier(root, fingerprint or fp, chunk_bytes, capacity_bytes=capacity_bytes, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=10)
