"""Vectored file I/O straight from and into numpy slot views.

``os.pwritev``/``os.preadv`` release the GIL and take the slot view itself,
so a chunk crosses between host RAM and the file with no Python-side copy.
``O_DIRECT`` is used only where it is legal (page-aligned address, length and
offset); anything else takes the buffered path, so callers never need to know.
"""

from __future__ import annotations

import errno
import os

import numpy as np

PAGE = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

# Fault injection at the syscall wrapper (tests): called with "read", "write" or "stat" before each
# preadv / pwritev / presence stat of the file tier; it may sleep (a hung mount) or raise OSError.
fault = None


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def byte_view(arr: np.ndarray, *, writable: bool = False) -> memoryview:
    """A flat byte view of a contiguous array; refuses a copy in disguise."""
    if not isinstance(arr, np.ndarray):
        mv = memoryview(arr)
        if not mv.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        return mv.cast("B")
    if not arr.flags.c_contiguous:
        raise ValueError("chunk array must be C-contiguous (a slot row view)")
    if writable and not arr.flags.writeable:
        raise ValueError("read target is not writable")
    return memoryview(arr.reshape(-1).view(np.uint8))


def direct_ok(mv: memoryview) -> bool:
    """Can this buffer go through O_DIRECT as-is?"""
    if not O_DIRECT or len(mv) % PAGE:
        return False
    addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if len(mv) else 0
    return addr % PAGE == 0


def write_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """pwritev until every byte is down (short writes are legal, if rare)."""
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        if fault is not None:
            fault("write")
        n = os.pwritev(fd, bufs, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n
        bufs = _advance(bufs, n)
    return done


def read_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """preadv until the buffers are full or the file ends; returns bytes read."""
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        if fault is not None:
            fault("read")
        n = os.preadv(fd, bufs, offset + done)
        if n == 0:
            break
        done += n
        bufs = _advance(bufs, n)
    return done


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def is_direct_refusal(e: OSError) -> bool:
    """The filesystem (or this buffer) does not do O_DIRECT: retry buffered."""
    return e.errno in (errno.EINVAL, errno.EOPNOTSUPP)
