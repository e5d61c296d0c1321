"""Which leading chunks of a request the tiers can serve: the scheduler's lookups, with no side effects.

Apart from the scheduler because vLLM asks again for every retry of a waiting request, so these walks
must change nothing, and because two callers share them: the lookup (``get_num_new_matched_tokens``)
and the allocation, which walks again what its lookup offered. Each walk stops where a chunk is in no
tier, is quarantined (proved bad), or only exists as a file that already failed to promote; a file
chunk also needs a host slot to be promoted into, so the walk stops where the file chunks so far would
exceed the slots free or evictable (a promotion that cannot get a slot would be a load error, and vLLM
would ask again: a livelock). Works on the scheduler's index and state (``sched``), as
``connector/stores.py`` does.
"""

from __future__ import annotations

from tpu_offload.core.keys import ChunkKey
from tpu_offload.core.manager import Lookup


class TierLookups:
    def __init__(self, sched):
        self.sched = sched

    def ready(self, keys: list[ChunkKey], start: int = 0) -> int:
        """Leading chunks (from ``start``) the host tier holds and none of them quarantined."""
        s = self.sched
        n = start + s.manager.lookup_prefix(keys[start:] if start else keys)
        if s._quarantine:
            for i in range(start, n):
                if keys[i] in s._quarantine:
                    return i
        return n

    def prefix(self, keys: list[ChunkKey], salt: bytes = b"", start: int = 0) -> tuple[int, list[bool]]:
        """Leading chunks any tier can serve (host, other DP ranks', then files), and which of them
        only exist as files; sliding-window tails cut it where a tail ends (connector/tails.py).
        ``start``: chunks before it are in HBM (exclusive: not on the host)."""
        s = self.sched
        n = self.ready(keys, start)
        if s.shared is not None:  # then the chunks other DP ranks stored
            n = s.shared.extend(keys, n)
        on_fs = [False] * n
        if s.fs is not None:
            st = s.manager.stats()
            room = st.capacity_chunks - st.pinned_chunks - st.pending_chunks - n
            n_fs = 0
            while n < len(keys):
                k = keys[n]
                state = s.manager.lookup(k)
                if state is Lookup.HIT and k not in s._quarantine:
                    on_fs.append(False)
                    room -= 1
                elif state is Lookup.MISS and not s._fs_off and k not in s._fs_bad and s.fs.contains(k, salt):
                    on_fs.append(True)
                    n_fs += 1
                else:
                    break
                if n_fs > room:
                    on_fs.pop()
                    break
                n += 1
        if n:
            n = s.tails.hit(keys, n, on_fs)
            on_fs = on_fs[:n]
        return n, on_fs

    def walk(self, request, keys: list[ChunkKey], salt: bytes, first: int, limit: int | None = None,
             exclude=frozenset()) -> tuple[int, list[bool], list[list[int] | None]]:
        """Interleaved lookups: chunks from ``first`` (vLLM's own hit ends in it) on, each from HBM (its
        block ids), else the host or file tier (None); stops at the first chunk neither holds.

        ``limit`` (the allocation re-walking what its lookup offered): exactly that many chunks, a chunk
        that left HBM since the lookup (vLLM handed out its blocks) taken from the tiers, else marked
        ``[]`` (a load error: recomputed). File chunks stop where their promotions would exceed the
        host slots free or evictable, as ``prefix``'s do."""
        s = self.sched
        on_fs: list[bool] = [False] * first
        src: list[list[int] | None] = [None] * first
        st = s.manager.stats()
        room = st.capacity_chunks - st.pinned_chunks - st.pending_chunks
        n, n_fs, end = first, 0, len(keys) if limit is None else min(limit, len(keys))
        while n < end:
            k = keys[n]
            ids = s.hbm.chunk_blocks(request, n, exclude)
            fs = False
            if ids is None:
                if s.manager.lookup(k) is Lookup.HIT and k not in s._quarantine:
                    room -= 1
                elif s.fs is not None and not s._fs_off and k not in s._fs_bad \
                        and s.manager.lookup(k) is Lookup.MISS and s.fs.contains(k, salt):
                    fs = True
                    n_fs += 1
                elif limit is not None:
                    ids = []  # offered by the lookup, gone now: a load error
                else:
                    break
                if n_fs > room:  # the file chunks so far could not all get a host slot
                    if limit is None:
                        break
                    n_fs -= fs
                    ids, fs = [], False
            on_fs.append(fs)
            src.append(ids)
            n += 1
        return n, on_fs, src
