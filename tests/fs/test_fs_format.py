"""The chunk file header and the directory layout."""

from __future__ import annotations

import os
import stat
import struct

import numpy as np
import pytest

from fs_helpers import CHUNK, key, layout, payload
from tpu_offload.core.fs import layout as fslayout
from tpu_offload.core.fs.fileio import aligned_empty
from tpu_offload.core.fs.format import (
    HEADER_SIZE, MAGIC, VERSION, HeaderError, check_header, pack_header, parse_header, payload_checksum,
)


def _header(k=None, digest=None, n=CHUNK, chk=1234):
    buf = aligned_empty(HEADER_SIZE)
    pack_header(buf, digest or layout().digest(), k or key(1), n, chk)
    return buf


def test_header_round_trip():
    fp = layout()
    data = payload(7)
    buf = _header(key(7), fp.digest(), len(data), payload_checksum(data))
    h = parse_header(buf)
    assert (h.version, h.digest, h.key, h.payload_len) == (VERSION, fp.digest(), key(7), CHUNK)
    assert h.checksum == payload_checksum(data)
    assert bytes(buf[:8]) == MAGIC
    assert check_header(h, fp.digest(), key(7), CHUNK) is None
    assert check_header(h, layout(dtype="float16").digest(), key(7), CHUNK) == "layout"
    assert check_header(h, fp.digest(), key(8), CHUNK) == "key"
    assert check_header(h, fp.digest(), key(7), CHUNK - 4096) == "length"


@pytest.mark.parametrize("offset", [0, 7, 9, 12, 20, 35, 41, 49, 55, 4000, 4090])
def test_any_flipped_header_byte_is_refused(offset):
    buf = _header()
    buf[offset] ^= 0x10
    with pytest.raises(HeaderError) as e:
        parse_header(buf)
    expected = "magic" if offset < 8 else "version" if offset < 10 else "header_checksum"
    assert e.value.reason == expected


def test_foreign_version_with_a_valid_header_is_refused_as_version():
    buf = _header()
    struct.pack_into("<H", buf, 8, VERSION + 1)
    with pytest.raises(HeaderError) as e:
        parse_header(buf)
    assert e.value.reason == "version"


def test_short_header_is_truncated():
    with pytest.raises(HeaderError) as e:
        parse_header(_header()[:100])
    assert e.value.reason == "truncated"


def test_keys_must_fit_a_file_name():
    with pytest.raises(ValueError):
        fslayout.key_hex(b"")
    with pytest.raises(ValueError):
        fslayout.key_hex(b"x" * 121)
    with pytest.raises(ValueError):
        pack_header(aligned_empty(HEADER_SIZE), layout().digest(), b"x" * 121, 1, 1)


def test_paths_never_leave_the_namespace():
    ns = "/srv/cache/ns"
    for k in [b"../../etc/passwd", b"/abs", b"\x00\xff" * 20, key(3)]:
        p = fslayout.chunk_path(ns, fslayout.key_hex(k))
        assert os.path.commonpath([ns, os.path.normpath(p)]) == ns
        name = os.path.basename(p)
        assert fslayout.is_chunk_name(name) and name == k.hex()
        assert p == os.path.join(ns, name[0:2], name[2:4], name)
        assert fslayout.chunk_dir_and_path(ns, name) == (os.path.dirname(p), p)
    assert not fslayout.is_chunk_name(".tmp.abcd.1.ff")
    assert not fslayout.is_chunk_name("abc")  # odd length
    assert not fslayout.is_chunk_name("ABCD")  # we only write lowercase


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o022])
@pytest.mark.parametrize("dir_mode,file_mode", [(0o700, 0o600), (0o750, 0o640)])
def test_modes_do_not_depend_on_the_umask(root, make_tier, umask, dir_mode, file_mode):
    """Ours alone by default (another uid cannot even list the names); 0750 lets a group read."""
    old = os.umask(umask)
    try:
        t = make_tier(root, dir_mode=dir_mode)
        assert t.submit_write(key(1), payload(1)).wait(10)
        assert t.flush(10)
    finally:
        os.umask(old)
    path = t.path_of(key(1))
    assert stat.S_IMODE(os.stat(path).st_mode) == file_mode
    d = os.path.dirname(path)
    while d != root:
        assert stat.S_IMODE(os.stat(d).st_mode) == dir_mode, d
        d = os.path.dirname(d)


def test_file_is_header_then_payload(root, make_tier, fp):
    t = make_tier(root)
    data = payload(5)
    assert t.submit_write(key(5), data).wait(10)
    raw = np.fromfile(t.path_of(key(5)), dtype=np.uint8)
    assert raw.nbytes == HEADER_SIZE + CHUNK
    h = parse_header(raw[:HEADER_SIZE])
    assert h.key == key(5) and h.digest == fp.digest()
    assert np.array_equal(raw[HEADER_SIZE:], data)
    assert h.checksum == payload_checksum(data)


@pytest.mark.parametrize("value,ok", [("0750", 0o750), ("700", 0o700), (0o750, 0o750), ("0777", None),
                                      ("0755", None), ("rwx", None)])
def test_dir_mode_setting(value, ok):
    from tpu_offload.core.config import ConfigError, OffloadConfig

    if ok is not None:
        assert OffloadConfig.from_sources({"fs_dir_mode": value}, env={}).fs_dir_mode == ok
        return
    with pytest.raises(ConfigError, match=r"'fs_dir_mode': value .* allowed: '0700'"):
        OffloadConfig.from_sources({"fs_dir_mode": value}, env={})
