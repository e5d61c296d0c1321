"""One typed config per deployment, from ``kv_connector_extra_config`` and env.

Precedence: ``kv_connector_extra_config`` > ``TPU_OFFLOAD_*`` env > defaults,
so the llm-d overlays' environment works unchanged and a JSON key overrides
it. Every bad value, unknown key and contradiction raises one ``ConfigError``
naming the key, the value and what is allowed (with a "did you mean").

Each setting declares its scope (TPU, VLLM or BOTH) and its meaning in
``SETTINGS``; docs/reference/settings.md is generated from that table
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
from typing import Any, Callable, Mapping

from tpu_offload.core import step_budget
from tpu_offload.core.config_values import (  # noqa: F401  (parse_size, parse_number: the CLI's)
    _bytes,
    _gib,
    _int,
    _float,
    _share,
    _bool,
    _choice,
    _abs_path,
    _dir_mode,
    _margin,
    _secret_env,
    parse_number,
    parse_size,
)


class ConfigError(ValueError):
    pass


# ---- the settings table ---------------------------------------------------


# Scopes: which engine honours a setting. Each _Setting names its scope and one line of meaning,
# from which docs/reference/settings.md is generated (tools/gen_reference.py); a setting the running
# engine ignores is named in one warning at start (ignored_settings_warning).
TPU, VLLM, BOTH = "tpu", "vllm", "both"


@dataclasses.dataclass(frozen=True)
class _Setting:
    field: str
    parse: Callable[[Any], Any]
    env: str | None = None
    keys: tuple[str, ...] = ()  # extra_config keys; the first is the canonical one
    secret: bool = False  # its value never appears in a message
    scope: str | None = None  # TPU, VLLM or BOTH
    doc: str = ""  # its meaning, one sentence, for the reference page
    env_aliases: tuple[str, ...] = ()  # older variable names still read (tpu-inference's own names)


SETTINGS: tuple[_Setting, ...] = (
    # host tier size: exactly one of these per source
    _Setting("num_cpu_chunks", _int(1), "TPU_OFFLOAD_NUM_CPU_CHUNKS", ("num_cpu_chunks",), scope=BOTH,
             doc="Host-tier capacity in chunks (instead of a size in bytes)."),
    _Setting("cpu_bytes", _bytes, "TPU_OFFLOAD_CPU_BYTES", ("cpu_bytes", "cpu_bytes_to_use"), scope=BOTH,
             doc="Host-tier size of the whole engine (all workers or hosts together); 'cpu_bytes_to_use' is "
                 "vLLM's name."),
    _Setting("cpu_bytes", _gib, "TPU_OFFLOAD_CPU_GIB", ("cpu_gib",), scope=BOTH,
             doc="Host-tier size in GiB (a number); the same setting as cpu_bytes."),
    # chunking and staging
    _Setting("blocks_per_chunk", _int(1, 4096), "TPU_OFFLOAD_BLOCKS_PER_CHUNK", ("blocks_per_chunk",), scope=BOTH,
             doc="Engine blocks per chunk, the unit the tier stores, looks up and evicts."),
    _Setting("chunk_tokens", _int(1), None, ("chunk_tokens", "block_size"), scope=BOTH,
             doc="Tokens per chunk, a multiple of the engine's block size (instead of blocks_per_chunk). "
                 "'block_size' is vLLM's name for it; on vLLM only 'block_size' is read (vLLM sizes chunks "
                 "itself)."),
    _Setting("staging_blocks", _int(1), "TPU_OFFLOAD_STAGING_BLOCKS", ("staging_blocks",), scope=BOTH,
             env_aliases=("TPU_OFFLOAD_NUM_STAGING_BLOCKS",),
             doc="Device staging buffer in blocks; a step's loads and stores together move at most this many "
                 "blocks (each direction also within the per-step budget, transfer_stall_ms)."),
    # the per-step byte budget (core/step_budget.py): a chip's link x the stall a step may take, per device
    _Setting("transfer_bandwidth_gbps", _float(0.001), "TPU_OFFLOAD_TRANSFER_BANDWIDTH_GBPS",
             ("transfer_bandwidth_gbps",), scope=TPU,
             doc="Host link GB/s of one chip, each direction, assumed for the per-step budget (default: "
                 "google/tpu-sync's ~152 GB/s per 4-chip TPU7x VM, fragmented); the chip's devices share it."),
    _Setting("transfer_bandwidth_gbps", _float(0.001), "TPU_OFFLOAD_LOAD_BANDWIDTH_GBPS", ("load_bandwidth_gbps",),
             scope=TPU, doc="Another name for transfer_bandwidth_gbps."),
    _Setting("transfer_stall_ms", _float(0.001), "TPU_OFFLOAD_TRANSFER_STALL_MS", ("transfer_stall_ms",), scope=TPU,
             doc="Stall one step may add to the next forward, per direction. Per step and direction the "
                 "scheduler sends, and the worker dispatches, at most transfer_bandwidth_gbps x "
                 "transfer_stall_ms / devices_per_chip bytes per device; the rest waits for later steps."),
    _Setting("transfer_stall_ms", _float(0.001), "TPU_OFFLOAD_LOAD_STALL_MS", ("load_stall_ms",), scope=TPU,
             doc="Another name for transfer_stall_ms."),
    _Setting("devices_per_chip", _int(1, 64), "TPU_OFFLOAD_DEVICES_PER_CHIP", ("devices_per_chip",), scope=TPU,
             doc="JAX devices that share one chip's host link (TPU7x: 2 TensorCores, each its own device; "
                 "v5e, v6e: 1). Each device's share of the per-step budget is the chip's divided by it."),
    # transfer pacing: pieces after the forward, within the per-step budget
    _Setting("transfer_piece_bytes", _bytes, "TPU_OFFLOAD_TRANSFER_PIECE_BYTES", ("transfer_piece_bytes",),
             scope=TPU, doc="Largest host copy sent at once, per device: TPU7x queues DMAs and program launches "
                            "in one order, so a forward waits behind whatever was queued before it."),
    _Setting("transfer_inflight_bytes", _bytes, "TPU_OFFLOAD_TRANSFER_INFLIGHT_BYTES", ("transfer_inflight_bytes",),
             scope=TPU, doc="Accepted and ignored: the per-step budget alone bounds what a forward waits behind "
                            "(pieces are never held back by local readiness, so every host sends the same)."),
    _Setting("transfer_pacing", _choice("auto", "on", "off"), "TPU_OFFLOAD_TRANSFER_PACING", ("transfer_pacing",),
             scope=TPU, doc="auto: pace on TPU (program path, one attention-DP rank, one JAX process); on: wherever "
                            "that applies; off: every host copy of a step at once (the scheduler still sends at "
                            "most the per-step budget each step)."),
    _Setting("decode_save", _bool, "TPU_OFFLOAD_DECODE_SAVE", ("decode_save",), scope=TPU,
             doc="Also store chunks that decoding fills (vLLM: its own key 'offload_prompt_only': false)."),
    _Setting("store_policy", _choice("write_through", "exclusive"), "TPU_OFFLOAD_STORE_POLICY", ("store_policy",),
             scope=TPU, doc="write_through: every computed chunk goes to host memory at once; exclusive: a chunk "
                            "the device still caches is copied only when its blocks are reused. Refused under "
                            "DP attention."),
    _Setting("sync_load", _bool, "TPU_OFFLOAD_SYNC_LOAD", ("sync_load",), scope=TPU,
             doc="Load hits before the step that needs them instead of overlapping them with compute. Refused "
                 "under DP attention."),
    _Setting("host_memory_kind", _choice("pinned_host", "unpinned_host"), "TPU_OFFLOAD_HOST_MEMORY_KIND",
             ("host_memory_kind",), scope=TPU,
             doc="JAX memory kind of the host tier; every local device must offer it (checked at start)."),
    _Setting("use_unpinned_host", _bool, "TPU_OFFLOAD_USE_UNPINNED_HOST", (), scope=TPU,
             doc="tpu-inference's variable: true means host_memory_kind unpinned_host."),
    _Setting("host_memory_margin", _margin, "TPU_OFFLOAD_HOST_MEMORY_MARGIN", ("host_memory_margin",), scope=BOTH,
             doc="Host memory the tier leaves free, checked before it is allocated: a fraction (0.05 or '5%') "
                 "of the host's or cgroup's memory, or a size ('16GiB'); a bare number from 1 to 100 is refused "
                 "as ambiguous."),
    _Setting("transfer_path", _choice("auto", "program", "device_put", "direct"), "TPU_OFFLOAD_TRANSFER_PATH",
             ("transfer_path",), scope=TPU,
             doc="program: preallocated host slabs written by compiled programs through HBM staging; direct "
                 "(TPU only): one DMA kernel per call between the paged caches and preallocated host slabs, no "
                 "staging copy; device_put: per-slot host arrays and two programs over the whole staging buffer "
                 "every pass (opt-in); auto: direct on a TPU where it can serve the cache (one JAX process, no "
                 "snapshot_path or shared_storage_path) and its start-up round trip is bit-exact, else program."),
    _Setting("transfer_kernel", _choice("auto", "dma", "loop", "xla"), "TPU_OFFLOAD_TRANSFER_KERNEL",
             ("transfer_kernel",), scope=TPU,
             doc="How gather/scatter move blocks: dma (a Pallas kernel of DMAs), loop (XLA ops, one block per "
                 "trip), xla (one XLA gather/scatter per layer over a bucket of the pass's size, for GPUs), "
                 "auto (dma on TPU, xla on GPU, loop elsewhere)."),
    _Setting("sliding_window", _choice("auto", "window", "all"), "TPU_OFFLOAD_SLIDING_WINDOW", ("sliding_window",),
             scope=TPU, doc="Sliding-window layers: window moves only the blocks a later request can attend to, "
                            "all moves every block, auto picks window where that is safe."),
    _Setting("window_every_chunks", _int(0), "TPU_OFFLOAD_WINDOW_EVERY_CHUNKS", ("window_every_chunks",), scope=TPU,
             doc="With window: also keep the window before every N-th chunk boundary, so a shared system "
                 "prompt can hit; 0: only at the end of each step's stores."),
    _Setting("skip_precompile", _bool, "TPU_OFFLOAD_SKIP_PRECOMPILE", ("skip_precompile",), scope=TPU,
             env_aliases=("TPU_OFFLOAD_SKIP_JAX_PRECOMPILE",),
             doc="Compile the transfer programs on first use instead of at start."),
    _Setting("multihost_timeout_s", _float(1.0), "TPU_OFFLOAD_MULTIHOST_TIMEOUT_S", ("multihost_timeout_s",),
             scope=TPU, doc="Several JAX processes: how long start-up waits for every host's figures before "
                            "failing with the hosts that sent none."),
    _Setting("enable_events", _bool, "TPU_OFFLOAD_ENABLE_EVENTS", ("enable_events",), scope=BOTH,
             doc="Publish KV events for host-tier (and file-tier) stores and evictions, when the engine's KV "
                 "events are on."),
    _Setting("verify_checksums", _bool, "TPU_OFFLOAD_VERIFY_CHECKSUMS", ("verify_checksums",), scope=TPU,
             doc="Keep an xxhash of each host chunk and check it before each load."),
    # shared-filesystem tier
    _Setting("shared_storage_path", _abs_path("shared_storage_path"), "TPU_OFFLOAD_SHARED_STORAGE_PATH",
             ("shared_storage_path",), scope=BOTH,
             doc="Directory of the file tier, shared by replicas and surviving restarts; unset: no file tier."),
    _Setting("fs_write_mode", _choice("write_back", "write_through"), "TPU_OFFLOAD_FS_WRITE_MODE", ("fs_write_mode",),
             scope=BOTH, doc="write_through: a stored chunk is queued for its file at once; write_back: within "
                             "fs_write_back_lag_s, on eviction and at shutdown."),
    _Setting("fs_write_back_lag_s", _float(0.0), "TPU_OFFLOAD_FS_WRITE_BACK_LAG_S", ("fs_write_back_lag_s",),
             scope=BOTH, doc="write_back: the longest a stored chunk waits for its file."),
    _Setting("fs_capacity_bytes", _bytes, "TPU_OFFLOAD_FS_CAPACITY_BYTES", ("fs_capacity_bytes", "fs_capacity"),
             scope=BOTH, env_aliases=("TPU_OFFLOAD_FS_CAPACITY",),
             doc="Most bytes of chunk files this engine keeps; unset: no limit but the disk."),
    _Setting("fs_threads", _int(1, 256), "TPU_OFFLOAD_FS_THREADS", ("fs_threads",), scope=BOTH,
             doc="File-tier I/O threads per worker."),
    _Setting("fs_queue_depth", _int(1), "TPU_OFFLOAD_FS_QUEUE_DEPTH", ("fs_queue_depth",), scope=BOTH,
             doc="Most file writes queued; past it a write is dropped (the chunk stays in host memory)."),
    _Setting("fs_fsync", _bool, "TPU_OFFLOAD_FS_FSYNC", ("fs_fsync",), scope=BOTH,
             doc="fsync each chunk file before publishing it."),
    _Setting("fs_o_direct", _bool, "TPU_OFFLOAD_FS_O_DIRECT", ("fs_o_direct",), scope=BOTH,
             doc="Read and write chunk files with O_DIRECT, bypassing the page cache."),
    _Setting("snapshot_path", _abs_path("snapshot_path"), "TPU_OFFLOAD_SNAPSHOT_PATH", ("snapshot_path",), scope=TPU,
             doc="Save the host tier here at shutdown and load it at start (warm restart). On vLLM a "
                 "shared_storage_path survives restarts instead."),
    _Setting("fs_dir_mode", _dir_mode, "TPU_OFFLOAD_FS_DIR_MODE", ("fs_dir_mode",), scope=BOTH,
             doc="Mode of the directories the file tier creates: 0700 (files 0600) or 0750 (files 0640)."),
    _Setting("fs_encrypt", _bool, "TPU_OFFLOAD_FS_ENCRYPT", ("fs_encrypt",), scope=BOTH,
             doc="AES-256-GCM chunk payloads, keys derived from the secret (needs 'cryptography')."),
    _Setting("fs_mac", _choice("hmac-sha256", "gmac"), "TPU_OFFLOAD_FS_MAC", ("fs_mac",), scope=BOTH,
             doc="With a secret: how chunks are signed, HMAC-SHA256 (stdlib) or GMAC (faster; needs "
                 "'cryptography')."),
    _Setting("fs_reset_epoch_file", _abs_path("fs_reset_epoch_file"), "TPU_OFFLOAD_FS_RESET_EPOCH_FILE",
             ("fs_reset_epoch_file",), scope=BOTH,
             doc="A file the operator rewrites before each reset_prefix_cache: replicas that reset together "
                 "derive the same file-tier namespace from it and keep sharing."),
    # the file tier's secret: a path in JSON or env, the secret itself only in env (never in a JSON)
    _Setting("fs_secret_file", _abs_path("fs_secret_file"), "TPU_OFFLOAD_FS_SECRET_FILE", ("fs_secret_file",),
             scope=BOTH, doc="File holding the file tier's secret (32 random bytes, e.g. a mounted Kubernetes "
                             "Secret): chunks are signed and names hidden."),
    _Setting("fs_secret", _secret_env, "TPU_OFFLOAD_FS_SECRET", (), secret=True, scope=BOTH,
             doc="The file tier's secret itself; only from the environment, never in a config JSON."),
    # file tier: secure by default, bounded I/O
    _Setting("fs_allow_unauthenticated", _bool, "TPU_OFFLOAD_FS_ALLOW_UNAUTHENTICATED", ("fs_allow_unauthenticated",),
             scope=BOTH, doc="Let a file tier start without a secret (anyone who can write the directory could "
                             "then publish KV this engine serves)."),
    _Setting("fs_io_timeout_s", _float(0.001), "TPU_OFFLOAD_FS_IO_TIMEOUT_S", ("fs_io_timeout_s",), scope=BOTH,
             doc="Deadline of each file-tier read and write: past it a load fails (the request recomputes) "
                 "and a write is dropped."),
    # load or recompute: a hit is loaded only as far as its load beats recomputing it
    _Setting("load_decision", _choice("auto", "always", "never"), "TPU_OFFLOAD_LOAD_DECISION", ("load_decision",),
             scope=BOTH, doc="auto (default): load each hit's longest prefix whose expected time in the tiers that can "
                             "be slow (file tier, stores in flight; per tier, learned from completed transfers; a "
                             "host-tier hit counts only a stall) x load_decision_bias is at most the expected time "
                             "to recompute it, and recompute the rest (file-tier speed probed at start; a file load "
                             "not done by 4x its estimated recompute time is given up and recomputed); always: load "
                             "every hit, file reads bounded only by fs_io_timeout_s; never: recompute."),
    _Setting("load_decision_bias", _float(0.0), "TPU_OFFLOAD_LOAD_DECISION_BIAS", ("load_decision_bias",),
             scope=BOTH, doc="With load_decision auto: above 1 favours recomputing, below 1 loading."),
    # session leases (core/leases.py): a kv_transfer_params hint keeps a session's prefix through its tool gaps
    _Setting("lease_max_fraction", _share, "TPU_OFFLOAD_LEASE_MAX_FRACTION", ("lease_max_fraction",), scope=BOTH,
             doc="Largest share of each tier that leases may hold at once (a request's 'tpu_offload_lease' "
                 "hint in kv_transfer_params keeps its prefix): of the host tier, and of fs_capacity_bytes for "
                 "the file tier; a fraction from 0 to 1; 0 turns leases off."),
    _Setting("lease_max_sessions", _int(1, 1 << 20), "TPU_OFFLOAD_LEASE_MAX_SESSIONS", ("lease_max_sessions",),
             scope=BOTH, doc="Most sessions holding a lease at once; a hint for another session is ignored "
                             "until one expires."),
    # interleaved lookups: a hit goes on past the device's own prefix-cache hit through chunks HBM caches
    _Setting("interleaved_lookups", _bool, "TPU_OFFLOAD_INTERLEAVED_LOOKUPS", ("interleaved_lookups",), scope=TPU,
             doc="A hit continues through chunks HBM's prefix cache still holds after its first miss (copied "
                 "on the device) as well as chunks the host or file tier holds, preferring HBM. Off: the hit "
                 "ends at the first chunk the offload tiers lack. One KV-cache group, one attention-DP rank, "
                 "no sliding-window layers stored by their window."),
)
# Keys that would put the secret itself into a config JSON (logged, stored, shown in pod specs).
_SECRET_KEYS = frozenset({"fs_secret", "secret", "fs_key", "fs_secret_key", "fs_hmac_key"})

# vLLM's own OffloadingConnector keys travel in the same dict; we accept them without interpreting them,
# so a strict check does not reject them. As vLLM 0.32 reads them (vllm/v1/kv_offload/factory.py, base.py,
# cpu/spec.py, tiering/spec.py; kv_connector/v1/offloading/config.py): vLLM's connector reads these for
# any spec, ours included ...
VLLM_KEYS_READ = {
    "spec_name": "vLLM picks the spec by it",
    "spec_module_path": "vLLM imports the spec from it",
    "offload_prompt_only": "vLLM's offloading scheduler reads it for any spec (our decode_save says the same)",
    "self_describing_kv_events": "vLLM's offloading scheduler reads it for any spec",
}
# ... and these only its own specs read, which HostOffloadSpec replaces: they do nothing with ours (named in
# the start-up warning on both engines), and why.
VLLM_KEYS_IGNORED = {
    "eviction_policy": "vLLM's CPUOffloadingSpec reads it; our host tier always evicts the least recently "
                       "used chunk",
    "cache_policy_module_path": "vLLM's CPUOffloadingSpec reads it; our host tier always evicts the least "
                                "recently used chunk",
    "store_threshold": "vLLM's CPUOffloadingSpec reads it; our host tier stores every chunk offered (TPU: "
                       "store_policy)",
    "max_tracker_size": "vLLM's CPUOffloadingSpec reads it for store_threshold, which our tier does not have",
    "secondary_tiers": "vLLM's TieringOffloadingSpec reads it; our second tier is shared_storage_path",
    "backpressure": "vLLM's TieringOffloadingSpec reads it for its secondary tiers; ours bounds file writes "
                    "with fs_queue_depth",
    "canonical_layout": "vLLM's OffloadingConnector reads it; our host tier keeps each worker's own layout",
}
ENGINE_KEYS = frozenset(VLLM_KEYS_READ) | frozenset(VLLM_KEYS_IGNORED)
# Variables tpu-inference's own offload connector reads that mean nothing to ours: accepted (the llm-d
# overlays' environment works unchanged), named in the start-up warning, and why.
UPSTREAM_ENV = {
    "TPU_OFFLOAD_LMCACHE": "there is no LMCache path",
    "TPU_OFFLOAD_BATCHED_SAVE": "stores are always batched",
    "TPU_OFFLOAD_SAVE_THREADS": "stores are dispatched after the forward, not by threads",
    "TPU_OFFLOAD_BLOCK_SIZE_BUCKETS": "each transfer program compiles once for any block count",
    "TPU_OFFLOAD_METRICS_LOG_INTERVAL": "metrics are Prometheus series, not log lines",
}

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
