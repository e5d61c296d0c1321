"""tpu_offload.core stays light and at the bottom of the dependency graph.

* Importing every module under it (found with pkgutil, so new subpackages
  such as ``core.fs`` are covered) in a fresh interpreter imports neither
  jax nor torch, nor any third-party package beyond the declared base
  dependencies.
* No module under it imports upward (connector, jax_backend, testing, gpu_offload)
  or an engine, checked on the source (AST), lazy imports included.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import tpu_offload.core

CORE = pathlib.Path(tpu_offload.core.__file__).parent
ROOT = CORE.parents[1]
FORBIDDEN = ("jax", "jaxlib", "torch", "vllm", "tpu_inference", "gpu_offload", "tpu_offload.connector",
             "tpu_offload.jax_backend", "tpu_offload.testing")


def _base_dependencies() -> set[str]:
    """Import names of pyproject's [project] dependencies (numpy, prometheus_client, ...)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = set()
    for d in deps:
        name = d.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower().replace("-", "_"))
    return names


def test_importing_core_stays_light():
    code = textwrap.dedent(
        """
        import importlib, json, pkgutil, sys
        import tpu_offload.core as core
        names = [m.name for m in pkgutil.walk_packages(core.__path__, "tpu_offload.core.")]
        for n in names:
            importlib.import_module(n)
        print(json.dumps({"modules": names, "loaded": sorted(sys.modules), "stdlib": sorted(sys.stdlib_module_names)}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {p.stem for p in CORE.glob("*.py")} - {"__init__"}
    found = {n.split(".")[2] for n in info["modules"]}
    assert expected <= found, f"pkgutil missed {expected - found}"
    loaded = info["loaded"]
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"importing tpu_offload.core pulled in {bad}"
    allowed = _base_dependencies() | set(info["stdlib"]) | {"tpu_offload", "_distutils_hack"}
    third_party = sorted({m.split(".")[0] for m in loaded} - allowed)
    third_party = [m for m in third_party if not m.startswith("_")]  # C accelerators of stdlib/numpy
    assert not third_party, f"core imports undeclared packages: {third_party}"


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """Absolute module names a file imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def test_nothing_in_core_imports_upward():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 8
    bad = []
    for f in files:
        for line, mod in _imports(f):
            if any(mod == x or mod.startswith(x + ".") for x in FORBIDDEN):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
            elif mod.startswith("tpu_offload.") and not mod.startswith("tpu_offload.core") and mod != "tpu_offload.__version__":
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (outside core)")
    assert not bad, "\n".join(bad)


def test_ast_check_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a lazy import inside a function and a relative import are found."""
    probe = tmp_path / "tpu_offload" / "core" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    import torch\n    from ..connector import x\n")
    mods = [m for _, m in _imports(probe, root=tmp_path)]
    assert "torch" in mods and "tpu_offload.connector" in mods
