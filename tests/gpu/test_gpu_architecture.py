"""gpu_offload's layers, checked on the source (no imports executed).

* No import cycle inside ``gpu_offload`` (function-level imports count too:
  a lazy import is still a dependency).
* ``torch_backend`` imports neither vLLM nor the adapter nor the test helpers.
* ``vllm.compat`` is a leaf: nothing of ours.
* Nothing but ``gpu_offload.testing`` and the demo imports ``gpu_offload.testing``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gpu_offload"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (absolute names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    g = {}
    for mod, path in files.items():
        deps = set()
        for name in imports_of(path):
            # "from gpu_offload.vllm import metrics" names a module; "from x import func" names x
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod and name.startswith("gpu_offload"):
                deps.add(name)
        g[mod] = deps
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layers_import_only_downward():
    g = graph()
    for mod in g:
        if mod.startswith("gpu_offload.torch_backend"):
            raw = imports_of(PKG.parent / (mod.replace(".", "/") + ".py")) if not mod.endswith("backend") else set()
            assert not {n for n in raw if n == "vllm" or n.startswith("vllm.")}, f"{mod} imports vLLM"
            assert not {d for d in g[mod] if d.startswith(("gpu_offload.vllm", "gpu_offload.testing"))}, mod
        if not mod.startswith("gpu_offload.testing") and mod != "gpu_offload.demo":
            assert not {d for d in g[mod] if d.startswith("gpu_offload.testing")}, f"{mod} imports test helpers"
    assert g["gpu_offload.vllm.compat"] == set(), "the compat layer must be a leaf"
    assert g["gpu_offload.spec"] == {"gpu_offload.vllm.spec"}  # the configured spec_module_path
