"""Authenticated chunks and names that reveal nothing (a secret shared by the replicas of one tenant).

Each attack is staged for real on the disk: another tenant rewrites a
chunk's payload and fixes every public checksum, writes an unsigned file
under the right name, or signs with its own secret; a lister computes the
names of candidate prompts. Without a secret the first attack is served (the
reason for this suite); with one, every forged file is a miss, counted in
its own metric, left in place, and never served.
"""

from __future__ import annotations

import logging
import os
import struct
import time

import numpy as np
import pytest
import xxhash

from fs_helpers import CHUNK, aligned, key, layout, payload, filled, write_all
from tpu_offload.core.config import ConfigError, OffloadConfig
from tpu_offload.core.fs import FileTier
from tpu_offload.core.fs.auth import FsAuth, Names, check_secret, make_secret_file, secret_weakness
from tpu_offload.core.fs.chunkfile import ChunkFiles
from tpu_offload.core.fs.format import HEADER_SIZE, parse_header

SECRET = b"1BcfxCZ6L5sgxr5a00FSSelvv+17IUMhrwMy+RWd+I0="  # 32 random bytes, base64
OTHER_SECRET = b"Tvg5s8Y1km2aGL7tigmImQcyDpREuVt6j9fqICZvOqA="


def _forge_payload(path: str, evil: np.ndarray) -> None:
    """What any tenant with write access can do: keep the public header, swap the payload, fix both xxh3s."""
    with open(path, "rb") as f:
        hdr = bytearray(f.read(HEADER_SIZE))
    struct.pack_into("<Q", hdr, 40, xxhash.xxh3_64_intdigest(evil.tobytes()))
    struct.pack_into("<Q", hdr, HEADER_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(hdr[: HEADER_SIZE - 8])))
    tmp = path + ".forging"
    with open(tmp, "wb") as f:
        f.write(bytes(hdr) + evil.tobytes())
    os.rename(tmp, path)


def _auth_failures(t) -> float:
    return t.fs_metrics.registry.get_sample_value("tpu_offload_fs_auth_failures_total", {"tier": t.name}) or 0.0


def _read(t, i):
    out = aligned()
    out[:] = 0xAB
    return t.read_into(key(i), out), out


def test_forged_payload_is_served_without_a_secret(root, make_tier):
    """The attack itself: a checksum is not authentication (today's behaviour, kept without a secret)."""
    t = make_tier(root)
    write_all(t, 1)
    evil = payload(666)
    _forge_payload(t.path_of(key(1)), evil)
    ok, out = _read(t, 1)
    assert ok and np.array_equal(out, evil)


def test_forged_payload_is_a_miss_counted_and_left_in_place(root, make_tier):
    t = make_tier(root, secret=SECRET)
    write_all(t, 1, 2)
    path = t.path_of(key(1))
    _forge_payload(path, payload(666))
    ok, out = _read(t, 1)
    assert not ok, "a forged chunk was served"
    assert t.counters()["auth_failures"] == 1 and _auth_failures(t) == 1
    assert "corrupt" not in t.counters(), "a forgery is not damage: counted on its own"
    assert os.path.exists(path), "a file someone else made is not ours to delete"
    assert _read(t, 2)[0], "the real chunks are still served"
    assert not _read(t, 1)[0] and _auth_failures(t) == 2


def test_unsigned_and_foreign_signed_files_are_refused(root, make_tier):
    t = make_tier(root, secret=SECRET)
    write_all(t, 1, 2)
    # Someone without the MAC key writes a well-formed file under the right name (header copied: no MAC).
    unsigned = ChunkFiles(t.ns_dir, t.names.digest)
    fid = bytes.fromhex(os.path.basename(t.path_of(key(1))))
    unsigned.write(fid, fid.hex(), memoryview(payload(7)))
    # Another tenant signs with its own secret, in our namespace, under our name.
    other = FsAuth(OTHER_SECRET).tenant(layout().digest())
    fid2 = bytes.fromhex(os.path.basename(t.path_of(key(2))))
    ChunkFiles(t.ns_dir, t.names.digest).write(fid2, fid2.hex(), memoryview(payload(8)), tk=other)
    unsigned.close()
    assert not _read(t, 1)[0] and not _read(t, 2)[0]
    assert t.counters()["auth_failures"] == 2


def test_keys_are_per_tenant_salt():
    """A chunk signed for one salt does not verify (and is not even named alike) for another."""
    auth = FsAuth(SECRET)
    a, b = auth.tenant(layout().digest(), b"salt-a"), auth.tenant(layout().digest(), b"salt-b")
    assert a.file_id(key(1)) != b.file_id(key(1))
    hdr, body = memoryview(bytes(4056)), memoryview(payload(1).tobytes())
    assert a.mac_ok(hdr, body, a.mac(hdr, body)) and not b.mac_ok(hdr, body, a.mac(hdr, body))
    assert auth.tenant(layout(model="x").digest()).file_id(key(1)) != auth.tenant(layout().digest()).file_id(key(1))


def test_listing_and_headers_reveal_nothing(root, make_tier):
    """A lister who computes the keys of candidate prompts finds none of them; headers hold no key."""
    t = make_tier(root, secret=SECRET)
    write_all(t, *range(1, 9))
    fp = layout()
    ns = os.path.basename(t.ns_dir)
    assert "llama" not in ns and fp.digest().hex() not in ns and ns != fp.namespace()
    names = {f for _, _, files in os.walk(t.ns_dir) for f in files}
    assert len(names) == 8
    for i in range(1, 9):
        assert key(i).hex() not in names
        with open(t.path_of(key(i)), "rb") as f:
            hdr = f.read(HEADER_SIZE)
        assert bytes(key(i)) not in hdr and fp.digest() not in hdr
        assert parse_header(hdr).mac
    assert not os.path.exists(os.path.join(root, fp.namespace()))


def test_replicas_with_one_secret_share_and_others_do_not(root, make_tier):
    a = make_tier(root, secret=SECRET)
    write_all(a, 1)
    b = make_tier(root, secret=SECRET)
    ok, out = _read(b, 1)
    assert ok and np.array_equal(out, payload(1))
    c = make_tier(root, secret=OTHER_SECRET)
    plain = make_tier(root)
    assert not c.contains(key(1)) and not _read(c, 1)[0]
    assert not plain.contains(key(1)) and not _read(plain, 1)[0]


def test_lookups_name_files_like_the_tier(root, make_tier):
    """The scheduler's read-only view derives the same names from the same secret and salt file."""
    from tpu_offload.core.fs import kdfsalt

    t = make_tier(root, secret=SECRET)
    write_all(t, 1)
    n = Names(root, layout(), kdfsalt.auth_for_root(SECRET, root, create=False))
    assert n.ns_dir == t.ns_dir
    assert Names(root, layout(), FsAuth(SECRET)).ns_dir != t.ns_dir  # the fixed salt: another deployment's names
    assert os.path.join(n.ns_dir, *_fan(n.file_id(key(1)).hex())) == t.path_of(key(1))
    assert Names(root, layout()).ns_dir != t.ns_dir


def _fan(h):
    return h[0:2], h[2:4], h


def test_no_secret_says_once_that_the_tier_is_unauthenticated(root, make_tier, caplog, monkeypatch):
    from tpu_offload.core.fs import tier as tier_mod

    monkeypatch.setattr(tier_mod, "_UNAUTH_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="tpu_offload.auth"):
        make_tier(root)
        make_tier(root)
        make_tier(root, secret=SECRET)
    msgs = [r.getMessage() for r in caplog.records if r.name == "tpu_offload.auth"]
    assert len(msgs) == 1 and "unauthenticated" in msgs[0]


# ---- configuration: the secret comes from a file or the environment, never from JSON ----


def test_secret_from_a_file_or_the_environment(tmp_path, root, fp):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    cfg = OffloadConfig.from_sources({"shared_storage_path": root, "fs_secret_file": str(f)}, env={})
    assert cfg.fs_secret == SECRET and SECRET.decode() not in repr(cfg)
    cfg2 = OffloadConfig.from_sources({"shared_storage_path": root}, env={"TPU_OFFLOAD_FS_SECRET": SECRET.decode()})
    assert cfg2.fs_secret == SECRET
    from tpu_offload.core.fs import FileTier

    t = FileTier.from_config(cfg, fp, CHUNK)
    try:
        assert t.authenticated
    finally:
        t.close()


@pytest.mark.parametrize("extra,env,needle", [
    ({"fs_secret": SECRET.decode()}, {}, "never goes in a config JSON"),
    ({}, {"TPU_OFFLOAD_FS_SECRET": "short"}, "TPU_OFFLOAD_FS_SECRET: value <hidden"),
    ({"fs_secret_file": "/nonexistent/secret"}, {}, "'fs_secret_file': value '/nonexistent/secret'"),
    ({"fs_secret_file": "relative/secret"}, {}, "an absolute path"),
])
def test_bad_secret_settings_name_key_and_allowed_and_never_echo_the_secret(extra, env, needle):
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources(extra, env=env)
    msg = str(e.value)
    assert needle in msg and "allowed" in msg.lower()
    assert SECRET.decode() not in msg and "short" not in msg


def test_a_secret_file_and_a_secret_in_env_conflict(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    with pytest.raises(ConfigError, match="set only one"):
        OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={"TPU_OFFLOAD_FS_SECRET": SECRET.decode()})


def test_a_fifo_as_secret_file_is_refused_without_blocking(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    with pytest.raises(ConfigError, match="regular file"):
        OffloadConfig.from_sources({"fs_secret_file": str(p)}, env={})



def test_a_tier_names_and_signs_each_request_salt_apart(root, make_tier):
    t = make_tier(root, secret=SECRET)
    assert t.submit_write(key(1), filled(1), b"tenant-a").wait(30)
    out = aligned()
    assert t.read_into(key(1), out, b"tenant-a") and np.array_equal(out, payload(1))
    assert t.contains(key(1), b"tenant-a") and not t.contains(key(1), b"tenant-b") and not t.contains(key(1))
    assert not t.read_into(key(1), out, b"tenant-b") and not t.read_into(key(1), out)
    # Tenant b's file planted under tenant a's name: it verifies under b's keys only.
    b_path, a_path = t.path_of(key(2), b"tenant-b"), t.path_of(key(2), b"tenant-a")
    assert t.submit_write(key(2), filled(666), b"tenant-b").wait(30)
    os.makedirs(os.path.dirname(a_path), exist_ok=True)
    os.rename(b_path, a_path)
    assert not t.read_into(key(2), out, b"tenant-a")
    assert t.counters()["corrupt_key"] == 1  # its header names tenant b's file id


# ---- encryption at rest (fs_encrypt) ------------------------------------------------


def test_encrypted_chunks_round_trip_and_hold_no_plaintext(root, make_tier):
    t = make_tier(root, secret=SECRET, encrypt=True)
    write_all(t, 1, 2)
    with open(t.path_of(key(1)), "rb") as f:
        raw = f.read()
    body = payload(1).tobytes()
    assert body[:64] not in raw and body[-64:] not in raw and len(raw) == HEADER_SIZE + CHUNK
    assert parse_header(raw[:HEADER_SIZE]).flags & 2
    ok, out = _read(t, 1)
    assert ok and np.array_equal(out, payload(1))
    plain = make_tier(root, secret=SECRET)  # a replica without fs_encrypt still reads them (same keys)
    ok, out = _read(plain, 2)
    assert ok and np.array_equal(out, payload(2))


def test_a_forged_encrypted_chunk_fails_its_tag(root, make_tier):
    t = make_tier(root, secret=SECRET, encrypt=True)
    write_all(t, 1)
    _forge_payload(t.path_of(key(1)), payload(666))  # checksums fixed: only the GCM tag can tell
    assert not _read(t, 1)[0] and t.counters()["auth_failures"] == 1
    other = make_tier(root, secret=OTHER_SECRET, encrypt=True)
    assert not other.contains(key(1))


def test_encrypt_needs_a_secret(tmp_path):
    with pytest.raises(ConfigError, match="fs_encrypt.*without a secret"):
        OffloadConfig.from_sources({"fs_encrypt": True}, env={})
    assert OffloadConfig.from_sources({"fs_encrypt": "true"}, env={"TPU_OFFLOAD_FS_SECRET": SECRET.decode()}).fs_encrypt


def test_gmac_chunks_round_trip_and_forgeries_fail(root, make_tier):
    """``fs_mac: gmac``: the AES-GCM tag over payload and header, several times HMAC's speed."""
    t = make_tier(root, secret=SECRET, mac="gmac")
    write_all(t, 1, 2)
    with open(t.path_of(key(1)), "rb") as f:
        assert parse_header(f.read(HEADER_SIZE)).flags & 4
    ok, out = _read(t, 1)
    assert ok and np.array_equal(out, payload(1))
    hm = make_tier(root, secret=SECRET)  # an HMAC replica with the same secret verifies them too
    assert _read(hm, 2)[0]
    _forge_payload(t.path_of(key(1)), payload(666))
    assert not _read(t, 1)[0] and t.counters()["auth_failures"] == 1


def test_fs_mac_setting():
    assert OffloadConfig.from_sources({"fs_mac": "GMAC"}, env={"TPU_OFFLOAD_FS_SECRET": SECRET.decode()}).fs_mac == "gmac"
    with pytest.raises(ConfigError, match="'fs_mac'.*allowed: one of 'hmac-sha256', 'gmac'"):
        OffloadConfig.from_sources({"fs_mac": "md5"}, env={})


# ---- secure by default: no secret, a secret others can rewrite, a guessable secret ----


def test_a_shared_tier_without_a_secret_refuses_to_start_and_names_both_ways_out(root, fp):
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({"shared_storage_path": root}, env={})
    msg = str(e.value)
    assert "fs_secret_file" in msg and "fs_allow_unauthenticated: true" in msg and "allowed" in msg.lower()
    with pytest.raises(ConfigError, match="fs_allow_unauthenticated"):
        OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_SHARED_STORAGE_PATH": root})
    with pytest.raises(ConfigError, match="fs_allow_unauthenticated"):  # a config built directly, too
        FileTier.from_config(OffloadConfig(shared_storage_path=root), fp, CHUNK)
    cfg = OffloadConfig.from_sources({"shared_storage_path": root, "fs_allow_unauthenticated": True}, env={})
    t = FileTier.from_config(cfg, fp, CHUNK)
    try:
        assert not t.authenticated
    finally:
        t.close()
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_SHARED_STORAGE_PATH": root,
                                               "TPU_OFFLOAD_FS_ALLOW_UNAUTHENTICATED": "1"}).fs_allow_unauthenticated


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666, 0o622])
def test_a_group_or_world_writable_secret_file_is_refused(tmp_path, mode):
    f = tmp_path / "secret"
    make_secret_file(str(f))
    os.chmod(f, mode)
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={})
    assert "only its owner can write" in str(e.value) and f"{mode:04o}" in str(e.value)
    os.chmod(f, 0o640)
    assert OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={}).fs_secret


def test_a_secret_file_owned_by_another_uid_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    make_secret_file(str(f))
    if os.geteuid() == 0:
        os.chown(f, 4242, -1)  # another user who could rewrite it
    else:  # we cannot give it away: be another user instead
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(f).st_uid + 1)
    with pytest.raises(ConfigError, match=r"owned by this user \(\d+\) or root"):
        OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={})
    monkeypatch.undo()
    if os.geteuid() == 0:
        os.chown(f, 0, -1)  # root's (a mounted Kubernetes Secret): accepted
        assert OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={}).fs_secret


@pytest.mark.parametrize("weak", [
    "aaaaaaaaaaaaaaaa",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "abababababababababababababababababababab",  # two characters
    "0123456789abcdef0123456789abcdef",  # a repeated block (and a hex run)
    "tenant-a-secret-0123456789abcdef",  # runs a person types
    "31415926535897932384",  # 20 digits: about 66 bits
    "deadbeefcafebabe1234",  # 20 hex digits: 80 bits
    "Zx8kQ2mW9pV4rT6y",  # 16 characters of base64: 96 bits
    "tpu-offload-secret-2025",  # a name someone chose
    "correct horse battery staple",  # a passphrase
    "correct horse battery staple and some more words to make it long",  # a long passphrase
    "3d1219c7c4c5404aaa1f6d2a48adfda4",  # a machine-id: 16 bytes of hex
    "Q7vR2mK9pL4wZ8nTH3xJ6cY1sD5fG0bV",  # 24 random bytes of base64: fewer than 32
    "YWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXphYmNkZWZnaGlq",  # base64 of a phrase
])
def test_a_guessable_secret_is_refused(tmp_path, weak):
    f = tmp_path / "secret"
    f.write_text(weak + "\n")
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={})
    assert "32 random bytes" in str(e.value) and "/dev/urandom" in str(e.value) and weak not in str(e.value)
    with pytest.raises(ConfigError, match="32 random bytes"):
        OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_FS_SECRET": weak})


def test_machine_made_secrets_are_accepted(tmp_path):
    import base64
    import secrets

    f = tmp_path / "secret"
    made = make_secret_file(str(f))
    assert oct(os.stat(f).st_mode & 0o777) == "0o600" and len(base64.b64decode(made)) == 32
    assert OffloadConfig.from_sources({"fs_secret_file": str(f)}, env={}).fs_secret == made
    for _ in range(500):
        for s in (base64.b64encode(os.urandom(32)), secrets.token_hex(32).encode(),
                  base64.urlsafe_b64encode(os.urandom(48)).rstrip(b"="), os.urandom(32)):
            assert check_secret(s) == s, s
    with pytest.raises(ValueError, match="32 random bytes"):
        check_secret(base64.b64encode(os.urandom(16)))  # 128 bits: below the rule


def test_the_root_key_is_memory_hard(monkeypatch):
    """Nothing public is a fast function of the secret: the root key comes from scrypt."""
    import hashlib

    from tpu_offload.core.fs import auth

    calls = []
    real = hashlib.scrypt
    monkeypatch.setattr(hashlib, "scrypt", lambda *a, **k: calls.append(k) or real(*a, **k))
    auth._root_key.cache_clear()
    FsAuth(os.urandom(32)).namespace(b"\0" * 16)
    assert calls and calls[0]["n"] * calls[0]["r"] * 128 >= 32 << 20  # at least 32 MiB per guess


def test_a_secret_path_another_uid_could_change_is_refused(tmp_path):
    made = tmp_path / "mine"
    make_secret_file(str(made))
    link = tmp_path / "link"
    os.symlink(made, link)
    os.lchown(link, 65534, 65534)  # a symlink planted by another uid
    with pytest.raises(ConfigError, match="symlinks owned by this user or root"):
        OffloadConfig.from_sources({"fs_secret_file": str(link)}, env={})
    d = tmp_path / "open"
    d.mkdir()
    make_secret_file(str(d / "secret"))
    os.chmod(d, 0o777)  # world-writable, no sticky bit: anyone could swap the file
    with pytest.raises(ConfigError, match="sticky bit"):
        OffloadConfig.from_sources({"fs_secret_file": str(d / "secret")}, env={})
    os.chmod(d, 0o1777)  # /tmp-like: passes
    assert OffloadConfig.from_sources({"fs_secret_file": str(d / "secret")}, env={}).fs_secret
    os.chmod(d, 0o755)
    os.chown(d, 65534, 65534)  # another uid's directory
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        OffloadConfig.from_sources({"fs_secret_file": str(d / "secret")}, env={})


def test_a_kubernetes_secret_mount_passes_and_a_world_readable_file_elsewhere_warns(tmp_path, caplog):
    """A Secret volume: root-owned ``..data`` -> ``..<timestamp>`` links, files mode 0644."""
    vol = tmp_path / "vol"
    stamp = vol / "..2026_11_26_18_00_00.123"
    stamp.mkdir(parents=True)
    make_secret_file(str(stamp / "secret"))
    os.chmod(stamp / "secret", 0o644)
    os.symlink(stamp.name, vol / "..data")
    os.symlink("..data/secret", vol / "secret")
    os.chmod(vol, 0o1777)
    with caplog.at_level(logging.WARNING, logger="tpu_offload.auth"):
        assert OffloadConfig.from_sources({"fs_secret_file": str(vol / "secret")}, env={}).fs_secret
    assert not [r for r in caplog.records if "world-readable" in r.getMessage()]
    plain = tmp_path / "plain"
    make_secret_file(str(plain))
    os.chmod(plain, 0o644)
    with caplog.at_level(logging.WARNING, logger="tpu_offload.auth"):
        assert OffloadConfig.from_sources({"fs_secret_file": str(plain)}, env={}).fs_secret
    assert [r for r in caplog.records if "world-readable" in r.getMessage()]


# ---- one bad file must not disable a chunk for good ----


def _plant_random_mac(path: str) -> None:
    """A same-uid tenant without the secret: our header, a random MAC, header checksum fixed; same size."""
    from tpu_offload.core.fs.format import MAC_OFF

    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[MAC_OFF:MAC_OFF + 32] = os.urandom(32)
    struct.pack_into("<Q", data, HEADER_SIZE - 8, xxhash.xxh3_64_intdigest(bytes(data[: HEADER_SIZE - 8])))
    tmp = path + ".forging"
    with open(tmp, "wb") as f:
        f.write(bytes(data))
    os.rename(tmp, path)


def test_a_forged_hot_chunk_is_replaced_by_our_next_write_and_hits_again(root, make_tier):
    """The attack replayed: 5 requests for a prefix whose hot chunk's file was swapped for a random-MAC one.

    Each request: a presence check; if present a read; on a failed read the
    engine recomputes and stores, which writes the chunk. Before the fix the
    write saw "a regular file of the right size", skipped, restamped it, and
    the presence check kept saying present: every request failed its load.
    """
    t = make_tier(root, secret=SECRET)
    write_all(t, 1)
    path = t.path_of(key(1))
    _plant_random_mac(path)
    forged_ino = os.stat(path).st_ino
    outcomes = []
    for _ in range(5):
        present = t.contains(key(1))
        ok = present and _read(t, 1)[0]
        outcomes.append((present, ok))
        if not ok:  # recomputed: the store writes it (write-through)
            assert t.submit_write(key(1), filled(1)).wait(30)
    assert outcomes[0] == (True, False)  # the forged file looked present and failed
    assert all(o == (True, True) for o in outcomes[1:]), outcomes  # ours again from the next request on
    assert os.stat(path).st_ino != forged_ino and os.path.getsize(path) == HEADER_SIZE + CHUNK
    c = t.counters()
    assert c["auth_failures"] == 1 and c["auth_replaced"] == 1 and c.get("writes_exist", 0) == 0
    fresh = make_tier(root, secret=SECRET)  # another replica verifies our file
    ok, out = _read(fresh, 1)
    assert ok and np.array_equal(out, payload(1))


def test_a_chunk_that_failed_its_mac_is_absent_until_our_copy_is_back(root, make_tier):
    t = make_tier(root, secret=SECRET)
    write_all(t, 1)
    _plant_random_mac(t.path_of(key(1)))
    assert t.contains(key(1))  # not read yet: a stat cannot tell
    assert not _read(t, 1)[0]
    assert not t.contains(key(1)), "a presence check still offers a chunk whose read failed its MAC"
    write_all(t, 1)
    assert t.contains(key(1)) and _read(t, 1)[0]


def test_a_file_we_did_not_verify_is_never_restamped(root, make_tier):
    t = make_tier(root, secret=SECRET, touch_interval_s=0.0)
    write_all(t, 1, 2)
    for i in (1, 2):
        _plant_random_mac(t.path_of(key(i)))
        os.utime(t.path_of(key(i)), (1_000_000, 1_000_000))
    t.touch(key(1))  # the index still has it: once ours, now swapped
    ino2 = os.stat(t.path_of(key(2))).st_ino
    assert t.submit_write(key(2), filled(2)).wait(30)  # not the file we wrote: published over, never kept
    assert t.flush(timeout=30)
    assert os.stat(t.path_of(key(1))).st_mtime == 1_000_000, "a swapped-in file was kept alive"
    assert os.stat(t.path_of(key(2))).st_ino != ino2, "a file we did not write blocked our write"
    out = aligned()
    assert t.read_into(key(2), out) and np.array_equal(out, payload(2))
    write_all(t, 3)
    before = os.stat(t.path_of(key(3))).st_mtime_ns
    time.sleep(0.02)
    t.touch(key(3))  # ours, verified by writing it: restamped
    assert t.flush(timeout=30)
    assert os.stat(t.path_of(key(3))).st_mtime_ns > before


# ---- who may read the secret, and who may vouch for a Secret mount ----


def _readable_warnings(caplog, path):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tpu_offload.auth"):
        assert OffloadConfig.from_sources({"fs_secret_file": str(path)}, env={}).fs_secret
    return [r.getMessage() for r in caplog.records if "-readable" in r.getMessage()]


def test_a_group_readable_secret_warns_as_a_world_readable_one(tmp_path, caplog):
    f = tmp_path / "secret"
    make_secret_file(str(f))
    assert _readable_warnings(caplog, f) == []
    os.chmod(f, 0o640)
    msgs = _readable_warnings(caplog, f)
    assert len(msgs) == 1 and "group-readable (mode 0640)" in msgs[0] and "chmod 600" in msgs[0]


def test_a_dotdot_data_of_another_uid_does_not_make_a_secret_mount(tmp_path, caplog):
    """Anyone can create ``..data`` in a sticky directory: only one owned by the secret's owner counts."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)  # /tmp-like: sticky, so the path itself passes
    f = d / "secret"
    make_secret_file(str(f))
    os.chmod(f, 0o644)
    (d / "..data").mkdir()
    os.chown(d / "..data", 65534, 65534)  # another uid's
    msgs = _readable_warnings(caplog, f)
    assert len(msgs) == 1 and "world-readable" in msgs[0]
    os.chown(d / "..data", os.geteuid(), os.getegid())  # the secret's owner's: a Secret mount
    assert _readable_warnings(caplog, f) == []

