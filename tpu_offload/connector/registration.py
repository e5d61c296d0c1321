"""Registration: from tpu-inference's runner to one sized, checked TransferEngine.

Apart from the worker because it runs once, before any transfer, and must
refuse before anything is allocated. With several JAX processes every host
decides from every host's figures (``jax_backend/agree.py``), in two rounds
(the sizes, then the checks of the agreed plan), so they all allocate and
compile the same programs or all refuse with one message: a host that raised
alone would leave its peers hanging.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax

from tpu_offload.connector.settings import Settings
from tpu_offload.connector.sizing import check_chunk_bytes
from tpu_offload.core.config import ConfigError
from tpu_offload.jax_backend import agree, direct_dma, engine as engine_mod, memory
from tpu_offload.jax_backend.engine import TransferEngine, plan_transfers
from tpu_offload.jax_backend.layout import KVLayout

log = logging.getLogger(__name__)


def build_engine(s: Settings, runner, pidx: int, choose_path: Callable[..., str], *,
                 free_hbm_bytes: int | None = None, hbm_limit_bytes: int | None = None,
                 free_host_bytes: int | None = None, max_slab_bytes: int | None = None,
                 direct: bool = True) -> TransferEngine:
    """The engine for ``runner``'s caches, agreed by every JAX process (``pidx``: this one).

    ``choose_path(config, local_devices, attention-DP ranks)`` picks the host path (the worker's
    ``transfer_path``), which ``pick_path`` may turn into the direct path (not when ``direct`` is False: the
    fallback after a failed start-up round trip); the byte figures override the allocator's (tests, CPU)."""
    cfg = s.config
    layout, path, plan = _agree(s, plan_locally, s, runner, pidx, choose_path, free_host_bytes, max_slab_bytes,
                                direct, name="sizes")
    plan = _agree(s, check_plan, s, layout, path, plan, pidx, free_hbm_bytes, hbm_limit_bytes, name="checks")
    return TransferEngine(
        layout, num_slots=s.num_slots, blocks_per_chunk=s.blocks_per_chunk,
        staging_blocks=s.staging_blocks, memory_kind=cfg.host_memory_kind,
        checksums=cfg.verify_checksums, path=path, plan=plan,
    )


def pick_path(path: str, cfg, layout: KVLayout, platform: str | None = None) -> str:
    """The host path to run: ``path`` (what ``choose_path`` picked), or the direct kernel's.

    ``transfer_path: direct`` asks for it (refused where it cannot run, with the reason). ``auto`` picks it
    on a TPU wherever it can serve the cache (direct_dma.supported), in one JAX process, and where the
    tier's bytes do not outlive the process: its slabs hold the cache's bytes in the kernel's 4 KiB-tile
    order, not the staging path's, so snapshots and shared files keep the staging path's layout. Off TPU
    nothing changes."""
    platform = platform or layout.mesh.devices.flat[0].platform
    why = direct_dma.supported(layout, platform)
    if cfg.transfer_path == "direct":
        if why is not None:
            raise ConfigError(f"transfer_path='direct' (TPU_OFFLOAD_TRANSFER_PATH) cannot serve this KV cache: {why}. "
                              "Allowed here: 'auto' or 'program'")
        return "direct"
    if cfg.transfer_path != "auto" or path != "program" or platform != "tpu" or why is not None:
        return path
    if cfg.snapshot_path or cfg.shared_storage_path or jax.process_count() > 1:
        return path
    return "direct"


def start_up_round_trip(engine: TransferEngine, runner, rebuild: Callable[[], TransferEngine]) -> TransferEngine:
    """The direct path's bytes checked on the runner's own buffers before it serves (``check_direct``): a
    store then load through the kernel's u8 view, compared bit for bit. If any byte differs, the path is
    dropped loudly and ``rebuild()`` makes the staging path's engine (its host tier freed first)."""
    if engine.path != "direct":
        return engine
    runner.kv_caches, why = engine.check_direct(list(runner.kv_caches))
    if why is None:
        log.info("tpu_offload: direct host path: the start-up round trip through its kernel is bit-exact")
        return engine
    log.error("tpu_offload: %s. The direct host path is OFF in this process; falling back to the staging path "
              "(transfer_path=program). Please report this with the TPU type and libtpu version.", why)
    engine.release()
    return rebuild()


def plan_locally(s: Settings, runner, pidx: int, choose_path, free_host_bytes, max_slab_bytes, direct=True):
    """This host's layout, host path and transfer plan, after every check that needs no plan."""
    cfg = s.config
    classes = layer_classes(s, runner)
    layout = KVLayout.from_caches(runner.kv_caches, getattr(runner, "mesh", None),
                                  head_replicas=s.kv_replicas, kv_groups=classes)
    layout_name = runner.get_kv_cache_layout() if hasattr(runner, "get_kv_cache_layout") else "NHD"
    if layout_name not in (None, "NHD"):
        raise ValueError(f"KV cache layout {layout_name!r}: the offload connector needs NHD")
    local = [d for d in layout.mesh.devices.flat if d.process_index == pidx]
    check_chunk_bytes(s, layout.block_bytes * s.blocks_per_chunk)  # before anything is allocated
    if cfg.shared_storage_path and jax.process_count() > 1:
        raise ConfigError("shared_storage_path with several JAX processes is not supported yet: "
                          "each host holds only its own KV heads")
    local_share = sum(d.process_index == pidx for d in layout.mesh.devices.flat) / layout.mesh.devices.size
    memory.check_memory_kind(cfg.host_memory_kind, local)
    memory.check_host_fits(int(s.num_slots * layout.block_bytes * s.blocks_per_chunk * local_share),
                           s.num_slots, available=free_host_bytes, margin=cfg.host_memory_margin)
    path = choose_path(cfg, local, layout.ranks)
    path = pick_path(path, cfg, layout) if direct else ("program" if path == "direct" else path)
    if path == "direct" and cfg.snapshot_path:
        raise ConfigError("snapshot_path saves the host slabs in the staging path's layout: it needs "
                          "transfer_path 'program' or 'auto' (TPU_OFFLOAD_TRANSFER_PATH), not 'direct'")
    if path == "device_put" and cfg.snapshot_path:
        raise ConfigError("snapshot_path saves the preallocated host slabs: it needs transfer_path=program "
                          f"(TPU_OFFLOAD_TRANSFER_PATH), not {cfg.transfer_path!r} (device_put on {local[0].platform})")
    kw = {} if max_slab_bytes is None else {"max_slab_bytes": max_slab_bytes}
    plan = plan_transfers(layout, num_slots=s.num_slots, blocks_per_chunk=s.blocks_per_chunk,
                          staging_blocks=s.staging_blocks, memory_kind=cfg.host_memory_kind,
                          kernel=None if cfg.transfer_kernel == "auto" else cfg.transfer_kernel, **kw)
    return layout, path, plan


def check_plan(s: Settings, layout, path, plan, pidx: int, free_hbm_bytes, hbm_limit_bytes):
    """The plan's checks (engine.preflight): host buffers, and staging against free HBM on hosts
    whose allocator reports it (CPU reports none). Returns the plan."""
    local = [d for d in layout.mesh.devices.flat if d.process_index == pidx]

    def hbm_check(staging: int, scratch: int) -> None:
        memory.check_staging_fits(staging, scratch, s.staging_blocks, local,
                                  utilization=s.hbm_utilization, free_bytes=free_hbm_bytes,
                                  limit_bytes=hbm_limit_bytes)

    known = free_hbm_bytes is not None or any(memory.device_hbm(d) for d in local)
    engine_mod.preflight(layout, plan, path, s.num_slots, hbm_check if known else None)
    return plan


def layer_classes(s: Settings, runner) -> list[tuple[int, ...]] | None:
    """Per cache array, the layer classes (``LoadOp.groups`` indices) whose blocks it holds.

    Several vLLM KV-cache groups: each group is a class, and an array is in
    every group one of its layers belongs to (vLLM lays out layers of
    different groups in one tensor). Else, in "window" mode, sliding-window
    arrays are class 1. None: one class, every layer moves every block."""
    if s.hybrid:
        index = dict(getattr(runner, "layer_name_to_kvcache_index", None) or {})
        classes: dict[int, set[int]] = {}
        for g, names in enumerate(s.group_layers):
            for name in names:
                if name not in index:
                    raise ValueError(f"KV-cache group {g} layer {name!r} is not among the runner's caches")
                classes.setdefault(int(index[name]), set()).add(g)
        return [tuple(sorted(classes.get(i, ()))) for i in range(len(runner.kv_caches))]
    if s.windows is not None:
        return s.windows.cache_classes(runner, len(runner.kv_caches))
    return None


def _agree(s: Settings, step, *args, name: str):
    """Run ``step`` here and settle its outcome with every JAX process (one process: just run it).

    ``sizes`` returns (layout, path, plan): the plan is re-made with the least slab size of all hosts,
    and the settings every host must share are compared. ``checks`` returns the plan unchanged.
    A host's error (a refusal or any other) becomes every host's, naming that host."""
    if jax.process_count() == 1:
        return step(*args)
    cfg = s.config
    error, cause, figures, out = None, None, {}, None
    try:
        out = step(*args)
    except Exception as e:
        error, cause = f"{type(e).__name__}: {e}", e
    if name == "sizes" and out is not None:
        layout, path, plan = out
        figures = dict(num_slots=s.num_slots, blocks_per_chunk=s.blocks_per_chunk,
                       staging_blocks=plan.staging_blocks, block_bytes=layout.block_bytes, path=path,
                       kernel=plan.programs.kernel, memory_kind=cfg.host_memory_kind,
                       checksums=cfg.verify_checksums, precompile=not cfg.skip_precompile,
                       rows_per_slab=plan.rows_per_slab)
    try:
        agreed = agree.settle(name, figures, error, equal=[k for k in figures if k != "rows_per_slab"],
                              minimum=("rows_per_slab",) if figures else (), timeout_s=cfg.multihost_timeout_s)
    except Exception as e:
        raise e from cause
    if name == "sizes" and agreed["rows_per_slab"] != out[2].rows_per_slab:
        layout, path, plan = out
        log.info("tpu_offload: host slabs of %d chunks (the least any host sizes; here %d)",
                 agreed["rows_per_slab"], plan.rows_per_slab)
        plan = plan_transfers(layout, num_slots=s.num_slots, blocks_per_chunk=s.blocks_per_chunk,
                              staging_blocks=s.staging_blocks, memory_kind=cfg.host_memory_kind,
                              kernel=plan.programs.kernel, rows_per_slab=agreed["rows_per_slab"])
        out = (layout, path, plan)
    return out
