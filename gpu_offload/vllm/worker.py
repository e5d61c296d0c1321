"""The torch transfer engine as vLLM's ``OffloadingWorker``, one per worker rank.

Adds what only vLLM needs: ``TransferResult``s, and the per-step stats this
worker feeds into vLLM's metrics (``take_connector_stats``, sent by ``hooks``
in the worker's step report to our manager, whose ``get_stats`` returns them).

Every job is reported with ``success=True``: vLLM 0.32 asserts it. A failed
load travels as load errors instead (``HostTransferEngine.take_load_errors``,
reported by ``hooks``), and vLLM recomputes those blocks.
"""

from __future__ import annotations

from gpu_offload.torch_backend.engine import HostTransferEngine
from gpu_offload.vllm import metrics
from gpu_offload.vllm.compat import OffloadingConnectorStats, OffloadingWorker, TransferResult


class HostOffloadWorker(HostTransferEngine, OffloadingWorker):
    def __init__(self, *args, rank: int = 0, **kw):
        super().__init__(*args, **kw)
        self.rank = rank
        self.fs_metrics = None  # set with the file tier (spec): its private FsMetrics
        self._stats = metrics.WorkerStats(rank)

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(job_id=r.job_id, success=True, transfer_size=r.nbytes, transfer_time=r.seconds)
            for r in super().get_finished()
        ]

    def lease_files(self, renews, leases) -> None:
        """The scheduler's session leases of one step (hooks): renewals first, then finished requests' prefixes,
        each leased in this worker's file tier (its own files of those chunks)."""
        self.fs.tier.apply_lease_orders(renews, leases)

    def take_connector_stats(self) -> OffloadingConnectorStats | None:
        """What happened since the last call, for vLLM's ``/metrics``."""
        tier = self.fs.tier if self.fs is not None else None
        return self._stats.collect(self.hits, tier, self.fs_metrics, pinned=self.pinned)
