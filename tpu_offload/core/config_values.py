"""Parsers of setting values: each takes what a user wrote (JSON or env) and returns the typed value,
or raises ``ValueError`` whose text says what is allowed (``config`` turns it into one ``ConfigError``
naming the key and the value). Apart from ``config``'s table so each parser is read, and tested, alone.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

GIB = 1 << 30


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
# KiB..TiB (and Kubernetes' Ki..Ti) are powers of 1024, KB..TB powers of 1000. A bare K/M/G/T is refused:
# dd reads "720G" as 720 GiB, Kubernetes ("memory: 720G") as 720x10**9, 49 GiB apart.
_UNITS = {"": 1, "b": 1,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BARE_UNITS = frozenset("kmgt")
_SIZE_ALLOWED = ("a byte count or a size such as '512MiB', '64GiB', '1.5TiB' (KiB..TiB and Ki..Ti are powers "
                 "of 1024; KB..TB powers of 1000)")


def _bare_unit_hint(v: Any) -> str | None:
    """For a size with a bare K/M/G/T ('720G'): which two sizes it might mean, else None."""
    m = _SIZE_RE.match(v) if isinstance(v, str) else None
    if not m or m.group(2).lower() not in _BARE_UNITS:
        return None
    n, u = m.group(1), m.group(2).upper()
    return (f"a bare '{m.group(2)}' is ambiguous (dd reads it as a power of 1024, Kubernetes as a power of "
            f"1000): did you mean {n}{u}iB or {n}{u}B?")


def _bytes(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(_SIZE_ALLOWED)
    if isinstance(v, int):
        n = v
    elif isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer():
            raise ValueError(_SIZE_ALLOWED + " (a whole number of bytes)")
        n = int(v)
    else:
        hint = _bare_unit_hint(v)
        if hint:
            raise ValueError(f"{_SIZE_ALLOWED}; {hint}")
        m = _SIZE_RE.match(v)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(_SIZE_ALLOWED)
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        if "." in number:
            f = float(number) * unit
            if not math.isfinite(f):
                raise ValueError(_SIZE_ALLOWED)
            n = int(f)
        elif len(number.lstrip("0")) > 20:  # >= 2**63 anyway; int() would fail with Python's digit limit
            raise ValueError(_SIZE_ALLOWED + ", greater than 0 and below 2**63")
        else:  # exact: a float would round sizes above 2**53
            n = int(number) * unit
    if not 0 < n < 1 << 63:
        raise ValueError(_SIZE_ALLOWED + ", greater than 0 and below 2**63")
    return n


def _gib(v: Any) -> int:
    allowed = "a number of GiB greater than 0 (below 2**33), e.g. 64 or 0.5"
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(allowed)
    try:
        g = float(v)
    except (ValueError, OverflowError):
        raise ValueError(allowed) from None
    if not (math.isfinite(g) and 0 < g < 1 << 33):  # check before scaling: huge floats overflow
        raise ValueError(allowed)
    n = int(g * GIB)
    if n <= 0:
        raise ValueError(allowed)
    return n


def _int(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    allowed = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")

    def parse(v: Any) -> int:
        if isinstance(v, bool):
            raise ValueError(allowed)
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(allowed)
        try:
            n = int(str(v).strip()) if not isinstance(v, (int, float)) else int(v)
        except ValueError:
            raise ValueError(allowed) from None
        if n < lo or (hi is not None and n > hi):
            raise ValueError(allowed)
        return n

    return parse


def _float(lo: float) -> Callable[[Any], float]:
    def parse(v: Any) -> float:
        if isinstance(v, bool):
            raise ValueError(f"a number >= {lo}")
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"a number >= {lo}") from None
        if not (math.isfinite(f) and f >= lo):
            raise ValueError(f"a number >= {lo}")
        return f

    return parse


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _fraction_or_none(v: Any, allowed: str) -> float | None:
    """``v`` as a number, a trailing '%' dividing by 100; None where it is no number. Raises ValueError(allowed)
    for a type no setting takes (a bool, a list, ...)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(allowed)
    text = v.strip() if isinstance(v, str) else v
    try:
        return float(text[:-1]) / 100 if isinstance(text, str) and text.endswith("%") else float(text)
    except (ValueError, OverflowError):
        return None


def _share(v: Any) -> float:
    """A fraction from 0 to 1 (a float, or a percentage such as '50%')."""
    allowed = "a fraction from 0 to 1, e.g. 0.5 or '50%'"
    f = _fraction_or_none(v, allowed)
    if f is None:
        raise ValueError(allowed)
    if not (math.isfinite(f) and 0.0 <= f <= 1.0):
        raise ValueError(allowed)
    return f


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("true/false (or 1/0, yes/no, on/off)")


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in options:
            raise ValueError("one of " + ", ".join(repr(o) for o in options))
        return s

    return parse


def _int_list(v: Any) -> tuple[int, ...]:
    allowed = "a comma-separated list of positive integers, e.g. '1,2,4,8'"
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    try:
        out = tuple(sorted({int(str(x).strip()) for x in items if str(x).strip()}))
    except ValueError:
        raise ValueError(allowed) from None
    if not out or out[0] <= 0:
        raise ValueError(allowed)
    return out


def _path(v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)):
        raise ValueError("a non-empty filesystem path (a string)")
    s = os.fspath(v)
    s = s.strip() if isinstance(s, str) else ""
    if not s or "\x00" in s:
        raise ValueError("a non-empty filesystem path (a string)")
    return s


_OFF_WORDS = frozenset({"off", "none", "null", "no", "false", "0", "disabled", "disable", "unset", "-"})


def _abs_path(key: str) -> Callable[[Any], str]:
    """An absolute path (``~`` expanded): every process must agree on it, whatever its cwd."""

    def parse(v: Any) -> str:
        s = _path(v)
        if s.lower() in _OFF_WORDS:
            raise ValueError(f"an absolute directory path; to turn this off, leave {key} unset")
        s = os.path.expanduser(s)
        if not os.path.isabs(s):
            raise ValueError("an absolute path such as /mnt/kv-cache or ~/kv-cache (a relative path "
                             "would depend on each process's working directory)")
        return os.path.normpath(s)

    return parse


def _dir_mode(v: Any) -> int:
    allowed = "'0700' (owner only, files 0600) or '0750' (group may read, files 0640)"
    if isinstance(v, bool):
        raise ValueError(allowed)
    if isinstance(v, int):
        n = v
    else:
        try:
            n = int(str(v).strip(), 8)
        except ValueError:
            raise ValueError(allowed) from None
    if n not in (0o700, 0o750):
        raise ValueError(allowed)
    return n


def _margin(v: Any) -> int | float:
    """A fraction of host memory (a float; ``0.1`` or ``'10%'``) or a size (an int, bytes)."""
    allowed = "a fraction of host memory below 1 (e.g. 0.1 or '10%'), a size such as '16GiB', or 0 for none"
    f = _fraction_or_none(v, allowed)  # None: a size with a unit, or nothing valid
    text = v.strip() if isinstance(v, str) else v
    if f is not None:
        if not math.isfinite(f) or f < 0 or (f >= 1 and (not f.is_integer() or str(text).endswith("%"))):
            raise ValueError(allowed)
        if 1 <= f <= 100:  # 5 bytes or 5%? Neither is what a bare 5 should silently mean.
            share = f"{f / 100:g} for {f:g}% of host memory, or " if f < 100 else ""
            raise ValueError(allowed + f"; a bare {f:g} is ambiguous ({f:g} bytes? {f:g}%?): write {share}a size "
                             f"with a unit such as '{f:g}GiB'")
        if f < 1:
            return float(f)
    hint = _bare_unit_hint(v)
    if hint:
        raise ValueError(f"{allowed}; {hint}")
    try:
        return _bytes(v)
    except ValueError:
        raise ValueError(allowed) from None


def _secret_env(v: Any) -> bytes:
    from tpu_offload.core.fs.auth import check_secret

    return check_secret(str(v).encode())


# Public for the tpu-offload-fs CLI, which validates its flags the same way.
parse_size = _bytes
parse_number = _float
