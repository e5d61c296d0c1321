"""The scheduler's file presence check on a shared volume: another tenant's symlink,
FIFO or directory at a key path is a miss, never one of our chunks."""

import os

import pytest

from tpu_offload.connector.fs import FsLookup
from tpu_offload.core.config import OffloadConfig
from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.layout import chunk_dir_and_path, key_hex
from tpu_offload.core.keys import LayoutFingerprint, make_chunk_key

import numpy as np

FP = LayoutFingerprint("tiny", "float32", 16, 1, 2, 2, 64)
CHUNK = 4096
KEY = make_chunk_key(b"\x07" * 32)


def publish(root):
    with FileTier(str(root), FP, CHUNK, capacity_bytes=None, threads=1) as tier:
        assert tier.submit_write(KEY, np.full(CHUNK, 7, np.uint8)) is not None
        tier.flush()


@pytest.mark.parametrize("plant", ["none", "symlink_file", "symlink_dir", "fifo", "directory"])
def test_lookup_counts_only_our_regular_files(tmp_path, plant):
    root, outside = tmp_path / "root", tmp_path / "outside"
    publish(outside)  # a real chunk, outside our root
    lookup = FsLookup(OffloadConfig(shared_storage_path=str(root)), FP)
    d, path = chunk_dir_and_path(lookup.ns_dir, key_hex(KEY))
    real_dir, real = chunk_dir_and_path(os.path.join(str(outside), FP.namespace()), key_hex(KEY))
    if plant == "none":
        publish(root)
    elif plant == "symlink_dir":
        os.makedirs(os.path.dirname(d), exist_ok=True)
        os.symlink(real_dir, d)
    else:
        os.makedirs(d, exist_ok=True)
        {"symlink_file": lambda: os.symlink(real, path), "fifo": lambda: os.mkfifo(path),
         "directory": lambda: os.mkdir(path)}[plant]()
    assert lookup.contains(KEY) is (plant == "none")


def test_lookup_with_a_secret_names_files_like_the_workers_tier(tmp_path):
    """With ``fs_secret`` the worker's tier names files by keyed hashes; the scheduler must derive the same."""
    secret = b"a-secret-of-32-bytes-0123456789ab"
    with FileTier(str(tmp_path), FP, CHUNK, capacity_bytes=None, threads=1, secret=secret) as tier:
        assert tier.submit_write(KEY, np.full(CHUNK, 7, np.uint8)).wait(10)
    assert FsLookup(OffloadConfig(shared_storage_path=str(tmp_path), fs_secret=secret), FP).contains(KEY)
    assert not FsLookup(OffloadConfig(shared_storage_path=str(tmp_path)), FP).contains(KEY)
