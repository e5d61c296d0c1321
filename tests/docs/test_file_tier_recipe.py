"""The file tier is turned on one way everywhere the docs and configs show it, and that way works.

The secret used to be made three ways in three places (``--from-literal`` with ``/dev/urandom`` in
the overlays, ``head -c 32 ... > secret; chmod 600`` in configs/vllm, a list of three in the
security model): one of them put the secret on a command line. Now every page shows
``tpu-offload-fs make-secret`` and ``kubectl create secret generic ... --from-file``; these tests run
what the README's quick start and the file-tier page say, as written.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tpu_offload.core.config import OffloadConfig
from tpu_offload.core.fs.auth import read_secret_file
from tpu_offload.core.fs.cli import EXIT_USAGE, main as fs_cli

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "configs").rglob("*.md")),
         *sorted((REPO / "configs").rglob("*.yaml"))]
QUICK_STARTS = [REPO / "README.md", REPO / "docs/file-tier/README.md"]
# Other ways to make or pass a secret: each was shown somewhere once.
OTHER_WAYS = re.compile(r"/dev/urandom|openssl rand|--from-literal|chmod 600")
CREATE = re.compile(r"kubectl create secret generic [^\s`]+ --from-[^\s`]+")
CANONICAL_CREATE = "kubectl create secret generic tpu-offload-fs-secret --from-file=secret=fs-secret"


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_the_secret_is_made_one_way():
    other = [f"{_rel(p)}:{i}" for p in PAGES for i, line in enumerate(p.read_text().splitlines(), 1)
             if OTHER_WAYS.search(line)]
    assert not other, f"make the secret with tpu-offload-fs make-secret, pass it with --from-file: {other}"
    creates = {(_rel(p), m.group(0)) for p in PAGES for m in CREATE.finditer(p.read_text())}
    assert creates, "no page shows how to create the Kubernetes Secret"
    assert {c for _, c in creates} == {CANONICAL_CREATE}, sorted(creates)
    for p in QUICK_STARTS:
        text = p.read_text()
        assert "tpu-offload-fs make-secret fs-secret" in text and CANONICAL_CREATE in text, _rel(p)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _quick_start_keys(page: Path) -> dict:
    """The kv_connector_extra_config keys the page's quick start shows, as one JSON object."""
    text = page.read_text()
    for span in [*_code_spans(text), *re.findall(r"```json\n(.*?)```", text, re.S)]:
        if '"shared_storage_path"' in span:
            span = span.strip()
            return json.loads(span if span.startswith("{") else "{" + span + "}")
    pytest.fail(f"{_rel(page)}: no shared_storage_path in a code span")


@pytest.mark.parametrize("page", QUICK_STARTS, ids=_rel)
def test_quick_start_runs_as_written(page, tmp_path, monkeypatch):
    """make-secret writes a secret the tier accepts; the JSON keys make a valid config with that
    secret (and without it the tier refuses to start); the cron's evict command parses."""
    monkeypatch.chdir(tmp_path)
    assert fs_cli(["make-secret", "fs-secret"]) == 0
    read_secret_file(str(tmp_path / "fs-secret"))

    keys = _quick_start_keys(page)
    assert {"shared_storage_path", "fs_secret_file", "fs_capacity_bytes"} <= keys.keys()
    cfg = OffloadConfig.from_sources({**keys, "fs_secret_file": str(tmp_path / "fs-secret")}, {})
    assert cfg.shared_storage_path == keys["shared_storage_path"] and cfg.fs_capacity_bytes > 0

    evict = [s for s in _code_spans(page.read_text()) + page.read_text().splitlines()
             if s.strip().startswith("tpu-offload-fs evict ") and "--budget" in s]
    assert evict, f"{_rel(page)}: no `tpu-offload-fs evict ... --budget` for the cron"
    argv = shlex.split(evict[0].split("#")[0])[1:]
    assert argv[1] == keys["shared_storage_path"], "the cron evicts the directory the replicas share"
    assert argv[argv.index("--secret-file") + 1] == keys["fs_secret_file"], "with the replicas' secret"
    argv[argv.index("--secret-file") + 1] = str(tmp_path / "fs-secret")
    argv[1] = str(tmp_path)  # exists, holds no tier yet: exit 5, not a usage error
    assert fs_cli(argv + ["--dry-run"]) != EXIT_USAGE


def test_budget_is_described_one_way():
    """fs_capacity_bytes is one namespace's budget shared by the replicas writing it, never 'each worker's'."""
    wrong = re.compile(r"fs_capacity_bytes`? is (each|the) (worker|instance|replica|engine)|"
                       r"fs_capacity_bytes`? per (instance|replica|worker)", re.I)
    hits = [f"{_rel(p)}: {m.group(0)}" for p in PAGES for m in wrong.finditer(" ".join(p.read_text().split()))]
    assert not hits, hits
    for p in QUICK_STARTS:
        assert re.search(r"budget of one namespace, shared by every replica", " ".join(p.read_text().split())), _rel(p)
