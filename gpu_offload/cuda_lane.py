"""CUDA plumbing for the transfer engine: pinned slab, streams, events, index uploads.

Nothing here runs on the CPU platform; every entry point is reached only when
the engine's KV tensors are CUDA tensors and ``torch.cuda.is_available()``.

* The host slab (numpy) is registered with ``cudaHostRegister`` in pieces of
  at most 64 GiB, cut on row boundaries, so DMA needs no bounce buffer and no
  single transfer straddles two registrations. Failure leaves the slab
  pageable: slower, still correct.
* One stream per lane (store, load, expedited load). A transfer first waits
  for the current compute stream: a store must read KV the model finished
  writing, a load must land after pending writes (zeroing) to its blocks.
  Within a lane transfers run in submission order.
* Completion is polled with ``event.query()``; the host never blocks on the
  hot path. ``wait`` synchronizes only the events it is asked for.
* Index arrays go to the device through a small ring of pinned buffers. A
  buffer is rewritten only after its previous upload finished; the host waits
  there only if a lane has ``depth`` uploads still queued behind earlier work.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from gpu_offload.copy_ops import StagedCopier
from gpu_offload.layout import HostLayout, PagedRows
from gpu_offload.vllm_compat import get_logger

logger = get_logger(__name__)

MAX_REGISTER_BYTES = 64 << 30


def register_host_rows(rows: torch.Tensor) -> list[int]:
    """Pin ``rows`` (contiguous, CPU) in row-aligned pieces; returns registered pointers."""
    cudart = torch.cuda.cudart()
    base, total = rows.data_ptr(), rows.numel() * rows.element_size()
    row = rows.stride(0) * rows.element_size()
    piece = max(MAX_REGISTER_BYTES // row, 1) * row
    done: list[int] = []
    for off in range(0, total, piece):
        size = min(piece, total - off)
        err = cudart.cudaHostRegister(base + off, size, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            logger.warning(
                "cudaHostRegister failed (%s) at %.2f of %.2f GB; host tier stays pageable (slower)",
                err, off / 1e9, total / 1e9,
            )
            unregister_host(done)
            return []
        done.append(base + off)
    logger.info("pinned host tier: %.2f GB in %d piece(s)", total / 1e9, len(done))
    return done


def unregister_host(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in reversed(ptrs):
        err = cudart.cudaHostUnregister(p)
        if int(err) != 0:
            logger.warning("cudaHostUnregister failed (%s)", err)
    ptrs.clear()


class IndexRing:
    def __init__(self, device: torch.device, capacity: int, depth: int = 4):
        self.device = device
        self._entries = [self._entry(capacity) for _ in range(depth)]
        self._next = 0

    def _entry(self, capacity: int) -> list[Any]:
        return [
            torch.empty(capacity, dtype=torch.int64, pin_memory=True),
            torch.empty(capacity, dtype=torch.int64, device=self.device),
            torch.cuda.Event(),
        ]

    def upload(self, arr: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        entry = self._entries[self._next]
        self._next = (self._next + 1) % len(self._entries)
        host, dev, ev = entry
        if not ev.query():
            ev.synchronize()  # ring wrapped while that upload is still queued
        n = len(arr)
        if n > host.numel():
            dev.record_stream(stream)  # queued kernels may still read the old buffer
            entry[:] = self._entry(max(n, 2 * host.numel()))
            host, dev, ev = entry
        host.numpy()[:n] = arr
        with torch.cuda.stream(stream):
            dev[:n].copy_(host[:n], non_blocking=True)
            ev.record(stream)
        return dev[:n]


class CudaLane:
    """One direction of traffic: its own stream, staging buffer and FIFO of jobs."""

    def __init__(
        self,
        engine: list[torch.Tensor],
        host_rows: torch.Tensor,
        layout: HostLayout,
        staging_slots: int,
        index_capacity: int,
        priority: int = 0,
    ):
        self.device = engine[0].device
        self.stream = torch.cuda.Stream(device=self.device, priority=priority)
        staging = torch.empty((staging_slots, host_rows.shape[1]), dtype=torch.int8, device=self.device)
        self._ring = IndexRing(self.device, index_capacity)
        self.copier = StagedCopier(
            engine, host_rows, PagedRows(staging, layout),
            upload=lambda a: self._ring.upload(a, self.stream), non_blocking=True,
        )
        self.inflight: collections.deque = collections.deque()
        self._free_events: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    def submit(self, job, plan, to_host: bool) -> int:
        start, end = self._event(), self._event()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            nbytes = self.copier.copy(plan, to_host)
            end.record(self.stream)
        job.events = (start, end)
        self.inflight.append(job)
        return nbytes

    def poll(self) -> list:
        """Jobs finished since the last poll, in order; job.error set if the query raised."""
        done = []
        while self.inflight:
            job = self.inflight[0]
            start, end = job.events
            try:
                if not end.query():
                    break
                job.seconds = start.elapsed_time(end) * 1e-3
            except Exception as e:  # a CUDA error surfaced on this job
                job.error = e
            self.inflight.popleft()
            self._free_events += [start, end]
            job.events = None
            done.append(job)
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job in self.inflight:
            if job.job_id in job_ids:
                try:
                    job.events[1].synchronize()
                except Exception:  # surfaced again, and handled, by poll()
                    logger.exception("waiting for transfer job %d failed", job.job_id)

    def drain(self) -> None:
        self.stream.synchronize()
