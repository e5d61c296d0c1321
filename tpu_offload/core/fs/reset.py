"""The file tier after a cache reset (a weight update): a new namespace, shared by replicas that reset together.

Why: KV computed with the old weights must never be found again, from any
tier, so a reset moves the tier to a namespace salted for it (the old one is
retired: its files deleted by their owner). Why not a random salt: replicas
that reset together would never share files again. So the salt is derived
from ``fs_reset_epoch_file``, which the operator rewrites (e.g. with the
weights version) before resetting; only without one, if it cannot be read,
or if it did not change since the last reset (reusing the salt would serve
the old weights' KV) is it random, with one warning per reset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import uuid

from tpu_offload.core.keys import LayoutFingerprint

log = logging.getLogger("tpu_offload.fs")


def reset_salt(epoch_file: str | None, previous: str) -> str:
    """The namespace salt after a reset (see the module docstring)."""
    why = "fs_reset_epoch_file is not set"
    if epoch_file:
        try:
            with open(epoch_file, "rb") as f:
                epoch = f.read(4097).strip()
            if not epoch or len(epoch) > 4096:
                raise ValueError(f"{len(epoch)} bytes; allowed 1..4096")
            salt = "epoch-" + hashlib.blake2b(epoch, digest_size=16, person=b"tpuoff-reset").hexdigest()
            if salt != previous:
                return salt
            why = f"{epoch_file} did not change since the last reset"
        except (OSError, ValueError) as e:
            why = f"{epoch_file} unreadable ({e})"
    log.warning("tpu_offload: cache reset: %s; the file tier moves to a random namespace, so this replica "
                "shares no files with others until they restart", why)
    return uuid.uuid4().hex


def weights_identity(epoch_file: str | None, revision: str | None = None) -> str:
    """What names the weights at start: the model revision and the ``fs_reset_epoch_file``'s content ("" if neither).

    Bound into the namespace and the snapshot at start, not only at a
    reset: KV (files or a whole snapshot) of older weights under the same
    model name is then never found by an engine started on newer ones.
    """
    parts = []
    if revision:
        parts.append(b"rev:" + str(revision).encode())
    if epoch_file:
        try:
            with open(epoch_file, "rb") as f:
                epoch = f.read(4097).strip()
            if epoch and len(epoch) <= 4096:
                parts.append(b"epoch:" + epoch)
            else:
                log.warning("tpu_offload: fs_reset_epoch_file %s holds %d bytes (allowed 1..4096); not used to name "
                            "the weights", epoch_file, len(epoch))
        except OSError as e:
            log.warning("tpu_offload: fs_reset_epoch_file %s unreadable at start (%s); the file tier and the "
                        "snapshot are bound to the model name and layout only", epoch_file, e.strerror or e)
    if not parts:
        return ""
    return hashlib.blake2b(b"\0".join(parts), digest_size=16, person=b"tpuoff-weights").hexdigest()


def bind_weights(fp: LayoutFingerprint, epoch_file: str | None, revision: str | None = None) -> LayoutFingerprint:
    """``fp`` bound to the weights (``weights_identity``); unchanged when nothing names them."""
    ident = weights_identity(epoch_file, revision)
    return fp if not ident else dataclasses.replace(fp, cache_salt=f"{fp.cache_salt}weights:{ident};")


def salted(fp: LayoutFingerprint, salt: str) -> LayoutFingerprint:
    """The namespace after a reset: KV written before it (old weights) is never found again."""
    return fp if not salt else dataclasses.replace(fp, cache_salt=f"{fp.cache_salt}reset:{salt}")
