"""Config fuzzing: every bad input is one ConfigError that says what is wrong.

Every invalid key, value, type, typo, contradiction and env var must raise
``ConfigError`` (never TypeError/OverflowError/...) naming the key or env
var, the value, and what is allowed; near-miss typos get a "did you mean".
Valid inputs parse to the right typed values; extra_config beats env.
The settings table is introspected, so a newly added setting is fuzzed too.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import string

import hypothesis.strategies as st
import pytest
from hypothesis import assume, example, given, settings

from tpu_offload.core import config as C
from tpu_offload.core import config_values as V
from tpu_offload.core.config import ConfigError, OffloadConfig

FAST = settings(max_examples=60, deadline=None)
GIB = 1 << 30
KEYS = sorted(C._BY_KEY)
ENVS = sorted(C._BY_ENV)
KNOWN = set(KEYS) | set(C.ENGINE_KEYS)
TRUE, FALSE = V._TRUE, V._FALSE


def kind(parse) -> tuple[str, dict]:
    """What a setting's parser accepts, read off the parser itself."""
    for name in ("_bytes", "_gib", "_bool", "_path", "_int_list"):
        if parse is getattr(V, name):
            return name[1:], {}
    outer = parse.__qualname__.split(".")[0].lstrip("_")
    return outer, dict(inspect.getclosurevars(parse).nonlocals)


def _int_text_ok(s: str, lo, hi) -> bool:
    try:
        n = int(s.strip())
    except ValueError:
        return False
    return n >= lo and (hi is None or n <= hi)


def _float_ok(v, lo) -> bool:
    try:
        f = float(v)
    except (ValueError, OverflowError):
        return False
    return math.isfinite(f) and f >= lo


junk = st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
bad_float = st.one_of(st.just(float("nan")), st.just(float("inf")), st.just(float("-inf")))
malformed_size = st.sampled_from(
    ["", " ", "GiB", "12XB", "-5GiB", "1.2.3", "0", "0KiB", "0.0000001", "1e9", "0x10", "64 GB GB", "five", "NaN",
     "inf", "9" * 400, "１GiB", "64GiBs", "+64GiB", "64 G i B", "720G", "1.5t", "64 M", "4k"]
)


def invalid_values(parse, as_env: bool = False):
    """Values this parser must reject (as strings only, for env vars)."""
    k, arg = kind(parse)
    text = st.text(max_size=12)
    if k == "bytes":
        s = st.one_of(malformed_size, text.filter(lambda t: not t.strip()[:1].isdigit()))
        raw = st.one_of(st.integers(max_value=0), st.floats(-1e6, 1e6).filter(lambda f: not (f.is_integer() and f > 0)),
                        bad_float, st.booleans(), junk)
    elif k == "gib":
        s = st.one_of(text.filter(lambda t: not _float_ok(t, 1e-9) or float(t) * GIB < 1), st.sampled_from(["0", "-1", "1e-12", "nan", "inf", "9" * 400]))
        raw = st.one_of(st.integers(max_value=0), st.floats(max_value=0), bad_float, st.booleans(), junk, st.just(10**400))
    elif k == "int":
        lo, hi = arg["lo"], arg["hi"]
        s = text.filter(lambda t: not _int_text_ok(t, lo, hi))
        raw = st.one_of(st.integers(max_value=lo - 1), st.floats().filter(lambda f: not (math.isfinite(f) and f.is_integer())),
                        st.booleans(), junk, *( [st.integers(min_value=hi + 1)] if hi is not None else []))
    elif k == "float":
        lo = arg["lo"]
        s = text.filter(lambda t: not _float_ok(t, lo))
        raw = st.one_of(st.floats(max_value=lo, exclude_max=True), bad_float, st.booleans(), junk, st.just(10**400))
    elif k == "bool":
        s = text.filter(lambda t: t.strip().lower() not in TRUE | FALSE)
        raw = st.one_of(st.integers().filter(lambda n: n not in (0, 1)), st.floats(), junk)
    elif k == "choice":
        opts = arg["options"]
        s = text.filter(lambda t: t.strip().lower() not in opts)
        raw = st.one_of(st.integers(), st.booleans(), st.none())
    elif k == "path":
        s = st.one_of(st.just(""), st.text(" \t", min_size=1, max_size=3), st.text(max_size=4).map(lambda t: t + "\x00"))
        raw = st.one_of(st.integers(), st.booleans(), junk, st.binary(max_size=4))
    elif k == "abs_path":  # also: relative, and words that look like "disabled"
        s = st.one_of(st.just(""), st.text(" \t", min_size=1, max_size=3), st.text(max_size=4).map(lambda t: t + "\x00"),
                      st.sampled_from(["off", "None", "false", "0", "kv", "./kv", "data/kv", "~user-that-is-not-there/kv"]))
        raw = st.one_of(st.integers(), st.booleans(), junk, st.binary(max_size=4))
    elif k == "int_list":
        s = st.sampled_from(["", ",", "0", "-1", "a,b", "1,,x", "1.5", "2,0", " , "])
        raw = st.one_of(st.just([]), st.just([0]), st.just([-3, 4]), st.just([1.5]), st.just([True]))
    elif k == "dir_mode":
        s = text.filter(lambda t: t.strip() not in ("0700", "700", "0750", "750", "0o700", "0o750"))
        raw = st.one_of(st.integers().filter(lambda n: n not in (0o700, 0o750)), st.booleans(), junk)
    elif k == "margin":  # a fraction below 1 ("0.1", "10%") or a size; never negative, NaN, or a fraction >= 1
        s = st.sampled_from(["", " ", "abc", "-0.1", "-5%", "150%", "100%", "1.5", "nan", "inf", "-1", "5 %%", "0x10",
                             "5", "100", "16G", "1.5 t"])
        raw = st.one_of(st.floats(max_value=0, exclude_max=True), st.floats(1.01, 1e6).filter(lambda f: not f.is_integer()),
                        bad_float, st.booleans(), junk, st.integers(max_value=-1))
    elif k == "share":  # a fraction from 0 to 1, or a percentage up to 100%
        s = st.sampled_from(["", " ", "abc", "-0.1", "-5%", "150%", "1.5", "nan", "inf", "-1", "5 %%", "0x10", "2"])
        raw = st.one_of(st.floats(max_value=0, exclude_max=True), st.floats(1.01, 1e6), bad_float, st.booleans(),
                        junk, st.integers(min_value=2), st.integers(max_value=-1))
    elif k == "secret_env":  # env only; shorter than 16 bytes once stripped
        s = st.text(max_size=15).filter(lambda t: len(t.encode().strip()) < 16)
        raw = s
    else:  # a parser kind this test does not know yet: fail loudly
        raise AssertionError(f"unknown parser kind {k!r}; teach tests/core/test_core_config.py about it")
    return s if as_env else st.one_of(s, raw)


def valid_values(parse):
    k, arg = kind(parse)
    if k == "bytes":
        return st.integers(1, 1 << 50)
    if k == "gib":
        return st.integers(1, 4096)
    if k == "int":
        lo, hi = arg["lo"], arg["hi"]
        return st.integers(lo, hi if hi is not None else lo + 10**6)
    if k == "float":
        return st.floats(arg["lo"], 1e6)
    if k == "bool":
        return st.booleans()
    if k == "choice":
        return st.sampled_from(arg["options"])
    if k in ("path", "abs_path"):
        return st.text(string.ascii_letters, min_size=1, max_size=8).map(lambda t: "/mnt/" + t)
    if k == "int_list":
        return st.lists(st.integers(1, 4096), min_size=1, max_size=5)
    if k == "dir_mode":
        return st.sampled_from(["0700", "0750"])
    if k == "share":
        return st.one_of(st.floats(0, 1), st.sampled_from(["0", "1", "0.5", "50%", "100%"]))
    if k == "margin":
        # a bare 1..100 is refused as ambiguous (bytes or percent?): tests/core/test_settings_rules.py
        return st.one_of(st.floats(0, 0.99), st.integers(101, 1 << 40), st.sampled_from(["5%", "0.1", "64GiB", "0"]))
    raise AssertionError(f"unknown parser kind {k!r}")


def assert_explains(err: ConfigError, *parts: str) -> None:
    msg = str(err)
    for p in parts:
        assert p in msg, f"{p!r} missing from: {msg}"
    assert "allowed" in msg.lower(), f"no 'allowed' in: {msg}"


# ---- bad values ----------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
@FAST
@given(data=st.data())
def test_bad_value_in_extra_config(key, data):
    value = data.draw(invalid_values(C._BY_KEY[key].parse), label="value")
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({key: value}, env={})
    assert_explains(e.value, repr(key), repr(value))


@pytest.mark.parametrize("name", ENVS)
@FAST
@given(data=st.data())
def test_bad_env_value(name, data):
    value = data.draw(invalid_values(C._BY_ENV[name].parse, as_env=True), label="value")
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({}, env={name: value})
    if C._BY_ENV[name].secret:  # a secret is never echoed, not even a bad one
        assert_explains(e.value, name, "<hidden")
        assert not value.strip() or repr(value) not in str(e.value)
        return
    assert_explains(e.value, name, repr(value))


# ---- unknown keys, typos, env vars -------------------------------------------


@FAST
@given(key=st.one_of(st.text(min_size=1, max_size=20), st.integers(), st.tuples(st.integers())), value=st.integers() | st.text(max_size=5))
def test_unknown_key(key, value):
    assume(key not in KNOWN)
    assume(str(key).lower() not in C._SECRET_KEYS)  # refused with the value hidden: test_secret_keys_in_json
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({key: value}, env={})
    assert_explains(e.value, repr(key), repr(value), "num_cpu_chunks")


@pytest.mark.parametrize("key", sorted(C._SECRET_KEYS) + ["FS_SECRET_KEY"])
def test_secret_keys_in_json(key):
    """A secret put into the config JSON is refused, named by its key, and never echoed."""
    value = "k3y-" + "q7Zp" * 8
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({key: value}, env={})
    assert_explains(e.value, repr(key), "value hidden", "fs_secret_file", "TPU_OFFLOAD_FS_SECRET")
    assert value not in str(e.value)


def _mutations(word: str):
    """Single-edit typos of ``word`` (delete, swap, replace, insert)."""
    letters = string.ascii_lowercase + "_"
    return st.one_of(
        st.integers(0, len(word) - 1).map(lambda i: word[:i] + word[i + 1 :]),
        st.integers(0, len(word) - 2).map(lambda i: word[:i] + word[i + 1] + word[i] + word[i + 2 :]),
        st.tuples(st.integers(0, len(word) - 1), st.sampled_from(letters)).map(lambda t: word[: t[0]] + t[1] + word[t[0] + 1 :]),
        st.tuples(st.integers(0, len(word)), st.sampled_from(letters)).map(lambda t: word[: t[0]] + t[1] + word[t[0] :]),
    )


def _check_suggestion(msg: str, typo: str, original: str, candidates) -> None:
    assert "did you mean" in msg, msg
    suggested = msg.split("did you mean ", 1)[1].split("'")[1]
    assert suggested in candidates
    ratio = lambda a: difflib.SequenceMatcher(None, typo, a).ratio()  # noqa: E731
    assert ratio(suggested) >= ratio(original) - 1e-9, f"suggested {suggested!r} for {typo!r}, not {original!r}"


@FAST
@given(data=st.data(), original=st.sampled_from(sorted(KNOWN)))
@example(data=None, original="num_cpu_chunks")
def test_typo_in_key_gets_did_you_mean(data, original):
    typo = data.draw(_mutations(original)) if data is not None else "num_cpu_chunk"
    assume(typo not in KNOWN and typo)
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({typo: 1}, env={})
    assert_explains(e.value, repr(typo))
    _check_suggestion(str(e.value), typo, original, KNOWN)


@FAST
@given(data=st.data(), original=st.sampled_from(ENVS))
def test_typo_in_env_name_gets_did_you_mean(data, original):
    suffix = original[len("TPU_OFFLOAD_") :]
    typo = "TPU_OFFLOAD_" + data.draw(_mutations(suffix.lower())).upper()
    assume(typo not in C._BY_ENV and typo not in C.UPSTREAM_ENV and typo != "TPU_OFFLOAD_")
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({}, env={typo: "1"})
    assert_explains(e.value, typo, "'1'")
    _check_suggestion(str(e.value), typo, original, C._BY_ENV)


@FAST
@given(suffix=st.text(string.ascii_uppercase + string.digits + "_", min_size=1, max_size=16), value=st.text(max_size=5))
def test_unknown_tpu_offload_env(suffix, value):
    name = "TPU_OFFLOAD_" + suffix
    assume(name not in C._BY_ENV and name not in C.UPSTREAM_ENV)
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({}, env={name: value})
    assert_explains(e.value, name, repr(value))


@FAST
@given(env=st.dictionaries(st.text(string.ascii_uppercase + "_", min_size=1, max_size=12).filter(lambda n: not n.startswith("TPU_OFFLOAD_")), st.text(max_size=5), max_size=4))
def test_other_env_vars_are_ignored(env):
    assert OffloadConfig.from_sources({}, env={**env, "TPU_OFFLOAD_LMCACHE": "1"}) == OffloadConfig()


def test_non_mapping_extra_config():
    for bad in (["num_cpu_chunks", 5], "num_cpu_chunks=5", 5):
        with pytest.raises(ConfigError, match="JSON object"):
            OffloadConfig.from_sources(bad, env={})


# ---- contradictions ------------------------------------------------------------

SIZE_KEYS = {"num_cpu_chunks": 100, "cpu_bytes": "1GiB", "cpu_bytes_to_use": 1 << 30, "cpu_gib": 2}
SIZE_ENVS = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "100", "TPU_OFFLOAD_CPU_BYTES": "1GiB", "TPU_OFFLOAD_CPU_GIB": "2"}


@pytest.mark.parametrize("a,b", [(a, b) for a in SIZE_KEYS for b in SIZE_KEYS if a < b] + [("blocks_per_chunk", "block_size")])
def test_contradictory_keys(a, b):
    extra = {a: SIZE_KEYS.get(a, 2), b: SIZE_KEYS.get(b, 256)}
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources(extra, env={})
    assert_explains(e.value, a, b, repr(extra[a]), repr(extra[b]))


@pytest.mark.parametrize("a,b", [(a, b) for a in SIZE_ENVS for b in SIZE_ENVS if a < b])
def test_contradictory_env(a, b):
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({}, env={a: SIZE_ENVS[a], b: SIZE_ENVS[b]})
    assert_explains(e.value, a, b, repr(SIZE_ENVS[a]), repr(SIZE_ENVS[b]))


@pytest.mark.parametrize("same", [True, False])
def test_offload_prompt_only_contradicts_decode_save(same):
    with pytest.raises(ConfigError) as e:
        OffloadConfig.from_sources({"offload_prompt_only": same, "decode_save": same}, env={})
    assert_explains(e.value, "offload_prompt_only", "decode_save", repr(same))
    # consistent values are fine
    assert OffloadConfig.from_sources({"offload_prompt_only": same, "decode_save": not same}, env={}).decode_save is (not same)


# ---- valid inputs --------------------------------------------------------------------

# KiB..TiB and Ki..Ti are powers of 1024; KB..TB powers of 1000 ("720GB" is not 720 GiB). A bare K..T is
# refused (tests/core/test_settings_rules.py): dd and Kubernetes read it differently.
UNITS = {"": 1, "B": 1, "KB": 10**3, "KiB": 1 << 10, "Ki": 1 << 10, "MB": 10**6, "MiB": 1 << 20, "Mi": 1 << 20,
         "GB": 10**9, "GiB": 1 << 30, "Gi": 1 << 30, "TB": 10**12, "TiB": 1 << 40, "Ti": 1 << 40}


@FAST
@given(n=st.integers(1, 10**6), unit=st.sampled_from(sorted(UNITS)), upper=st.booleans(), sp=st.sampled_from(["", " "]),
       key=st.sampled_from(["cpu_bytes", "cpu_bytes_to_use"]))
def test_size_strings(n, unit, upper, sp, key):
    text = f"{n}{sp}{unit.upper() if upper else unit}"
    cfg = OffloadConfig.from_sources({key: text}, env={})
    assert cfg.cpu_bytes == n * UNITS[unit] and type(cfg.cpu_bytes) is int
    assert cfg.num_cpu_chunks is None


@FAST
@given(n=st.integers(1, 1 << 60))
@example(n=(1 << 53) + 1)
@example(n=(1 << 60) - 1)
def test_size_in_bytes(n):
    assert OffloadConfig.from_sources({"cpu_bytes": n}, env={}).cpu_bytes == n
    assert OffloadConfig.from_sources({"cpu_bytes": float(n) if n < 2**53 else n}, env={}).cpu_bytes == n
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_CPU_BYTES": str(n)}).cpu_bytes == n


@FAST
@given(g=st.one_of(st.integers(1, 10**4), st.floats(0.001, 1e4)))
def test_cpu_gib(g):
    assert OffloadConfig.from_sources({"cpu_gib": g}, env={}).cpu_bytes == int(g * GIB)
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_CPU_GIB": repr(g)}).cpu_bytes == int(float(repr(g)) * GIB)


def test_fractional_sizes():
    assert OffloadConfig.from_sources({"cpu_bytes": "1.5TiB"}, env={}).cpu_bytes == 3 << 39
    assert OffloadConfig.from_sources({"cpu_bytes": "64GiB"}, env={}).cpu_bytes == 64 << 30
    assert OffloadConfig.from_sources({"fs_capacity": ".5GiB"}, env={}).fs_capacity_bytes == 1 << 29


def test_huge_sizes_and_storage_paths_say_what_is_allowed():
    """A 5000-digit size gets our message, not Python's int-digit limit; storage paths are absolute."""
    cases = [({"fs_capacity": "9" * 5000}, "below 2**63"), ({"cpu_bytes": "1" * 5000 + "GiB"}, "below 2**63"),
             ({"shared_storage_path": "off"}, "leave shared_storage_path unset"),
             ({"shared_storage_path": "none"}, "leave shared_storage_path unset"),
             ({"shared_storage_path": "kv-cache"}, "absolute path"),
             ({"snapshot_path": "./snap"}, "absolute path")]
    for extra, needle in cases:
        with pytest.raises(ConfigError) as e:
            OffloadConfig.from_sources(extra, env={})
        assert needle in str(e.value) and "digits" not in str(e.value), str(e.value)[-300:]
    with pytest.raises(ConfigError, match="TPU_OFFLOAD_SHARED_STORAGE_PATH.*leave shared_storage_path unset"):
        OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_SHARED_STORAGE_PATH": "OFF"})
    home = OffloadConfig.from_sources({"shared_storage_path": "~/kv/", "fs_allow_unauthenticated": True},
                                      env={}).shared_storage_path
    assert home == os.path.join(os.path.expanduser("~"), "kv")


@FAST
@given(word=st.sampled_from(sorted(TRUE | FALSE)), upper=st.booleans(), pad=st.sampled_from(["", " "]))
def test_bool_spellings(word, upper, pad):
    text = pad + (word.upper() if upper else word) + pad
    assert OffloadConfig.from_sources({"decode_save": text}, env={}).decode_save is (word in TRUE)
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_DECODE_SAVE": text}).decode_save is (word in TRUE)


@FAST
@given(n=st.integers(1, 4096), as_text=st.booleans())
def test_ints_parse_typed(n, as_text):
    cfg = OffloadConfig.from_sources({"blocks_per_chunk": str(n) if as_text else n, "staging_blocks": float(n)}, env={})
    assert cfg.blocks_per_chunk == n and type(cfg.blocks_per_chunk) is int
    assert cfg.staging_blocks == n and type(cfg.staging_blocks) is int


def test_engine_keys_pass_through():
    extra = {"spec_name": "TPUOffloadingSpec", "spec_module_path": "gpu_offload.spec", "eviction_policy": "lru",
             "store_threshold": 2, "offload_prompt_only": True, "block_size": 256, "num_cpu_chunks": 10}
    cfg = OffloadConfig.from_sources(extra, env={})
    assert cfg.chunk_tokens == 256 and cfg.num_cpu_chunks == 10
    assert cfg.resolve_blocks_per_chunk(16) == 16
    with pytest.raises(ConfigError, match="multiple of the engine block size"):
        cfg.resolve_blocks_per_chunk(100)


def test_choices():
    cfg = OffloadConfig.from_sources({"fs_write_mode": " Write_Through ", "host_memory_kind": "unpinned_host"}, env={})
    assert cfg.fs_write_mode == "write_through" and cfg.host_memory_kind == "unpinned_host"
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_USE_UNPINNED_HOST": "1"}).host_memory_kind == "unpinned_host"


def test_llm_d_overlay_env():
    env = {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "25000", "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "1000", "TPU_OFFLOAD_DECODE_SAVE": "1",
           "PATH": "/usr/bin", "HOME": "/root"}
    cfg = OffloadConfig.from_sources({}, env=env)
    assert (cfg.num_cpu_chunks, cfg.staging_blocks, cfg.decode_save) == (25000, 1000, True)
    assert cfg.resolve_num_chunks(chunk_bytes=1 << 20) == 25000


def test_resolve_num_chunks():
    assert OffloadConfig.from_sources({"cpu_gib": 1}, env={}).resolve_num_chunks(1 << 20) == 1024
    with pytest.raises(ConfigError, match="smaller than one chunk"):
        OffloadConfig.from_sources({"cpu_bytes": 1000}, env={}).resolve_num_chunks(4096)
    with pytest.raises(ConfigError, match="num_cpu_chunks"):
        OffloadConfig.from_sources({}, env={}).resolve_num_chunks(4096)


# ---- precedence -------------------------------------------------------------------------

# fs_secret_file must name a readable secret and fs_encrypt needs one: both in tests/fs/test_fs_auth.py.
WITH_BOTH = sorted({s.field: s for s in C.SETTINGS if s.env and s.keys
                    and s.field not in ("fs_secret_file", "fs_encrypt")}.values(), key=lambda s: s.field)


@pytest.mark.parametrize("setting", WITH_BOTH, ids=lambda s: s.field)
@FAST
@given(data=st.data())
def test_extra_config_overrides_env(setting, data):
    env_value = data.draw(valid_values(setting.parse), label="env")
    json_value = data.draw(valid_values(setting.parse), label="json")
    env_text = ",".join(map(str, env_value)) if isinstance(env_value, list) else str(env_value)
    extra = {setting.keys[0]: json_value}
    if setting.field != "fs_allow_unauthenticated":  # a shared_storage_path without a secret is refused
        extra["fs_allow_unauthenticated"] = True
    cfg = OffloadConfig.from_sources(extra, env={setting.env: env_text})
    assert getattr(cfg, setting.field) == setting.parse(json_value)


def test_json_size_replaces_env_size_wholesale():
    cfg = OffloadConfig.from_sources({"cpu_gib": 4}, env={"TPU_OFFLOAD_NUM_CPU_CHUNKS": "25000"})
    assert cfg.num_cpu_chunks is None and cfg.cpu_bytes == 4 * GIB
    cfg = OffloadConfig.from_sources({"block_size": 512}, env={"TPU_OFFLOAD_BLOCKS_PER_CHUNK": "4"})
    assert cfg.blocks_per_chunk == 1 and cfg.chunk_tokens == 512


# ---- nothing but ConfigError, ever ---------------------------------------------------------

anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=4), st.just(10**400)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)


@settings(max_examples=300, deadline=None)
@given(extra=st.dictionaries(st.one_of(st.sampled_from(sorted(KNOWN)), st.text(max_size=10), st.integers()), anything, max_size=5),
       env=st.dictionaries(st.one_of(st.sampled_from(ENVS), st.text(max_size=14).map(lambda t: "TPU_OFFLOAD_" + t)), st.text(max_size=10), max_size=3))
def test_fuzz_only_config_error(extra, env):
    try:
        cfg = OffloadConfig.from_sources(extra, env=env)
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, OffloadConfig)


def test_shared_storage_is_shared_by_default_and_write_back_lag_is_bounded():
    cfg = OffloadConfig.from_sources({}, env={})
    assert cfg.fs_write_mode == "write_through" and cfg.fs_write_back_lag_s == 10.0
    cfg = OffloadConfig.from_sources({"fs_write_mode": "write_back", "fs_write_back_lag_s": "0.5"}, env={})
    assert cfg.fs_write_back_lag_s == 0.5
    assert OffloadConfig.from_sources({}, env={"TPU_OFFLOAD_FS_WRITE_BACK_LAG_S": "2"}).fs_write_back_lag_s == 2.0
    for bad in (-1, "nan", "inf", "soon"):
        with pytest.raises(ConfigError, match="'fs_write_back_lag_s'.*allowed: a number >= 0"):
            OffloadConfig.from_sources({"fs_write_back_lag_s": bad}, env={})
