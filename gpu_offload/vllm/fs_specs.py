"""What the scheduler tells the workers about the file tier, and where files live.

The scheduler-side manager and the workers may be different processes, so
the manager never touches file bytes: it only decides, and the workers do
every read and write. What a worker needs travels in our subclasses of
vLLM's ``CPULoadStoreSpec`` (vLLM passes them through untouched):

* ``HostStoreSpec``: the chunk key of each slot (write-through publishes the
  slot under it) and the keys ``prepare_store`` evicted (write-back saves
  their bytes before the slots are reused).
* ``HostLoadSpec``: per slot, whether it must first be filled from its file
  (``promote``), plus keys evicted to make room for those slots.

A chunk file is per worker rank (its own KV shard), so each rank has its own
namespace, named by a ``LayoutFingerprint`` built from ``OffloadingConfig``
alone: the scheduler and every worker derive the same one without sharing
state. vLLM gives the spec bytes per block, not head shapes, so the per-rank
page bytes and the KV cache layout go into ``engine``; they determine
``kv_heads_per_rank * head_dim`` for a given model, dtype and layer count.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from tpu_offload.core.fs.format import HEADER_SIZE
from tpu_offload.core.fs import kdfsalt
from tpu_offload.core.fs.auth import Names
from tpu_offload.core.fs.deadline import BoundedCalls
from tpu_offload.core.fs.layout import published_stat
from tpu_offload.core.fs.reset import bind_weights, salted
from tpu_offload.core.keys import LayoutFingerprint

from gpu_offload.vllm.compat import CPULoadStoreSpec


class HostStoreSpec(CPULoadStoreSpec):
    """Host slots of a store, with their chunk keys, the request's ``cache_salt`` and this allocation's evictions.

    ``salt``: with the file tier's secret, the tenant whose keys name and
    sign the files (``core/fs/auth.py``); b"" without a salt.
    """

    def __init__(self, slots: Sequence[int], keys: Sequence[bytes], evicted: Sequence[bytes] = (),
                 salt: bytes = b"", epoch: str = ""):
        super().__init__(slots)
        self.keys = list(keys)
        self.evicted = list(evicted)
        self.salt = salt
        self.epoch = epoch  # the reset epoch: a worker on another moves its file tier to this one first


class HostLoadSpec(CPULoadStoreSpec):
    """Host slots of a load; ``promote[i]``: fill slot i from its file first.

    ``device_blocks[i]``: the engine block ids chunk i is copied from, when the
    device's own prefix cache holds it (``device_source``); its slot is -1.
    ``budget_s``: the load's hedge (``core/costs.py``); 0 for none.
    """

    def __init__(
        self, slots: Sequence[int], keys: Sequence[bytes], promote: Sequence[bool], evicted: Sequence[bytes] = (),
        salt: bytes = b"", epoch: str = "", device_blocks: Sequence[tuple[int, ...] | None] | None = None,
        budget_s: float = 0.0,
    ):
        super().__init__(slots)
        self.keys = list(keys)
        self.promote = np.asarray(promote, dtype=bool)
        self.evicted = list(evicted)
        self.salt = salt
        self.epoch = epoch
        self.device_blocks = list(device_blocks) if device_blocks is not None else None
        self.budget_s = budget_s  # load_decision auto: file reads not done this long after they start fail (the hedge)


def fingerprint(config, rank: int) -> LayoutFingerprint:
    """The namespace of worker ``rank``'s chunk files (from vLLM's ``OffloadingConfig``)."""
    groups = config.groups
    layers = {name for g in groups for name in g.layer_names}
    model = getattr(config, "model", None)
    engine = (
        f"vllm;bytes_per_block={config.worker_kv_bytes_per_block};"
        f"kv_layout={getattr(config, 'kv_cache_layout', None)};"
        f"groups={','.join(str(g.tokens_per_block) for g in groups)}"
    )
    fp = LayoutFingerprint(
        model=getattr(model, "name", "") or "model",
        dtype=getattr(model, "dtype", "") or "",
        block_size=groups[0].tokens_per_block if groups else 0,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        num_layers=len(layers),
        kv_heads_per_rank=0,  # implied by bytes_per_block in ``engine`` (see module docstring)
        head_dim=0,
        tp_rank=rank,
        tp_size=max(1, config.parallel.world_size),
        engine=engine,
    )
    # Bound to the weights (fs_reset_epoch_file's content) at start: files of older weights under the same model
    # name are never found. The scheduler and every worker read the same config, so they agree.
    extra = getattr(config, "extra_config", None) or {}
    epoch_file = extra.get("fs_reset_epoch_file") or os.environ.get("TPU_OFFLOAD_FS_RESET_EPOCH_FILE") or None
    return bind_weights(fp, epoch_file)


class FileView:
    """Read-only presence check over the chunk files of every worker rank.

    The scheduler's side of the file tier: one ``stat`` per rank, nothing
    written (but the deployment's salt file, ``kdfsalt``, if none is there
    yet), no threads, no index. A ``FileTier`` would create directories,
    write a probe file and scan the whole namespace at start, and its index
    would go stale as the workers' tiers evict or reject files; a stale
    "present" costs a failed load and a recompute. A chunk counts only if
    every rank has its file, since every rank must load its shard.
    """

    def __init__(self, root: str, fingerprints: Sequence[LayoutFingerprint], chunk_bytes: int,
                 secret: bytes | None = None, io_timeout_s: float | None = None):
        self.root = os.path.abspath(root)
        self._fps = list(fingerprints)
        # the workers' tiers name files the same way: the same secret, salted with the root's salt file
        # (made here if the scheduler is first: the one file it may write)
        self._auth = kdfsalt.auth_for_root(secret, self.root) if secret else None
        self.names = [Names(self.root, fp, self._auth) for fp in self._fps]
        self.ns_dirs = [n.ns_dir for n in self.names]
        self.file_bytes = HEADER_SIZE + chunk_bytes
        self.stats = 0  # stat calls made (tests, tuning)
        self.ranks_off = 0  # workers whose file tier is off (their reports): no file hits meanwhile
        # the scheduler thread never waits longer than fs_io_timeout_s on a hung mount: a miss instead
        self._bounded = BoundedCalls(io_timeout_s, name="fs-view-stat") if io_timeout_s else None

    def reset(self, epoch: str) -> None:
        """Look only in the namespaces of reset ``epoch`` from now on (``core/fs/reset.py``)."""
        self.names = [Names(self.root, salted(fp, epoch), self._auth) for fp in self._fps]
        self.ns_dirs = [n.ns_dir for n in self.names]

    def note(self, meta) -> None:
        """A step's worker reports (``FileTierWorkerMetadata``): which ranks' tiers turned off or came back."""
        self.ranks_off = max(0, self.ranks_off + getattr(meta, "fs_off_delta", 0))

    def contains(self, key: bytes, salt: bytes = b"") -> bool:
        """``salt``: the request's ``cache_salt`` (names differ per tenant with a secret).

        False while any rank's tier is off: that rank cannot load its shard,
        so a file hit would only fail the load and recompute.
        """
        if self.ranks_off:
            return False
        for names in self.names:
            try:
                khex = names.file_id(key, salt).hex()
            except ValueError:
                return False
            self.stats += 1
            # Never os.stat: it follows a symlink planted at the key or on the way, and counts a FIFO.
            st = published_stat(names.ns_dir, khex) if self._bounded is None else \
                self._bounded.call(published_stat, names.ns_dir, khex)
            if st is None or st.st_size != self.file_bytes:
                return False
        return True
