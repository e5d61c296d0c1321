"""How much of a namespace's temp files counts against its budget: one rule for the tier and the CLI.

Why a cap: a temp file is a write in progress, so it counts in the budget
(the bytes are on disk), and a temp that starts with one of our signed
headers verifies like a write of ours. Anyone who can write the namespace
can copy one of our files under temp names; counted in full, those copies
make the budget evict every real chunk (14 copies under a 16-file budget:
16 of 16 chunks gone). So the temps that count are at most
``writes_per_writer`` per writer (a writer has that many I/O threads) and at
most ``temp_cap_bytes(capacity)`` in all, newest first; the rest is junk:
never counted, and the CLI deletes it before any chunk when it evicts.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

TEMP_SHARE = 4  # temps count for at most 1/TEMP_SHARE of the capacity


def temp_cap_bytes(capacity_bytes: int | None) -> int | None:
    """The bytes of temps that may count in a budget of ``capacity_bytes`` (None: no budget, no cap)."""
    return None if capacity_bytes is None else capacity_bytes // TEMP_SHARE


def writer_of(name: str) -> str:
    """The writer a temp name was made by: its pid, host tag and token (``layout.temp_name``)."""
    return name.split(".", 3)[-1].rsplit(".", 1)[0]


def split_temps(temps: Iterable[T], *, name: Callable[[T], str], size: Callable[[T], int],
                mtime: Callable[[T], float], cap_bytes: int | None,
                writes_per_writer: int | None = None) -> tuple[int, list[T]]:
    """(bytes the temps count for, the temps over the cap), the newest counted first.

    A temp counts if its writer has fewer than ``writes_per_writer`` newer
    ones and the counted bytes have not reached ``cap_bytes`` yet (the one
    that crosses the cap counts up to it). An empty temp (a write just
    begun) always counts, for nothing.
    """
    counted, over = 0, []
    per_writer: dict[str, int] = {}
    for t in sorted(temps, key=mtime, reverse=True):
        n = size(t)
        w = writer_of(name(t))
        per_writer[w] = per_writer.get(w, 0) + 1
        if n and ((writes_per_writer is not None and per_writer[w] > writes_per_writer)
                  or (cap_bytes is not None and counted >= cap_bytes)):
            over.append(t)
            continue
        counted += n if cap_bytes is None else min(n, cap_bytes - counted)
    return counted, over
