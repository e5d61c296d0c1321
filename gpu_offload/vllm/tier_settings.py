"""Settings of our file tier when vLLM's ``TieringOffloadingSpec`` loads it as a secondary tier.

vLLM passes each ``secondary_tiers`` entry's keys (minus ``type``,
``module_path`` and ``backpressure``) to the tier's constructor. Those keys
are the same settings, with the same names, parsers and environment
variables, as ``kv_connector_extra_config`` gives ``HostOffloadSpec``: they
go through ``OffloadConfig.from_sources``, so a bad value, an unknown key or
a shared directory without a secret is one ``ConfigError`` naming the key,
the value and what is allowed, and the secret still comes only from a file
or the environment (never from the JSON). Only the place named in messages
differs: ``secondary_tiers entry key 'x'``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from tpu_offload.core.config import ConfigError, OffloadConfig

# The file-tier settings a secondary-tier entry may carry (OffloadConfig field = key).
FS_KEYS = (
    "shared_storage_path", "fs_capacity_bytes", "fs_threads", "fs_queue_depth", "fs_fsync", "fs_o_direct",
    "fs_dir_mode", "fs_encrypt", "fs_mac", "fs_reset_epoch_file", "fs_secret_file", "fs_allow_unauthenticated",
    "fs_io_timeout_s",
)
# Keys of the entry that are vLLM's, or ours but not file-tier settings.
TIER_KEYS = ("enable_kv_events", "locality")
_LOCALITIES = ("LOCAL", "REMOTE")
_HERE = "kv_connector_extra_config key"
_THERE = "secondary_tiers entry key"


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """One secondary-tier entry, parsed: the file-tier part as ``OffloadConfig``."""

    fs: OffloadConfig
    enable_kv_events: bool = False
    locality: str | None = None  # vLLM's Locality value, "LOCAL" or "REMOTE"


def parse_tier_settings(entry: Mapping[str, Any], env: Mapping[str, str] | None = None) -> TierSettings:
    """Validate a ``secondary_tiers`` entry; raises ``ConfigError`` naming key, value and what is allowed."""
    env = os.environ if env is None else env
    unknown = [k for k in entry if k not in FS_KEYS and k not in TIER_KEYS]
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{_THERE} {k!r} (value {entry[k]!r}) is unknown; allowed keys: "
                          f"{', '.join(FS_KEYS + TIER_KEYS)} (and vLLM's type, module_path, backpressure)")
    if not entry.get("shared_storage_path"):
        raise ConfigError(f"{_THERE} 'shared_storage_path': value {entry.get('shared_storage_path')!r} is not "
                          "allowed; allowed: an absolute path to the shared directory (required)")
    try:
        fs = OffloadConfig.from_sources({k: v for k, v in entry.items() if k in FS_KEYS}, env=env)
    except ConfigError as e:
        raise ConfigError(str(e).replace(_HERE, _THERE)) from None
    events = entry.get("enable_kv_events", False)
    if not isinstance(events, bool):  # vLLM's own tiers take a JSON boolean here too
        raise ConfigError(f"{_THERE} 'enable_kv_events': value {events!r} is not allowed; allowed: true or false")
    locality = entry.get("locality")
    if locality is not None and str(locality).upper() not in _LOCALITIES:
        raise ConfigError(f"{_THERE} 'locality': value {locality!r} is not allowed; allowed: "
                          f"{' or '.join(_LOCALITIES)} (or unset)")
    return TierSettings(fs=fs, enable_kv_events=events,
                        locality=None if locality is None else str(locality).upper())
