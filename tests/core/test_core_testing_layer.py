"""``tpu_offload.testing`` is a layer of its own, and the only way demos and benchmarks reach the engine.

Checked on the source (AST), no module imported:

* nothing in ``tpu_offload`` outside ``tpu_offload.testing`` imports it (``tpu_offload.core``
  is held to that by ``tests/core/test_core_architecture.py`` too);
* no module under ``tpu_offload/testing`` changes ``sys.path``: its modules import each other
  as package modules, so their child processes start with ``python -m``;
* no module under ``benchmarks/`` or ``demos/`` puts a ``tests`` directory on ``sys.path`` or
  imports from ``tests``: what they share with the test suite lives in the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_core_architecture import _imports as imported_modules  # one reader of imports for both checks

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "tpu_offload"
TESTING = PKG / "testing"


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(tree: ast.Module) -> list[tuple[int, ast.AST]]:
    """``(line, what is added)`` for each ``sys.path.insert/append/extend(...)``,
    ``sys.path[...] = ...`` and ``sys.path += ...`` anywhere in the module."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value)
                and node.func.attr in ("insert", "append", "extend")):
            out += [(node.lineno, a) for a in node.args]
        elif isinstance(node, ast.Assign) and any(
                _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in node.targets):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.AugAssign) and _is_sys_path(node.target):
            out.append((node.lineno, node.value))
    return out


def names_tests_dir(expr: ast.AST, assigned: dict[str, ast.AST], seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``expr`` builds a path through a ``tests`` directory: a string part ``tests``
    (``ROOT / "tests" / ...``, ``"tests/tpu_engine"``), directly or through a module-level name."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "tests" in node.value.replace("\\", "/").split("/"):
                return True
        elif isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
            if names_tests_dir(assigned[node.id], assigned, seen | {node.id}):
                return True
    return False


def reaches_into_tests(source: str, filename: str = "<source>") -> list[str]:
    """Each place a module puts a ``tests`` directory on ``sys.path`` or imports from ``tests``."""
    tree = ast.parse(source, filename=filename)
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    bad = [f"{filename}:{line} puts a tests directory on sys.path"
           for line, expr in sys_path_edits(tree) if names_tests_dir(expr, assigned)]
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        bad += [f"{filename}:{node.lineno} imports {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return bad


def test_nothing_in_tpu_offload_outside_testing_imports_it():
    files = [f for f in sorted(PKG.rglob("*.py")) if TESTING not in f.parents]
    assert len(files) >= 20
    bad = [f"{f.relative_to(REPO)}:{line} imports {mod}" for f in files for line, mod in imported_modules(f)
           if mod == "tpu_offload.testing" or mod.startswith("tpu_offload.testing.")]
    assert not bad, "\n".join(bad)


def test_testing_modules_import_each_other_as_package_modules():
    files = sorted(TESTING.glob("*.py"))
    assert {"cpu_support.py", "engine_run.py", "serve.py", "registry_child.py"} <= {f.name for f in files}
    siblings = {f.stem for f in files} - {"__init__"}
    bad = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        bad += [f"{f.name}:{line} changes sys.path" for line, _ in sys_path_edits(tree)]
        bad += [f"{f.name}:{line} imports {mod} by its bare name" for line, mod in imported_modules(f)
                if mod.split(".")[0] in siblings]
    assert not bad, "\n".join(bad)


def test_benchmarks_and_demos_reach_no_tests_directory():
    files = sorted(p for d in ("benchmarks", "demos") for p in (REPO / d).rglob("*.py"))
    assert any(f.name == "tpu_inference_demo.py" for f in files) and len(files) >= 20
    bad = [b for f in files for b in reaches_into_tests(f.read_text(), str(f.relative_to(REPO)))]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_each_way_into_tests():
    """The checker itself: what benchmarks and the demo used to write is found, the package import is not."""
    found = reaches_into_tests(
        'import os, sys\nfrom pathlib import Path\nROOT = Path(__file__).resolve().parents[1]\n'
        'sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "tpu_engine")]\n'
        'sys.path.insert(0, os.path.join(ROOT, "tests", "tpu_engine"))\n'
        'HELPERS = ROOT / "tests"\nsys.path.append(str(HELPERS))\n'
        'sys.path += ["tests/tpu_engine"]\n'
        'from tests.tpu_engine import cpu_support\n')
    assert sorted(int(b.split(" ", 1)[0].split(":")[1]) for b in found) == [4, 5, 7, 8, 9]
    assert reaches_into_tests('import sys\nfrom pathlib import Path\nROOT = Path(__file__).resolve().parents[1]\n'
                              'sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]\n'
                              'from tpu_offload.testing import cpu_support\n') == []
