"""CUDA plumbing for the transfer engine: pinned slab, streams, events, index uploads.

Nothing here runs on the CPU platform; every entry point is reached only when
the engine's KV tensors are CUDA tensors and ``torch.cuda.is_available()``.

* The host slab (numpy) is registered with ``cudaHostRegister`` in pieces of
  at most 64 GiB, cut on row boundaries; copies are cut at those boundaries
  too (``piece_rows``), so no DMA straddles two registrations. Failure
  leaves the slab pageable (still correct, slower: copies from pageable
  memory go through the driver's bounce buffers and stall the copy stream)
  and clears the CUDA error it left behind, which the next kernel launch
  would otherwise raise. It is not an error, as pinning only buys speed;
  it is one warning saying so and why, and the worker's
  ``tpu_offload_host_tier_pinned`` gauge reads 0 (``vllm.metrics``).
* Two streams per lane (store, load, expedited load): the lane stream
  gathers and scatters on the device, its copy stream moves staging halves
  over the bus (``CudaPipe``), so one half's memcpy overlaps the other
  half's gather. A transfer first waits for the current compute stream: a
  store must read KV the model finished writing, a load must land after
  pending writes (zeroing) to its blocks. Within a lane transfers run in
  submission order; the job's end event is recorded after both streams.
* Completion is polled with ``event.query()``; the host never blocks on the
  hot path. ``wait`` synchronizes only the events it is asked for.
* Index arrays go to the device through a pool of pinned + device buffer
  pairs (``UploadPool``). A pair is reused only once its last upload
  finished; when every pair is still queued (many jobs in one step) the pool
  grows instead of waiting, so the engine thread never blocks on it.
* Device memory: each lane holds a staging buffer (``staging_blocks /
  blocks_per_chunk`` host rows, at least two pieces of ``piece_bytes_for``) and
  its index buffers. vLLM sizes its KV
  cache before the connector exists, so this is outside
  ``gpu_memory_utilization``; ``CudaLane.device_bytes`` reports it and the
  engine logs the headroom to leave.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable

import numpy as np
import torch

from gpu_offload._log import get_logger
from gpu_offload.torch_backend import cuda_rt, fused_gather
from gpu_offload.torch_backend.copy_ops import DevicePageCopier, StagedCopier
from gpu_offload.torch_backend.layout import HostLayout, PagedRows

logger = get_logger(__name__)

MAX_REGISTER_BYTES = 64 << 30
# Bytes per memcpy piece: large enough that the Python work of one piece (a gather per KV tensor, about
# 20 us each) takes less than its memcpy (2 MiB per tensor is ~40 us at 50 GB/s), small enough that a
# transfer of a few large rows still goes in several pieces.
PIECE_BYTES = 64 << 20
PIECE_BYTES_PER_TENSOR = 2 << 20


def piece_bytes_for(num_tensors: int) -> int:
    return max(PIECE_BYTES, num_tensors * PIECE_BYTES_PER_TENSOR)
_HOST_REGISTER_PORTABLE = 1
PAGEABLE = (
    "Its copies run from pageable memory: correct, but slower (through the driver's bounce buffers), so "
    "loads save less time. Check the locked-memory limit of the container (ulimit -l / memlock) and that "
    "host memory is not short; tpu_offload_host_tier_pinned reads 0 for this worker until it restarts pinned."
)


def piece_rows_for(row_bytes: int, max_bytes: int | None = None) -> int:
    """Rows per registration piece: whole rows, at most ``max_bytes`` (at least one row)."""
    return max((MAX_REGISTER_BYTES if max_bytes is None else max_bytes) // row_bytes, 1)


def register_host_rows(rows: torch.Tensor) -> tuple[list[int], int | None]:
    """Pin ``rows`` (contiguous, CPU) in row-aligned pieces.

    Returns the registered pointers and the rows per piece (copies must not
    cross a multiple of it), or ``([], None)`` if pinning failed.
    """
    try:
        rt: Any = cuda_rt.runtime()
    except (OSError, RuntimeError, AttributeError) as e:
        logger.warning("host tier NOT PINNED: the CUDA runtime could not be bound (%s). %s", e, PAGEABLE)
        return [], None
    base, total = rows.data_ptr(), rows.numel() * rows.element_size()
    row = rows.stride(0) * rows.element_size()
    n_rows = piece_rows_for(row)
    piece = n_rows * row
    done: list[int] = []
    for off in range(0, total, piece):
        size = min(piece, total - off)
        err = rt.host_register(base + off, size, _HOST_REGISTER_PORTABLE)
        if err != 0:
            rt.clear_last_error()  # else the next kernel launch reports it as its own failure
            logger.warning(
                "host tier NOT PINNED: cudaHostRegister failed (%s) at %.2f of %.2f GB. %s",
                rt.error_string(err), off / 1e9, total / 1e9, PAGEABLE,
            )
            unregister_host(done)
            return [], None
        done.append(base + off)
    logger.info("pinned host tier: %.2f GB in %d piece(s)", total / 1e9, len(done))
    return done, n_rows


def unregister_host(ptrs: list[int]) -> None:
    rt = cuda_rt.runtime()
    for p in reversed(ptrs):
        err = rt.host_unregister(p)
        if err != 0:
            rt.clear_last_error()
            logger.warning("cudaHostUnregister failed (%s)", rt.error_string(err))
    ptrs.clear()


class UploadPool:
    """Reusable upload buffers; an entry is handed out only when ``is_free``.

    ``alloc(capacity)`` makes an entry (CUDA: pinned host + device buffer +
    event); ``is_free(entry)`` says its last upload finished. ``acquire``
    never waits: a busy pool grows by one entry. Entries come back in FIFO
    order, so the pool stays as large as the most uploads ever in flight.
    """

    def __init__(self, alloc: Callable[[int], Any], is_free: Callable[[Any], bool],
                 capacity: int, initial: int = 4):
        self._alloc = alloc
        self._is_free = is_free
        self.capacity = max(1, capacity)
        self.entries: collections.deque = collections.deque(alloc(self.capacity) for _ in range(initial))
        self.grown = 0  # entries added because all were busy (a busy step; logged once)

    def acquire(self, n: int) -> Any:
        """An entry that holds ``n`` values; the caller uploads into it next."""
        entry = None
        for _ in range(len(self.entries)):
            e = self.entries[0]
            self.entries.rotate(-1)  # oldest first: likeliest to be done
            if self._is_free(e):
                entry = e
                break
        if entry is None or n > entry_capacity(entry):
            if entry is None:
                if not self.grown:
                    logger.info("index upload pool: all %d buffers in flight; growing instead of waiting",
                                len(self.entries))
                self.grown += 1
            else:
                # Too small: replaced by a larger one. By identity: ``deque.remove`` compares entries with
                # ``==``, which on lists of tensors compares the tensors (an error, not an answer).
                del self.entries[next(i for i, e in enumerate(self.entries) if e is entry)]
            self.capacity = max(self.capacity, n)
            entry = self._alloc(self.capacity)
            self.entries.append(entry)
        return entry


def entry_capacity(entry) -> int:
    return entry[0].numel()


class IndexRing:
    """Index uploads of one lane: a pinned host buffer -> device buffer per job."""

    def __init__(self, stream: torch.cuda.Stream, capacity: int, depth: int = 4):
        self.stream = stream
        self.pool = UploadPool(self._entry, lambda e: e[2].query(), capacity, depth)

    def _entry(self, capacity: int) -> list[Any]:
        # Device buffers belong to the lane stream: when the pool drops one,
        # the allocator reuses it only behind the work queued on that stream.
        with torch.cuda.stream(self.stream):
            dev = torch.empty(capacity, dtype=torch.int64, device=self.stream.device)
        return [torch.empty(capacity, dtype=torch.int64, pin_memory=True), dev, torch.cuda.Event()]

    @property
    def device_bytes(self) -> int:
        return sum(entry_capacity(e) * 8 for e in self.pool.entries)

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        host, dev, ev = self.pool.acquire(len(arr))
        n = len(arr)
        host.numpy()[:n] = arr
        with torch.cuda.stream(self.stream):
            dev[:n].copy_(host[:n], non_blocking=True)
            ev.record(self.stream)
        # Kernels reading ``dev`` run later on this same stream, and any later
        # upload into ``dev`` is queued behind them on it: stream order keeps
        # the device side safe; the event guards only the host buffer.
        return dev[:n]


class CudaPipe:
    """Orders the staging halves between the lane stream (device side) and the copy stream (bus side).

    Before a side touches half ``b`` it waits for the other side's last use of ``b``; per-half events,
    never a host sync. A never-recorded event is already complete, so the first use waits for nothing.
    """

    def __init__(self, lane: torch.cuda.Stream, buffers: int, priority: int = 0):
        self.lane = lane
        self.copy = torch.cuda.Stream(device=lane.device, priority=priority)
        self._dev_done = [torch.cuda.Event() for _ in range(buffers)]
        self._bus_done = [torch.cuda.Event() for _ in range(buffers)]

    @contextlib.contextmanager
    def device(self, buf: int):
        self.lane.wait_event(self._bus_done[buf])
        with torch.cuda.stream(self.lane):
            yield
        self._dev_done[buf].record(self.lane)

    @contextlib.contextmanager
    def bus(self, buf: int):
        self.copy.wait_event(self._dev_done[buf])
        with torch.cuda.stream(self.copy):
            yield
        self._bus_done[buf].record(self.copy)

    def join(self) -> None:
        """The lane stream continues only after every memcpy queued so far (the job's end event follows)."""
        self.lane.wait_stream(self.copy)


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
        piece_rows: int | None = None,
        gather: str = "index",
    ):
        self.device = engine[0].device
        self.stream = torch.cuda.Stream(device=self.device, priority=priority)
        # At least two full pieces, so small rows still pipeline in pieces worth their Python work.
        piece_bytes = piece_bytes_for(layout.num_tensors)
        staging_slots = max(staging_slots, 2 * max(1, piece_bytes // host_rows.shape[1]))
        staging = torch.empty((staging_slots, host_rows.shape[1]), dtype=torch.int8, device=self.device)
        self._ring = IndexRing(self.stream, index_capacity)
        buffers = 2 if staging_slots >= 2 else 1
        self.copier = StagedCopier(
            engine, host_rows, PagedRows(staging, layout),
            upload=self._ring.upload, non_blocking=True, piece_rows=piece_rows,
            buffers=buffers, pipe=CudaPipe(self.stream, buffers, priority), piece_bytes=piece_bytes,
            make_mover=(lambda a: fused_gather.make_mover(a, self.device)) if gather == "fused" else None,
        )
        self.staging_bytes = staging.numel()
        # Device-sourced chunks: engine block to engine block on this stream (scratch made at first use).
        self.device_copier = DevicePageCopier(engine, layout.page_bytes, upload=self._ring.upload)
        self.inflight: collections.deque = collections.deque()
        self._free_events: list[torch.cuda.Event] = []

    @property
    def device_bytes(self) -> int:
        return self.staging_bytes + self._ring.device_bytes + self.device_copier.device_bytes

    def _event(self) -> torch.cuda.Event:
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    def submit(self, job, plan, to_host: bool, device_pages=()) -> int:
        start, end = self._event(), self._event()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            nbytes = self.copier.copy(plan, to_host) if plan.num_pages else 0
            if device_pages:
                job.device_nbytes = self.device_copier.copy(device_pages)
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
        self.copier.pipe.copy.synchronize()
        self.stream.synchronize()
