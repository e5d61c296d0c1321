"""Exit codes quoted in the hand-written docs are the ones the commands return.

Scripts and probes branch on them, so a page that lists 0-4 while the command returns 0-6 is
a wrong page. ``tpu-offload-fs``'s codes come from its ``EXIT_*`` constants; the self-check's
from the generated reference page (test_reference_pages keeps that page equal to the code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpu_offload.core.fs import cli

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if p.parent.name != "reference")]
# Which command a page's exit codes belong to.
TOOL_OF_PAGE = {
    "docs/file-tier/README.md": "tpu-offload-fs",
    "docs/file-tier/cli.md": "tpu-offload-fs",
    "docs/file-tier-security.md": "tpu-offload-fs",
    "docs/tpu/enable.md": "selfcheck",
}
# "Exit codes: 0 ok, 1 ...": the list runs to the end of its sentence or paragraph.
LIST = re.compile(r"\bExit (?:codes|status)\b(.+?)(?:\.\s|\n\n|\Z)", re.S)
CODE_IN_LIST = re.compile(r"(?:^|[\s(:;,])`?(\d)`?(?=[\s,;:)])")
# "(exit 2)", "exits 6", "the exit code is 1".
MENTION = re.compile(r"\bexit(?:s| code is| code| status)? `?(\d+)`?", re.I)


def codes(tool: str) -> set[int]:
    if tool == "tpu-offload-fs":
        return {getattr(cli, n) for n in dir(cli) if n.startswith("EXIT_")}
    page = (REPO / "docs/reference/cli.md").read_text()
    section = page[page.index(f"\n## {tool}"):]
    table = section[section.index("### Exit codes"):]
    return {int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)}


def rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def test_the_codes_are_read():
    assert codes("tpu-offload-fs") == set(range(7))
    assert {0, 1, 2} <= codes("selfcheck")


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_exit_code_lists_name_every_code_and_no_other(page):
    lists = [m.group(1) for m in LIST.finditer(page.read_text())]
    if not lists:
        return
    tool = TOOL_OF_PAGE.get(rel(page))
    assert tool, f"{rel(page)} lists exit codes: add it to TOOL_OF_PAGE with the command they belong to"
    for text in lists:
        quoted = {int(c) for c in CODE_IN_LIST.findall(text)}
        assert quoted == codes(tool), f"{rel(page)}: {tool} exits {sorted(codes(tool))}, the page lists " \
                                      f"{sorted(quoted)}: {' '.join(text.split())[:200]}"


@pytest.mark.parametrize("page", sorted(TOOL_OF_PAGE), ids=str)
def test_exit_codes_mentioned_in_passing_exist(page):
    tool = TOOL_OF_PAGE[page]
    said = {int(c) for c in MENTION.findall((REPO / page).read_text())}
    assert said <= codes(tool), f"{page}: {tool} has no exit code {sorted(said - codes(tool))}"

