"""The self-check's checks that need neither tpu-inference nor JAX: what ``selfcheck --offline`` runs.

A config should be linted where it is written (a laptop, CI) before it reaches
a TPU host. Importing tpu-inference there polls the GCE metadata server for
~20 s and needs vLLM's platform resolved; JAX may not be installed at all. So
this module reads only the config and the deployment's shape (model, TP, chip)
and computes what the connector will at start: the host tier, staging, the
per-step budgets and the HBM staging takes, from the same functions the
connector sizes itself with (``OffloadConfig``, ``connector/budget.py``,
``connector/shapes.py``, ``core/hostmem.py``), and
finds the optional packages the config needs in this environment. The checks
on live devices (memory kinds, compile, round trip) stay in ``selfcheck.py``.

Each check records one line for the quiet summary and its figures for ``-v``
and the JSON report.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import tempfile
import types
from typing import Any

from tpu_offload.connector import budget, shapes
from tpu_offload.core import hostmem, step_budget
from tpu_offload.core.config import TPU, ConfigError, OffloadConfig
from tpu_offload.core.config_checks import installed, needed_packages

GIB = 1 << 30
MIB = 1 << 20
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization when none is given


# ---- dependencies ----------------------------------------------------------------
SECRET_FILE_KEY, SECRET_FILE_ENV = "fs_secret_file", "TPU_OFFLOAD_FS_SECRET_FILE"


def resolve_config(extra: dict, env, *, stand_in_secret: bool = False, notes: list | None = None
                   ) -> tuple[OffloadConfig | None, str | None]:
    """(config, None), or (None, the reason) when the config is refused only because a package it needs
    is missing here: that is a verdict on this environment (exit 1), not bad input (exit 2).
    ``OffloadConfig`` itself refuses ``fs_encrypt``/``fs_mac='gmac'`` without cryptography.

    ``stand_in_secret`` (offline): an ``fs_secret_file`` that does not exist on this machine (it is
    mounted on the serving host) is replaced by a stand-in secret for the rest of the checks, and
    ``notes`` says so; a file that exists is read as the connector would read it."""
    with _stand_in_secret(extra, env, notes if stand_in_secret else None) as (extra, env):
        try:
            return OffloadConfig.from_sources(extra, env), None
        except ConfigError as e:
            if "'cryptography' package" in str(e) and not installed("cryptography"):
                return None, str(e)
            raise


@contextlib.contextmanager
def _stand_in_secret(extra: dict, env, notes: list | None):
    path = extra.get(SECRET_FILE_KEY) if SECRET_FILE_KEY in extra else env.get(SECRET_FILE_ENV)
    if notes is None or not isinstance(path, str) or not path or os.path.lexists(path):
        yield extra, env
        return
    with tempfile.TemporaryDirectory() as d:
        stand_in = os.path.join(d, "secret")
        fd = os.open(stand_in, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64encode(os.urandom(32)))
        notes.append(f"config: fs_secret_file {path!r} is not on this machine; checked with a stand-in secret "
                     "(the serving host reads its own at start)")
        if SECRET_FILE_KEY in extra:
            yield {**extra, SECRET_FILE_KEY: stand_in}, env
        else:
            yield extra, {**env, SECRET_FILE_ENV: stand_in}


def check_config(rep, cfg: OffloadConfig, ignored: list[str]) -> None:
    sources = dict(cfg.set_by)
    from_env = sum(v.startswith("environment") for v in sources.values())
    line = (f"{len(sources)} setting(s) resolved ({len(sources) - from_env} from kv_connector_extra_config, "
            f"{from_env} from TPU_OFFLOAD_* variables)")
    if ignored:
        line += f"; {len(ignored)} have no effect on tpu-inference (listed below)"
        rep.warnings.extend(f"config: no effect on tpu-inference: {x}" for x in ignored)
    rep.check("config", "pass", line=line, set_by=sources, ignored=ignored)


def check_dependencies(rep, cfg: OffloadConfig | None, refused: str | None = None) -> None:
    if refused is not None:
        rep.fail("dependencies", refused, line=refused)
        return
    needs = needed_packages(cfg, TPU)
    missing = [n for n in needs if not installed(n.module)]
    fields = dict(needed=[dataclasses.asdict(n) for n in needs], missing=[n.package for n in missing])
    if missing:
        reason = "; ".join(f"{n.describe()}, which is not installed here" for n in missing)
        rep.fail("dependencies", reason, line=reason, **fields)
        return
    line = ("installed: " + ", ".join(sorted({f"{n.package} ({n.setting})" for n in needs}))) if needs \
        else "none needed"
    rep.check("dependencies", "pass", line=line, **fields)


# ---- the deployment's shape ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: HBM per chip and the JAX devices each chip shows (tpu-info's device table)."""

    name: str  # as topologies name it (the device kind our budgets match on)
    hbm_gib: int

    @property
    def devices_per_chip(self) -> int:
        return budget.devices_per_chip(self.name)

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_gib * GIB // self.devices_per_chip


CHIPS = {c.name.lower(): c for c in (Chip("TPU7x", 192), Chip("v6e", 32), Chip("v5e", 16), Chip("v5p", 95),
                                     Chip("v4", 32))}


def parse_topology(name: str) -> tuple[Chip, int]:
    """(chip, devices) of a topology name such as ``TPU7x:2x2x1`` (chips along each axis), without libtpu."""
    kind, _, dims = name.partition(":")
    chip = CHIPS.get(kind.strip().lower())
    try:
        chips = 1
        for d in dims.split("x"):
            chips *= int(d)
        ok = chip is not None and chips >= 1
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"--topology: value {name!r} is not allowed; allowed: <chip>:<chips per axis>, e.g. "
                          f"TPU7x:2x2x1, v6e:2x4, v5e:2x2 (chips: {', '.join(c.name for c in CHIPS.values())})")
    return chip, chips * chip.devices_per_chip


def model_shape(args) -> shapes.ModelShape | None:
    """``--model``, or the custom shape of ``--layers/--kv-heads/--head-dim/--dtype``; None: neither given."""
    custom = (args.layers, args.kv_heads, args.head_dim)
    if args.model is not None:
        if any(v is not None for v in custom):
            raise ConfigError("--model and --layers/--kv-heads/--head-dim both give the model; allowed: one of them")
        if args.model not in shapes.MODELS:
            raise ConfigError(f"--model: value {args.model!r} is not allowed; allowed: {', '.join(shapes.MODELS)}, "
                              "or --layers/--kv-heads/--head-dim")
        return shapes.MODELS[args.model]
    if all(v is None for v in custom):
        return None
    if any(v is None for v in custom):
        raise ConfigError("--model or all of --layers/--kv-heads/--head-dim is required; models: "
                          + ", ".join(shapes.MODELS))
    if args.dtype not in shapes.DTYPE_BYTES:
        raise ConfigError(f"--dtype: value {args.dtype!r} is not allowed; allowed: {', '.join(shapes.DTYPE_BYTES)}")
    return shapes.ModelShape("custom", args.layers, args.kv_heads, args.head_dim, args.dtype)


# ---- sizing ----------------------------------------------------------------------------
def staged_blocks(cfg: OffloadConfig, bpc: int) -> int:
    """Staging in whole chunks, as ``connector/settings.resolve`` sizes it."""
    if cfg.staging_blocks < bpc:
        raise ConfigError(f"staging_blocks={cfg.staging_blocks} cannot hold one chunk of {bpc} blocks; raise "
                          f"staging_blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS) to at least {bpc} or lower "
                          "blocks_per_chunk")
    return cfg.staging_blocks // bpc * bpc


def tpu_path(cfg: OffloadConfig, model: shapes.ModelShape, sizes) -> str:
    """The host path a TPU host runs for this deployment, as ``registration.pick_path`` picks it there
    (without JAX): the direct kernel where every block is whole on its devices (no replicated KV heads,
    no MLA copies), a device's block is whole 4 KiB tiles and the tier's bytes do not outlive the process;
    else the staging path. Offline cannot see the process count: a multi-host deployment runs ``program``."""
    if cfg.transfer_path in ("device_put", "program", "direct"):
        return cfg.transfer_path
    direct = (sizes.kv_replicas == 1 and not model.use_mla and sizes.device_block_bytes % 4096 == 0
              and not cfg.snapshot_path and not cfg.shared_storage_path)
    return "direct" if direct else "program"


def size(cfg: OffloadConfig, model: shapes.ModelShape, tp: int, block_size: int, chip: Chip | None) -> dict:
    """Every figure the connector computes at start for this deployment, per device where it says so."""
    try:
        sizes = shapes.cache_sizes(model, tp, block_size)
    except ValueError as e:
        raise ConfigError(f"--tp: value {tp} is not allowed: {e}") from None
    bpc = cfg.resolve_blocks_per_chunk(block_size)
    chunk = sizes.block_bytes * bpc
    num_slots = cfg.resolve_num_chunks(chunk)
    staging = staged_blocks(cfg, bpc)
    path = tpu_path(cfg, model, sizes)
    staging_bytes = staging * sizes.device_block_bytes
    # the per-step budget counts each device's share of a chunk's distinct bytes (settings.resolve)
    engine = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=model.use_mla),
                                   parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))
    step_block = budget.device_block_bytes(chunk, bpc, budget.chunk_devices(engine, sizes.kv_replicas))
    step_blocks = step_budget.blocks(cfg.step_budget_bytes, step_block, bpc, staging)
    kind = chip.name if chip else ""
    return dict(model=dataclasses.asdict(model), tp=tp, block_size=block_size, chip=chip.name if chip else None,
                cache_block_shape=list(sizes.shape), kv_head_replicas=sizes.kv_replicas,
                block_bytes=sizes.block_bytes, device_block_bytes=sizes.device_block_bytes,
                blocks_per_chunk=bpc, chunk_bytes=chunk, num_slots=num_slots, tier_bytes=num_slots * chunk,
                staging_blocks=staging, staging_device_bytes=staging_bytes, path=path,
                in_flight_device_bytes=staging_bytes if path == "device_put" else 0,
                step_budget_bytes=cfg.step_budget_bytes, step_block_bytes=step_block, step_blocks=step_blocks,
                devices_per_chip=cfg.devices_per_chip,
                chip_devices_per_chip=budget.devices_per_chip(kind) if chip else None)


def check_sizing(rep, s: dict) -> None:
    line = (f"{s['model']['name']} at TP {s['tp']}: {s['block_bytes'] / MIB:.1f} MiB per block "
            f"({s['device_block_bytes'] / MIB:.2f} MiB per device); host tier {s['tier_bytes'] / GIB:.2f} GiB "
            f"= {s['num_slots']} chunks of {s['blocks_per_chunk']} block(s); staging {s['staging_blocks']} blocks "
            f"= {s['staging_device_bytes'] / GIB:.2f} GiB per device")
    rep.check("sizing", "pass", line=line, **s)


def check_budgets(rep, s: dict, pacing: bool) -> None:
    """The per-step budget (core/step_budget.py): blocks of loads and of stores the scheduler sends per step,
    and (when paced) what the worker sends after each forward; the line says so when the chip's devices per
    chip differ from ``devices_per_chip`` (the budget per device is then off by that ratio)."""
    line = (f"per step and direction {s['step_budget_bytes'] / 1e6:.0f} MB per device = {s['step_blocks']} "
            f"blocks ({s['step_block_bytes'] / MIB:.2f} MiB each)")
    unpaced = ("the direct path: one kernel call per slab" if s.get("path") == "direct" else
               "transfer_pacing 'off', or the device_put path")
    line += ("; host copies paced in pieces after the forward" if pacing else
             f"; host copies not paced ({unpaced}): each step's at once, within the budget")
    fields = dict(step_budget_bytes=s["step_budget_bytes"], step_blocks=s["step_blocks"], paced=pacing,
                  devices_per_chip=s["devices_per_chip"])
    chip_n = s.get("chip_devices_per_chip")
    if chip_n is not None and chip_n != s["devices_per_chip"]:
        line += (f"; devices_per_chip={s['devices_per_chip']}, but {s['chip']} has {chip_n} devices per chip: "
                 f"set devices_per_chip to {chip_n} for its budget")
    rep.check("budgets", "pass", line=line, **fields)


def check_hbm(rep, s: dict, chip: Chip | None, utilization: float | None) -> None:
    """Staging and what the path holds in flight within the HBM the KV cache leaves free (the live check adds
    the compiled programs' scratch, which needs the compiler)."""
    if chip is None:
        rep.check("hbm", "skipped", line="no chip to size against (give --topology, e.g. TPU7x:2x2x1)")
        return
    hbm = chip.hbm_bytes_per_device
    need = s["staging_device_bytes"] + s["in_flight_device_bytes"]
    util = utilization if utilization is not None else VLLM_DEFAULT_UTILIZATION
    free = int(hbm * (1 - util))
    at = f"--gpu-memory-utilization {util:g}" + ("" if utilization is not None else " (vLLM's default)")
    most = round(1 - need / hbm, 3)
    fields = dict(hbm_bytes_per_device=hbm, need_bytes=need, free_bytes=free, utilization=util,
                  max_utilization=most)
    text = (f"staging {s['staging_device_bytes'] / GIB:.2f} GiB + in flight {s['in_flight_device_bytes'] / GIB:.2f} "
            f"GiB per device, {free / GIB:.2f} GiB left free of {chip.name}'s {hbm / GIB:.0f} GiB per device at {at}")
    if need > free:
        reason = f"{text}: they do not fit; use --gpu-memory-utilization {most} or lower, or fewer staging_blocks"
        rep.fail("hbm", reason, line=reason, **fields)
        return
    rep.check("hbm", "pass", line=f"{text}; transfer scratch not counted offline", **fields)


def check_host_memory(rep, cfg: OffloadConfig, s: dict, host_bytes: int | None) -> None:
    """The tier against a host of ``host_bytes`` (``--host-memory``) less ``host_memory_margin``; skipped
    without one: this machine's RAM says nothing about the serving host's."""
    if host_bytes is None:
        rep.check("host", "skipped", line=f"tier {s['tier_bytes'] / GIB:.2f} GiB; give --host-memory (the serving "
                  "host's or pod's memory, e.g. 944GiB) to check it fits")
        return
    host = hostmem.HostMemory(mem_total=host_bytes, mem_available=host_bytes)
    budget_bytes = hostmem.host_tier_budget(host, cfg.host_memory_margin)
    fields = dict(host_bytes=host_bytes, margin=cfg.host_memory_margin, budget=budget_bytes,
                  tier_bytes=s["tier_bytes"], num_slots=s["num_slots"])
    try:
        hostmem.check_host_fits(s["tier_bytes"], s["num_slots"], margin=cfg.host_memory_margin, host=host,
                                where="on the serving host")
    except ConfigError as e:
        rep.fail("host", str(e), line=str(e), **fields)
        return
    rep.check("host", "pass", line=f"tier {s['tier_bytes'] / GIB:.2f} GiB of the {budget_bytes / GIB:.2f} GiB a "
              f"{host_bytes / GIB:.0f} GiB host allows (host_memory_margin {cfg.host_memory_margin})", **fields)


def parse_size(flag: str, value: str) -> int:
    """A byte size for a flag, read as the config reads ``cpu_bytes`` (one definition of the units)."""
    try:
        n = OffloadConfig.from_sources({"cpu_bytes": value}, {}).cpu_bytes
    except ConfigError:
        n = None
    if not n:
        raise ConfigError(f"{flag}: value {value!r} is not allowed; allowed: a size such as 944GiB or 1TiB")
    return n


def run_offline(rep, cfg: OffloadConfig, args, skip: set[str]) -> dict[str, Any] | None:
    """Sizing, budgets, HBM and host RAM for ``--model``/``--tp`` (skipped without a model)."""
    model = model_shape(args)
    chip, devices = parse_topology(args.topology) if args.topology else (None, None)
    host_bytes = parse_size("--host-memory", args.host_memory) if args.host_memory else None
    if model is None:
        for name in ("sizing", "budgets", "hbm", "host"):
            rep.check(name, "skipped", line="give --model (or --layers/--kv-heads/--head-dim) and --tp to size")
        return None
    tp = args.tp or devices or 1
    if devices is not None and tp > devices:
        raise ConfigError(f"--tp: value {tp} is not allowed; allowed: at most the {devices} devices of {args.topology}")
    s = size(cfg, model, tp, args.block_size, chip)
    pacing = s["path"] == "program" and cfg.transfer_pacing in ("on", "auto")  # as worker.register_runner
    if "sizing" not in skip:
        check_sizing(rep, s)
    if "budgets" not in skip:
        check_budgets(rep, s, pacing)
    if "hbm" not in skip:
        check_hbm(rep, s, chip, args.gpu_memory_utilization)
    if "host" not in skip:
        check_host_memory(rep, cfg, s, host_bytes)
    return s
