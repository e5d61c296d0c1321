"""Shared-filesystem tier under the host tier: host chunk bytes <-> files.

numpy, xxhash and prometheus-client only (no jax, no torch), like the rest
of ``tpu_offload.core``. See docs/file-tier/README.md.
"""

from tpu_offload.core.fs.format import HEADER_SIZE, MAGIC, VERSION, HeaderError
from tpu_offload.core.fs.metrics import FsMetrics
from tpu_offload.core.fs.snapshot import SnapshotPathError, restore_host_tier, snapshot_host_tier
from tpu_offload.core.fs.ticket import TierState, WriteTicket
from tpu_offload.core.fs.tier import FileTier

__all__ = [
    "FileTier", "FsMetrics", "HEADER_SIZE", "HeaderError", "MAGIC", "SnapshotPathError", "TierState", "VERSION",
    "WriteTicket", "restore_host_tier", "snapshot_host_tier",
]
