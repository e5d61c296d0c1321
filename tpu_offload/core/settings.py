"""The settings table: every setting's field, parser, key, variable, scope and meaning.

``config.py`` resolves a deployment's values from this table (extra config over env over defaults);
the reference page docs/reference/settings.md is generated from it (tools/gen_reference.py), and
``config_checks.py`` names from it the settings a running engine ignores. Beside it: the keys of
vLLM's own connector that travel in the same dict, and tpu-inference's variables that mean
nothing to ours, each with why. Declarations only: no parsing happens here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tpu_offload.core.config_values import (
    _abs_path,
    _bool,
    _bytes,
    _choice,
    _dir_mode,
    _float,
    _gib,
    _int,
    _margin,
    _secret_env,
    _share,
)

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
