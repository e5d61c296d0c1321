"""vLLM's scheduler offers no file hits while a worker rank's tier is off.

The rank's tier journals ``tier_off`` / ``tier_on``; the worker metadata
carries the change (summed over ranks by vLLM's aggregator) and the
manager's ``FileView`` stops answering "present" until the tier is back: a
hit there would only fail the load and recompute.
"""

from __future__ import annotations

import os
import time

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from tpu_offload.core.fs import FileTier, TierState
from tpu_offload.core.fs.journal import FileJournal
from gpu_offload.vllm.file_events import FileTierWorkerMetadata
from gpu_offload.vllm.fs_specs import fingerprint
from test_gpu_fs_manager import CHUNK, CTX, cfg, key, mgr, publish  # noqa: F401  (fixtures)


def _report(*tiers):
    metas = [FileTierWorkerMetadata.wrap(None, t.journal.take()) for t in tiers]
    out = metas[0]
    for m in metas[1:]:
        out = out.aggregate(m)
    return out


def test_no_file_hits_while_a_ranks_tier_is_off(tmp_path, cfg, mgr):
    publish(tmp_path, cfg, 0, [key(1)])
    ns = mgr.files.ns_dirs[0]
    os.chown(ns, 65534, 65534)  # another uid's: the worker's tier is off
    tier = FileTier(str(tmp_path), fingerprint(cfg, 0), CHUNK, capacity_bytes=None, threads=1)
    try:
        tier.journal = FileJournal()
        assert tier.state is TierState.OFF
        meta = _report(tier)
        assert meta.has_files() and meta.fs_off_delta == 1
        mgr.note_file_outcomes(meta)
        assert mgr.lookup(key(1), CTX) is LookupResult.MISS, "a file hit offered while the rank's tier is off"
        os.chown(ns, os.geteuid(), os.getegid())
        tier._retry_at = time.monotonic()  # its readonly_retry_s has passed
        tier.contains(key(1))
        end = time.monotonic() + 10
        while tier.state is TierState.OFF and time.monotonic() < end:
            time.sleep(0.02)
        assert tier.state is TierState.RW
        mgr.note_file_outcomes(_report(tier))
        assert mgr.lookup(key(1), CTX) is LookupResult.HIT
    finally:
        tier.close()
