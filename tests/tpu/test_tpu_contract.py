"""Contract with tpu-inference 0.32.0, checked against its installed source.

tpu-inference's runner cannot be imported here (its model stack needs newer
Python and packages), so its source is parsed instead: every runner member
our worker touches must exist on ``TPUModelRunner``, the runner must hand
itself to the connector with ``register_runner``, and our class name must be
on the platform's allowlist.
"""

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.find_spec("tpu_inference")
if SPEC is None:
    pytest.skip("tpu-inference sources not installed (pip install --no-deps tpu-inference==0.32.0)",
                allow_module_level=True)
TPU_INF = Path(SPEC.origin).parent


def _class(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _runner_members():
    tree = ast.parse((TPU_INF / "runner" / "tpu_runner.py").read_text())
    cls = _class(tree, "TPUModelRunner")
    members = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    members.add(el.attr)
    return tree, members


def _runner_uses_in_our_code():
    """Attributes our connector reads from the runner object."""
    used = set()
    for path in (REPO / "tpu_offload" / "connector").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                if (isinstance(v, ast.Name) and v.id == "runner") or (
                        isinstance(v, ast.Attribute) and v.attr == "runner"):
                    used.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                a = node.args
                if len(a) >= 2 and isinstance(a[0], ast.Name) and a[0].id == "runner" and isinstance(a[1], ast.Constant):
                    used.add(a[1].value)
    return used


def test_runner_has_everything_we_use():
    _, members = _runner_members()
    used = _runner_uses_in_our_code()
    assert {"kv_caches", "mesh"} <= used  # sanity: the scan sees our accesses
    missing = used - members
    assert not missing, f"TPUModelRunner 0.32.0 has no {sorted(missing)}"


def test_runner_registers_itself_and_rebinds_kv_caches():
    tree, _ = _runner_members()
    src = (TPU_INF / "runner" / "tpu_runner.py").read_text()
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "register_runner"]
    assert calls and all(isinstance(c.args[0], ast.Name) and c.args[0].id == "self" for c in calls)
    assert "register_kv_caches" not in src  # never called on TPU
    # The forward rebinds the caches every step, inside vLLM's connector lifecycle.
    assert re.search(r"maybe_get_kv_connector_output\(\s*scheduler_output\)", src)
    assert re.search(r"\(self\.kv_caches,\s*hidden_states", src)


def test_class_name_on_platform_allowlist():
    tree = ast.parse((TPU_INF / "platforms" / "tpu_platform.py").read_text())
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "allowed" for t in node.targets):
            allowed |= {e.value for e in node.value.elts}
    from tpu_offload.connector import TPUOffloadConnector

    assert TPUOffloadConnector.__name__ in allowed, allowed
    from tpu_offload.connector.compat import TPU_INFERENCE_CONNECTOR_NAMES

    assert set(TPU_INFERENCE_CONNECTOR_NAMES) == allowed


def test_layout_handshake_is_nhd():
    src = (TPU_INF / "runner" / "kv_cache_manager.py").read_text()
    assert 'DEFAULT_KV_CACHE_LAYOUT = "NHD"' in src
    from types import SimpleNamespace

    from tpu_offload.connector import TPUOffloadConnector

    assert TPUOffloadConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=False))) == "NHD"
    assert TPUOffloadConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=True))) is None


def test_staging_hbm_is_reserved_only_for_the_builtin_module_path():
    """Why we check HBM ourselves: the worker's reservation is keyed on
    tpu-inference's own module path, which ours is not."""
    src = (TPU_INF / "worker" / "tpu_worker.py").read_text()
    assert '== "tpu_inference.offload.tpu_offload_connector"' in src
    for cfg in (REPO / "configs" / "tpu-inference").glob("*.json"):
        assert json.loads(cfg.read_text())["kv_connector_module_path"] == "tpu_offload.connector"


def test_kv_cache_is_block_major_with_heads_sharded():
    """Our layout code assumes dim 0 is the block and heads are sharded after it."""
    src = (TPU_INF / "runner" / "kv_cache.py").read_text()
    assert "(num_blocks, block_size, cdiv(num_kv_heads * 2, packing), packing, head_dim)" in src
    assert re.search(r"PartitionSpec\(ShardingAxisName\.BATCH, ShardingAxisName\.KV_CONTEXT,\s*ShardingAxisName\.KV_HEAD\)", src)
