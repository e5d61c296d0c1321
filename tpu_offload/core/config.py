"""One typed config per deployment, from ``kv_connector_extra_config`` and env.

Precedence: ``kv_connector_extra_config`` > ``TPU_OFFLOAD_*`` env > defaults,
so the llm-d overlays' environment works unchanged and a JSON key overrides
it. Every bad value, unknown key and contradiction raises one ``ConfigError``
naming the key, the value and what is allowed (with a "did you mean").

Each setting declares its scope (TPU, VLLM or BOTH) and its meaning in
``SETTINGS`` (``settings.py``); docs/reference/settings.md is generated from that table
(``make docs``). A non-default setting the running engine ignores, or that
this configuration leaves without effect (a file-tier setting without
``shared_storage_path``), is named in one warning at start
(``warn_ignored``), with why. Sizes take explicit units only (``720GiB`` or
``720GB``): a bare ``720G`` means GiB to dd and GB to Kubernetes.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping

from tpu_offload.core import step_budget
from tpu_offload.core.config_values import (  # noqa: F401  (_bytes: tests' size parser; parse_*: the CLI's)
    _bool,
    _bytes,
    parse_number,
    parse_size,
)


class ConfigError(ValueError):
    pass


from tpu_offload.core.settings import (  # noqa: F401  (the table's names, as config's: one import for callers)
    BOTH,
    ENGINE_KEYS,
    SETTINGS,
    TPU,
    UPSTREAM_ENV,
    VLLM,
    VLLM_KEYS_IGNORED,
    VLLM_KEYS_READ,
    _SECRET_KEYS,
)

_BY_KEY = {k: s for s in SETTINGS for k in s.keys}
_BY_ENV = {e: s for s in SETTINGS for e in ((s.env,) if s.env else ()) + s.env_aliases}
_SIZE_FIELDS = ("num_cpu_chunks", "cpu_bytes")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Resolved settings. Sizes in chunks or bytes; the engine picks the unit."""

    num_cpu_chunks: int | None = None
    cpu_bytes: int | None = None
    blocks_per_chunk: int = 1
    chunk_tokens: int | None = None
    staging_blocks: int = 128
    # The per-step byte budget (core/step_budget.py), per device and direction: transfer_bandwidth_gbps (GB/s
    # of one chip's host link) x transfer_stall_ms / devices_per_chip. The scheduler emits at most that many
    # bytes of loads and of stores per step (the rest is deferred, never dropped); the worker's pacer sends
    # at most that per step after the forward, in pieces of at most transfer_piece_bytes. Default bandwidth:
    # tpu-sync's RAW_TRANSFER, ~152 GB/s per 8-device (4-chip) TPU7x VM fragmented (~190 contiguous), 38 GB/s
    # per chip; TPU7x has two devices per chip. load_bandwidth_gbps / load_stall_ms are other names.
    transfer_bandwidth_gbps: float = 38.0
    transfer_stall_ms: float = 20.0
    devices_per_chip: int = 2
    transfer_piece_bytes: int = 16 << 20
    transfer_inflight_bytes: int = 64 << 20  # ignored (inert_settings says why)
    # "auto": pace on TPU (the program path, one attention-DP rank, one JAX process); "on" anywhere that
    # applies (tests); "off": every host copy of a step at once (the scheduler's budget still applies).
    transfer_pacing: str = "auto"
    decode_save: bool = False
    # write_through: every computed chunk goes to the host tier at once. exclusive: a chunk the device's
    # prefix cache still holds is not copied; it is copied when vLLM reuses its block (core/policy.py).
    store_policy: str = "write_through"
    sync_load: bool = False
    host_memory_kind: str = "pinned_host"
    # Host memory the tier must leave for the engine and the rest of the host: a fraction
    # (float) of the host's memory (or its cgroup limit, if smaller), or bytes (int).
    host_memory_margin: int | float = 0.05
    # TPU host path: "program" (preallocated slabs written in place by compiled programs; every program a
    # pass runs scales with what it moves), "device_put" (opt-in: one host array per stored chunk and device,
    # and two programs over the whole staging buffer every pass), "auto" (program)
    transfer_path: str = "auto"
    # How gather/scatter move blocks: "dma" (a Pallas kernel of DMAs, no TensorCore loop over blocks; on CPU
    # it runs in TPU interpret mode), "loop" (XLA ops, one block per trip), "xla" (one XLA gather/scatter per
    # layer over a bucket of the pass's size: for GPUs), "auto" (dma on TPU, xla on GPU, loop elsewhere)
    transfer_kernel: str = "auto"
    # Sliding-window layers: "window" stores and loads only the blocks a later request can attend to (the
    # window before a prefix's end); "all" moves every block; "auto": "window" where that is safe (see
    # connector/windows.py), else "all".
    sliding_window: str = "auto"
    # "window" mode: also keep the window before every N-th chunk boundary of a prompt, so a request
    # sharing only part of it (a system prompt) can still hit there. 0: only at the end of each step's stores.
    window_every_chunks: int = 0
    skip_precompile: bool = False
    # Several JAX processes: how long registration waits for every host's start-up figures
    # (jax_backend/agree.py) before it fails naming the hosts that sent none.
    multihost_timeout_s: float = 300.0
    enable_events: bool = True
    verify_checksums: bool = False  # per-chunk xxhash of host bytes, checked before each load
    shared_storage_path: str | None = None
    # write_through: a stored chunk is queued for its file at once, so other
    # replicas (and a restart) find it. write_back: at most
    # fs_write_back_lag_s later (both engines), on eviction, and at shutdown.
    fs_write_mode: str = "write_through"
    fs_write_back_lag_s: float = 10.0
    fs_capacity_bytes: int | None = None
    fs_threads: int = 8
    fs_queue_depth: int = 256
    fs_fsync: bool = False
    fs_o_direct: bool = False
    snapshot_path: str | None = None
    # With a secret the file tier signs every chunk and hides names (core/fs/auth.py).
    fs_secret_file: str | None = None
    fs_secret: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    # Directories the file tier creates: 0o700 (files 0o600) or 0o750 (files 0o640, a group may read).
    fs_dir_mode: int = 0o700
    # AES-256-GCM chunk payloads (keys from the secret; needs `cryptography`); the tag is the MAC.
    fs_encrypt: bool = False
    # With a secret: HMAC-SHA256 (stdlib) or GMAC (AES-GCM tag, several times faster; needs `cryptography`).
    fs_mac: str = "hmac-sha256"
    # A file the operator rewrites before each reset_prefix_cache (e.g. with the weights version): replicas
    # that reset together derive the same file-tier namespace from it and keep sharing.
    fs_reset_epoch_file: str | None = None
    # A shared tier without a secret refuses to start unless this says
    # so: anyone who can write the directory could then publish KV this engine serves.
    fs_allow_unauthenticated: bool = False
    # Deadline of every file-tier read and write: past it a load fails (the request recomputes) and a
    # write is dropped; no engine thread ever waits longer on the mount.
    fs_io_timeout_s: float = 5.0
    # load or recompute. "auto": each hit loads its longest prefix whose expected time in the tiers that
    # can be slow (file tier, stores in flight; learned from completed transfers; core/costs.py; the host
    # tier counts only a stall) x load_decision_bias is at most the engine's expected time to recompute it
    # (learned from its steps); the rest is recomputed, a chunk still being stored is waited for only when
    # that pays, and a file load past its hedge is given up. "always": load every hit. "never": recompute.
    # load_decision_bias > 1 favours recomputing, < 1 loading.
    load_decision: str = "auto"
    load_decision_bias: float = 1.0
    # session leases (core/leases.py): chunks a request's hint leases are evicted only after every unleased
    # chunk of the tier, until the lease expires; leases hold at most this share of each tier (0: off): of the
    # host tier, and of fs_capacity_bytes for the file tier (none without a budget: it evicts nothing) ...
    lease_max_fraction: float = 0.5
    # ... and at most this many sessions (the table is allocated once, at start).
    lease_max_sessions: int = 4096
    # interleaved lookups: a hit continues through chunks HBM still caches after vLLM's first miss (copied
    # on the device), as well as through the offload tiers' chunks; HBM preferred (connector/interleave.py).
    interleaved_lookups: bool = True
    # Where each explicitly set field came from ((field, "kv_connector_extra_config key 'x'"), ...), and what
    # was given that no setting of ours reads (vLLM's own keys, tpu-inference's variables): for the warning.
    set_by: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False, compare=False)
    unread: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def step_budget_bytes(self) -> int:
        """Bytes per device one step may move in each direction (core/step_budget.py)."""
        return step_budget.bytes_per_device(self.transfer_bandwidth_gbps, self.transfer_stall_ms,
                                            self.devices_per_chip)

    # -------------------------------------------------------------------
    @classmethod
    def from_sources(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> "OffloadConfig":
        env = os.environ if env is None else env
        env_names: dict[str, str] = {}
        json_names: dict[str, str] = {}
        from_env = _parse_env(env, env_names)
        from_json = _parse_extra(extra_config or {}, json_names)
        # A JSON size replaces the env size wholesale (not merged with it).
        if any(f in from_json for f in _SIZE_FIELDS):
            for f in _SIZE_FIELDS:
                from_env.pop(f, None)
        if from_json.get("blocks_per_chunk") is not None or from_json.get("chunk_tokens") is not None:
            from_env.pop("blocks_per_chunk", None)
        values = {**from_env, **from_json}
        names = {**{f: f"environment variable {n}" for f, n in env_names.items() if f in from_env},
                 **{f: f"kv_connector_extra_config key {n!r}" for f, n in json_names.items()}}
        unpinned = values.pop("use_unpinned_host", None)
        if unpinned is not None and "host_memory_kind" not in values:
            values["host_memory_kind"] = "unpinned_host" if unpinned else "pinned_host"
            names["host_memory_kind"] = names.pop("use_unpinned_host")
        names.pop("use_unpinned_host", None)
        unread = tuple(sorted((BOTH, f"environment variable {n} ({why})") for n, why in UPSTREAM_ENV.items()
                              if n in env))
        for k in (extra_config or {}):
            if k in VLLM_KEYS_IGNORED:
                unread += ((BOTH, f"kv_connector_extra_config key {k!r} ({VLLM_KEYS_IGNORED[k]})"),)
            elif k in VLLM_KEYS_READ:
                unread += ((TPU, f"kv_connector_extra_config key {k!r} (read by vLLM's OffloadingConnector)"),)
        _check_pairs(values, names)
        values["set_by"] = tuple(sorted(names.items()))
        values["unread"] = unread
        _resolve_secret(values, from_env, from_json)
        _check_authenticated(values)
        if values.get("fs_encrypt"):
            _check_encrypt(values, "fs_encrypt" in from_json)
        if values.get("fs_mac") == "gmac" and values.get("fs_secret"):
            _check_cryptography("kv_connector_extra_config key 'fs_mac'" if "fs_mac" in from_json
                                else "environment variable TPU_OFFLOAD_FS_MAC", "'gmac'", "'hmac-sha256'")
        return cls(**values)

    def resolve_num_chunks(self, chunk_bytes: int) -> int:
        """Host-tier capacity in chunks, once the engine knows a chunk's bytes."""
        if self.num_cpu_chunks is not None:
            return self.num_cpu_chunks
        if self.cpu_bytes is None:
            raise ConfigError(
                "no host-tier size: set one of 'num_cpu_chunks', 'cpu_bytes' "
                "(vLLM: 'cpu_bytes_to_use'), 'cpu_gib' in kv_connector_extra_config, "
                "or TPU_OFFLOAD_NUM_CPU_CHUNKS"
            )
        n = self.cpu_bytes // chunk_bytes
        if n < 1:
            raise ConfigError(
                f"cpu_bytes={self.cpu_bytes} is smaller than one chunk ({chunk_bytes} bytes); "
                f"allowed: at least {chunk_bytes}"
            )
        return n

    def resolve_blocks_per_chunk(self, engine_block_size: int) -> int:
        """Blocks per chunk, reconciling vLLM's token-based ``block_size`` key."""
        if self.chunk_tokens is None:
            return self.blocks_per_chunk
        if self.chunk_tokens % engine_block_size:
            raise ConfigError(
                f"kv_connector_extra_config key 'block_size': value {self.chunk_tokens} is not "
                f"allowed; allowed: a multiple of the engine block size {engine_block_size}"
            )
        return self.chunk_tokens // engine_block_size


DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
def _check_pairs(values: dict[str, Any], names: dict[str, str]) -> None:
    """Settings that cannot both hold, from whichever source (or default) each came: one error naming both."""

    def said(field: str) -> str:
        value = values.get(field, DEFAULTS[field])
        return f"{field}={value!r} ({names.get(field, 'the default')})"

    def get(field: str) -> Any:
        return values.get(field, DEFAULTS[field])

    if values.get("snapshot_path") and get("transfer_path") == "device_put":
        raise ConfigError(
            f"{said('snapshot_path')} and {said('transfer_path')} contradict each other: a snapshot saves the "
            "preallocated host slabs of transfer_path 'program'; allowed: transfer_path 'program' or 'auto', "
            "or leave snapshot_path unset")


def _resolve_secret(values: dict[str, Any], from_env: dict[str, Any], from_json: dict[str, Any]) -> None:
    """Read ``fs_secret_file`` now (one clear error at start); a file and an env secret conflict."""
    path = values.get("fs_secret_file")
    if path is None:
        return
    if values.get("fs_secret") is not None:
        where = "kv_connector_extra_config key 'fs_secret_file'" if "fs_secret_file" in from_json \
            else "environment variable TPU_OFFLOAD_FS_SECRET_FILE"
        raise ConfigError(f"{where}={path!r} and environment variable TPU_OFFLOAD_FS_SECRET both give the file "
                          "tier's secret; allowed: set only one")
    from tpu_offload.core.fs.auth import read_secret_file

    try:
        values["fs_secret"] = read_secret_file(path)
    except ValueError as e:
        where = "kv_connector_extra_config key 'fs_secret_file'" if "fs_secret_file" in from_json \
            else "environment variable TPU_OFFLOAD_FS_SECRET_FILE"
        raise _fail(where, path, str(e)) from None


def _check_authenticated(values: dict[str, Any]) -> None:
    """A shared tier starts only with a secret, or when the config says it may run without one."""
    path = values.get("shared_storage_path")
    if not path or values.get("fs_secret") or values.get("fs_allow_unauthenticated"):
        return
    raise ConfigError(
        f"shared_storage_path: value {path!r} is not allowed without a secret: anyone who can write that "
        "directory could publish KV this engine would serve, and file names would reveal prompts. Allowed: "
        "set fs_secret_file (or TPU_OFFLOAD_FS_SECRET_FILE / TPU_OFFLOAD_FS_SECRET) to a secret of 32 random "
        "bytes (e.g. `head -c 32 /dev/urandom | base64 > secret; chmod 600 secret`), or accept an "
        "unauthenticated tier with fs_allow_unauthenticated: true (TPU_OFFLOAD_FS_ALLOW_UNAUTHENTICATED=1)")


def _check_encrypt(values: dict[str, Any], from_json: bool) -> None:
    where = "kv_connector_extra_config key 'fs_encrypt'" if from_json else "environment variable TPU_OFFLOAD_FS_ENCRYPT"
    if not values.get("fs_secret"):
        raise ConfigError(f"{where}: value True is not allowed without a secret; allowed: false, or set "
                          "fs_secret_file (or TPU_OFFLOAD_FS_SECRET) too: the keys are derived from it")
    _check_cryptography(where, "True", "false")


def _check_cryptography(where: str, value: str, instead: str) -> None:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401
    except ImportError:
        raise ConfigError(f"{where}: value {value} needs the 'cryptography' package (pip install "
                          f"'tpu-offload[fs-encrypt]'); allowed: {instead}, or install it") from None


def _fail(where: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{where}: value {value!r} is not allowed; allowed: {allowed}")


def _did_you_mean(name: Any, candidates) -> str:
    close = difflib.get_close_matches(str(name), sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_extra(extra: Mapping[str, Any], names: dict[str, str]) -> dict[str, Any]:
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in extra.items():
        setting = _BY_KEY.get(key)
        if setting is None and str(key).lower() in _SECRET_KEYS:
            raise ConfigError(
                f"kv_connector_extra_config key {key!r} (value hidden) is not allowed: a secret never goes in "
                "a config JSON. Allowed: 'fs_secret_file' (a path to a file holding it, e.g. a mounted "
                "Kubernetes Secret) or the environment variable TPU_OFFLOAD_FS_SECRET"
            )
        if setting is None:
            if key in ENGINE_KEYS:
                continue
            known = set(_BY_KEY) | ENGINE_KEYS
            raise ConfigError(
                f"kv_connector_extra_config key {key!r} (value {value!r}) is unknown"
                f"{_did_you_mean(key, known)}. Allowed keys: {', '.join(sorted(_BY_KEY))} "
                f"(and vLLM's own: {', '.join(sorted(ENGINE_KEYS))})"
            )
        try:
            parsed = setting.parse(value)
        except ValueError as e:
            raise _fail(f"kv_connector_extra_config key {key!r}", value, str(e)) from None
        _claim(seen, setting.field, key, value, "kv_connector_extra_config")
        out[setting.field] = parsed
        names[setting.field] = key
    _check_contradictions(seen, out, "kv_connector_extra_config")
    if extra.get("offload_prompt_only") is not None and out.get("decode_save") is not None:
        try:
            prompt_only = _bool(extra["offload_prompt_only"])
        except ValueError as e:
            raise _fail("kv_connector_extra_config key 'offload_prompt_only'", extra["offload_prompt_only"], str(e)) from None
        if prompt_only == out["decode_save"]:
            raise ConfigError(
                f"kv_connector_extra_config keys 'offload_prompt_only'={extra['offload_prompt_only']!r} "
                f"and 'decode_save'={extra['decode_save']!r} contradict each other; allowed: set only one"
            )
    return out


def _parse_env(env: Mapping[str, str], names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith("TPU_OFFLOAD_") or name in UPSTREAM_ENV:
            continue
        setting = _BY_ENV.get(name)
        if setting is None:
            raise ConfigError(
                f"environment variable {name}={value!r} is unknown"
                f"{_did_you_mean(name, _BY_ENV)}. Allowed: {', '.join(sorted(_BY_ENV))}"
            )
        shown = f"<hidden, {len(value)} characters>" if setting.secret else repr(value)
        try:
            parsed = setting.parse(value)
        except ValueError as e:
            msg = f"environment variable {name}: value {shown} is not allowed; allowed: {e}"
            raise ConfigError(msg) from None
        _claim(seen, setting.field, name, "<hidden>" if setting.secret else value, "environment")
        out[setting.field] = parsed
        names[setting.field] = name
    _check_contradictions(seen, out, "environment")
    return out


def _claim(seen: dict[str, str], field: str, name: str, value: Any, source: str) -> None:
    """Record which key set ``field`` (as ``name=value`` for messages)."""
    here = f"{name}={value!r}"
    if field in seen:
        raise ConfigError(f"{source}: {seen[field]} and {here} both set {field}; allowed: set only one")
    seen[field] = here


def _check_contradictions(seen: dict[str, str], out: dict[str, Any], source: str) -> None:
    """Two names of one source that say different things (``seen``: field -> ``name=value``)."""
    if "use_unpinned_host" in seen and "host_memory_kind" in seen \
            and out["use_unpinned_host"] != (out["host_memory_kind"] == "unpinned_host"):
        raise ConfigError(
            f"{source}: {seen['host_memory_kind']} and {seen['use_unpinned_host']} contradict each other "
            "(tpu-inference's variable picks the host memory kind too); allowed: set only one, or both alike")
    sizes = [seen[f] for f in _SIZE_FIELDS if f in seen]
    if len(sizes) > 1:
        raise ConfigError(f"{source}: {sizes[0]} and {sizes[1]} both size the host tier; allowed: set only one")
    if "blocks_per_chunk" in seen and "chunk_tokens" in seen:
        raise ConfigError(
            f"{source}: {seen['blocks_per_chunk']} and {seen['chunk_tokens']} both set the chunk size; "
            "allowed: set only one"
        )
