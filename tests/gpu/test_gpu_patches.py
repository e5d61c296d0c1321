"""Our patches of vLLM's ``OffloadingConnector`` (``gpu_offload.vllm.patches``): put in place when the spec is
built (not at import), once, and refused with one error on a vLLM whose connector no longer matches them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_offload.spec import HostOffloadSpec
from gpu_offload.testing import offloading_config
from gpu_offload.vllm import patches
from gpu_offload.vllm.compat import OffloadingConnector

ROOT = Path(__file__).resolve().parents[2]


def spec():
    return HostOffloadSpec(offloading_config({"num_cpu_chunks": 4}))


def test_importing_the_spec_patches_nothing_building_it_patches_once():
    code = (
        "import gpu_offload.spec, gpu_offload.vllm.spec\n"
        "from gpu_offload.vllm import patches\n"
        "from gpu_offload.vllm.compat import OffloadingConnector as C, offloading_scheduler as S\n"
        "from gpu_offload.testing import offloading_config\n"
        "assert patches.installed() == [], patches.installed()\n"
        "originals = {p.name: getattr(C if p.owner == patches.CONNECTOR else S, p.name) for p in patches.PATCHES}\n"
        "gpu_offload.spec.HostOffloadSpec(offloading_config({'num_cpu_chunks': 4}))\n"
        "first = {p.name: getattr(C if p.owner == patches.CONNECTOR else S, p.name) for p in patches.PATCHES}\n"
        "gpu_offload.spec.HostOffloadSpec(offloading_config({'num_cpu_chunks': 4}))\n"
        "patches.install()\n"
        "again = {p.name: getattr(C if p.owner == patches.CONNECTOR else S, p.name) for p in patches.PATCHES}\n"
        "assert len(patches.installed()) == len(patches.PATCHES), patches.installed()\n"
        "assert again == first, 'installed twice'\n"
        "for p in patches.PATCHES:\n"
        "    if p.kind == 'wrap':\n"
        "        assert first[p.name].__wrapped__ is originals[p.name], p.name  # wraps vLLM's, not ours\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_PLUGINS": ""}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_patches_left_match_this_vllm():
    assert patches.mismatches() == []
    spec()
    assert len(patches.installed()) == len(patches.PATCHES)


def test_a_connector_method_with_another_signature_is_refused_at_start(monkeypatch):
    def get_num_new_matched_tokens(self, request, num_computed_tokens, budget):  # a future vLLM's, say
        return 0, False

    monkeypatch.setattr(OffloadingConnector, "get_num_new_matched_tokens", get_num_new_matched_tokens)
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.99.0")
    with pytest.raises(patches.VllmMismatch) as e:
        spec()
    msg = str(e.value)
    assert "vLLM 0.99.0" in msg and f"supported: vLLM {patches.SUPPORTED_VLLM}" in msg
    assert ("OffloadingConnector.get_num_new_matched_tokens: expected parameters (self, request, "
            "num_computed_tokens), found (self, request, num_computed_tokens, budget)") in msg
    assert msg.count("\n  - ") == 1  # only what differs is named
    assert OffloadingConnector.get_num_new_matched_tokens is get_num_new_matched_tokens  # nothing patched over it


def test_a_method_vllm_now_implements_itself_is_refused(monkeypatch):
    def get_block_ids_with_load_errors(self):  # vLLM's own, not ours
        return set()

    monkeypatch.setattr(OffloadingConnector, "get_block_ids_with_load_errors", get_block_ids_with_load_errors)
    with pytest.raises(patches.VllmMismatch, match=r"get_block_ids_with_load_errors: vLLM now implements it itself"):
        patches.install()


def test_a_missing_method_and_a_missing_attribute_are_named_together(monkeypatch):
    from gpu_offload.vllm import compat

    monkeypatch.delattr(compat.offloading_scheduler, "_create_req_context")
    monkeypatch.setattr(patches, "ATTRIBUTES", (*patches.ATTRIBUTES, ("OffloadingConnectorWorker", "_gone", "a test")))
    bad = patches.mismatches()
    assert bad == ["offloading.scheduler._create_req_context: it is missing",
                   "OffloadingConnectorWorker._gone is missing (read by a test)"]


def test_the_docs_list_every_patch_left_with_its_reason():
    """docs/vllm.md's table: one row per patch, in the same order, each with what it does, why, and since when."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \| (.+?) \| ([\d.]+) \|$", text, re.M)
    assert rows == [(p.title, p.does, p.lacks, p.since) for p in patches.PATCHES]
    assert f"{len(patches.PATCHES)} patches" in text
