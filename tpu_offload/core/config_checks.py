"""What a resolved config leaves without effect, and what it needs installed: checked at an engine's start.

``ignored_settings`` / ``warn_ignored``: each non-default setting the running engine ignores (another
engine's scope, or inert in this configuration: ``inert_settings`` says why), named in one warning.
``check_extras``: an optional package a setting needs (orbax for ``snapshot_path``) is refused at start,
not at its first use. Apart from ``config`` (the table and the parsing) because only engines' start-up
paths and the self-check call these.
"""

from __future__ import annotations

import dataclasses

from tpu_offload.core.config import BOTH, DEFAULTS, SETTINGS, TPU, VLLM, ConfigError, OffloadConfig

_ENGINE_NAMES = {TPU: "the TPU connector (tpu-inference)", VLLM: "vLLM"}
_WARNED: set[str] = set()


def ignored_settings(cfg: OffloadConfig, engine: str) -> list[str]:
    """What the config sets that has no effect on ``engine`` (TPU or VLLM), as ``name=value (where it was
    set)``: each non-default setting of the other engine's scope, each non-default setting this configuration
    leaves without effect (``inert_settings``: with why), and each name only another connector reads."""
    by_field = {s.field: s for s in SETTINGS}
    inert = inert_settings(cfg, engine)
    out = []
    for field, where in cfg.set_by:
        s = by_field[field]
        if getattr(cfg, field) == DEFAULTS[field]:
            continue
        if s.scope in (engine, BOTH) and field not in inert:
            continue
        why = f": {inert[field]}" if s.scope in (engine, BOTH) else ""
        out.append(f"{field}={'<hidden>' if s.secret else getattr(cfg, field)!r} ({where}{why})")
    return out + [text for who, text in cfg.unread if who in (engine, BOTH)]


# Settings that act only through another one: field -> why it does nothing, given the resolved config.
_FILE_TIER = tuple(dict.fromkeys(s.field for s in SETTINGS if s.field.startswith("fs_")))
_PACING = ("transfer_piece_bytes",)  # the budget itself (bandwidth, stall) also bounds what the scheduler sends


def inert_settings(cfg: OffloadConfig, engine: str) -> dict[str, str]:
    """Settings of ``engine``'s scope that this configuration leaves without effect, each with why
    (whether or not they were set: ``ignored_settings`` names those that were)."""
    out: dict[str, str] = {}
    snapshot = engine == TPU and cfg.snapshot_path
    if not cfg.shared_storage_path:
        for f in _FILE_TIER:  # the secret also signs a TPU snapshot
            if not (snapshot and f in ("fs_secret", "fs_secret_file")):
                out[f] = "no file tier: shared_storage_path is unset"
        return out | _inert_engine_settings(cfg)
    if cfg.fs_write_mode == "write_through":
        out["fs_write_back_lag_s"] = "fs_write_mode is write_through: every chunk is queued for its file at once"
    if cfg.fs_encrypt:
        out["fs_mac"] = "fs_encrypt is on: the AES-GCM tag authenticates each chunk"
    elif not cfg.fs_secret:
        out["fs_mac"] = "no secret: chunks are not signed"
    if cfg.fs_secret:
        out["fs_allow_unauthenticated"] = "a secret is set: the file tier is authenticated"
    return out | _inert_engine_settings(cfg)


def _inert_engine_settings(cfg: OffloadConfig) -> dict[str, str]:
    out = {}
    if cfg.load_decision != "auto":
        out["load_decision_bias"] = f"load_decision is {cfg.load_decision}, not auto"
    if cfg.lease_max_fraction == 0:
        out["lease_max_sessions"] = "lease_max_fraction is 0: leases are off"
    if cfg.sliding_window == "all":
        out["window_every_chunks"] = "sliding_window is all: every block moves"
    if cfg.transfer_pacing == "off" or cfg.transfer_path == "device_put":
        why = "transfer_pacing is off" if cfg.transfer_pacing == "off" else "transfer_path device_put is not paced"
        out.update({f: why for f in _PACING})
    out["transfer_inflight_bytes"] = ("the per-step budget (transfer_bandwidth_gbps x transfer_stall_ms / "
                                      "devices_per_chip) alone bounds what a forward waits behind")
    return out


def warn_ignored(cfg: OffloadConfig, engine: str, logger) -> str | None:
    """Log one warning naming every ignored setting (once per process and message); returns it."""
    items = ignored_settings(cfg, engine)
    if not items:
        return None
    msg = (f"{len(items)} setting(s) have no effect with {_ENGINE_NAMES[engine]}: " + "; ".join(items)
           + ". Each setting's scope is in docs/reference/settings.md")
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning("%s", msg)
    return msg


# ---- optional packages ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Need:
    """An optional package a setting needs: its module, what to install, and the setting."""

    module: str
    package: str
    extra: str
    setting: str  # as the user wrote it, e.g. "snapshot_path" or "fs_mac='gmac'"
    field: str  # the OffloadConfig field it comes from

    def describe(self) -> str:
        return f"{self.setting} needs {self.package} (pip install 'tpu-offload[{self.extra}]')"


def needed_packages(cfg: OffloadConfig, engine: str = BOTH) -> list[Need]:
    """What ``cfg`` imports only once serving on ``engine``: orbax at the first TPU snapshot (shutdown),
    cryptography with the first encrypted or GMAC-signed chunk (``OffloadConfig`` already refuses those
    two without it; listed so the self-check reports every package a config relies on)."""
    out = []
    if cfg.snapshot_path and engine in (TPU, BOTH):  # vLLM never saves one (snapshot_path is TPU-only)
        out.append(Need("orbax.checkpoint", "orbax-checkpoint", "tpu", "snapshot_path", "snapshot_path"))
    if cfg.fs_encrypt:
        out.append(Need("cryptography", "cryptography", "fs-encrypt", "fs_encrypt", "fs_encrypt"))
    if cfg.fs_mac == "gmac" and cfg.fs_secret:
        out.append(Need("cryptography", "cryptography", "fs-encrypt", "fs_mac='gmac'", "fs_mac"))
    return out


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, found without importing it (orbax would import JAX)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module stubbed out as None
        return False


def missing_extras(cfg: OffloadConfig, engine: str) -> list[str]:
    """One line per setting of ``cfg`` whose package is not importable here (empty: all there)."""
    where = dict(cfg.set_by)
    return [f"{n.setting}={getattr(cfg, n.field)!r} ({where.get(n.field, 'the default')}) needs {n.package} "
            f"(import {n.module}), which is not installed here: install the [{n.extra}] extra "
            f"(pip install 'tpu-offload[{n.extra}]')"
            for n in needed_packages(cfg, engine) if not installed(n.module)]


def check_extras(cfg: OffloadConfig, engine: str) -> None:
    """Refuse at start, not at the first use (a snapshot is first saved at shutdown)."""
    missing = missing_extras(cfg, engine)
    if missing:
        raise ConfigError("; ".join(missing) + "; allowed: install it, or leave the setting unset")
