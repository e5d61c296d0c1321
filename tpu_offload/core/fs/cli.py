"""``tpu-offload-fs``: evict, inspect and verify a shared chunk directory.

Exit codes (stable, for cron jobs and probes):
  0  done; nothing wrong (evict: below the high mark, or brought down to the low mark)
  1  verify found bad files / evict could not reach the low mark
  2  bad arguments
  3  the root is missing or unreadable
  4  done, but some directories or files could not be read and were skipped
     (listed on stderr)
  5  the root holds no file tier: no namespace directory (<model>-<digest>, or
     kv-<tag> with a secret) under it, or none named by --namespace (a mistyped path)
  6  verify with the secret: some namespace has files, and not one of them verifies
     under this secret (another deployment's, or all forged); listed on stderr
  Precedence when several apply: 1, then 6, then 4.

Keyed namespaces (kv-..., a tier with a secret): pass the secret the connectors
use (--secret-file, --config with fs_secret_file, or TPU_OFFLOAD_FS_SECRET_FILE /
TPU_OFFLOAD_FS_SECRET); then only files signed with it are counted, evicted or
passed, and only keyed namespaces are touched. Without it evict and verify
refuse a keyed namespace (exit 2): the magic is public, forgeries look alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import stat
import sys
from typing import Any, Callable

from tpu_offload.core import config
from tpu_offload.core.fs import admin
from tpu_offload.core.fs.auth import check_secret, make_secret_file, read_secret_file
from tpu_offload.core.fs.keyring import Keyring

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_NO_ROOT, EXIT_PARTIAL, EXIT_NO_TIER, EXIT_NOT_OURS = 0, 1, 2, 3, 4, 5, 6
MIN_TMP_AGE_S = 60.0  # a slow write (NFS, a big chunk) can take this long: younger temps may be live


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a config value parser: the same values and the same message."""

    def typ(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"value {text!r} is not allowed; allowed: {e}") from None

    typ.__name__ = getattr(parse, "__name__", "value")
    return typ


def _pct_value(text: str) -> float:
    try:
        v = float(text)
    except (ValueError, OverflowError):
        v = math.nan
    if not 0 < v <= 100:  # also refuses nan and inf
        raise ValueError("a percentage greater than 0 and at most 100")
    return v


_size = _checked(config.parse_size)
_pct = _checked(_pct_value)
_tmp_age = _checked(config.parse_number(MIN_TMP_AGE_S))


def _safe(text: str) -> str:
    """``text`` with every byte that is not valid UTF-8 written as ``\\xNN``: printable anywhere.

    File names come from the shared directory, where anyone may create a
    name that is not UTF-8 (Python hands it over as lone surrogates); printed
    as they are, they raise ``UnicodeEncodeError`` and the run ends with a
    traceback and exit 1 ("bad files"). Escaped, the report goes out whole.
    """
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _say(text: str, file=None) -> None:
    """Print ``text`` (file names escaped by ``_safe``) in the stream's own encoding, never raising on it."""
    stream = sys.stdout if file is None else file
    enc = getattr(stream, "encoding", None) or "utf-8"
    try:
        out = _safe(text).encode(enc, "backslashreplace").decode(enc)
    except LookupError:  # an encoding Python does not know: ASCII is safe everywhere
        out = _safe(text).encode("ascii", "backslashreplace").decode("ascii")
    print(out, file=stream)


def _clean(obj):
    """A report with every string made printable (``_safe``): JSON parsers refuse lone surrogates."""
    if isinstance(obj, str):
        return _safe(obj)
    if isinstance(obj, dict):
        return {_clean(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors come out as JSON when ``--json`` is on the command line."""

    json_errors = False

    def error(self, message):
        if _Parser.json_errors:
            _say(json.dumps({"error": f"{self.prog}: error: {message}", "exit_code": EXIT_USAGE}))
            self.exit(EXIT_USAGE)
        super().error(message)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tpu-offload")
    except Exception:  # not installed (a checkout on PYTHONPATH)
        import tpu_offload

        return tpu_offload.__version__


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tpu-offload-fs", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp):
        sp.add_argument("root", help="the shared_storage_path all instances use")
        sp.add_argument("--namespace", help="only this namespace (a directory under root)")
        sp.add_argument("--json", action="store_true", help="machine-readable output (errors too: one JSON "
                        "object with error and exit_code)")
        sp.add_argument("--secret-file", help="the file tier's secret (as fs_secret_file); else "
                        "TPU_OFFLOAD_FS_SECRET_FILE / TPU_OFFLOAD_FS_SECRET / --config")
        sp.add_argument("--config", help="a kv-transfer-config JSON file (or its kv_connector_extra_config) "
                        "whose fs_secret_file names the secret (a regular file of at most 1 MiB)")
        sp.add_argument("--salt", action="append", default=[],
                        help="a tenant's cache_salt whose files verify should check in full (repeatable)")

    sub.add_parser("make-secret", help="write a fresh secret (32 random bytes, base64) to a new 0600 file"
                   ).add_argument("path")

    e = sub.add_parser("evict", help="delete least recently used files above a high watermark")
    common(e)
    e.add_argument("--budget", type=_size,
                   help="byte budget for our files; without it the watermarks apply to the filesystem (statvfs)")
    e.add_argument("--high", type=_pct, default=90.0, help="start evicting at this %% (default 90)")
    e.add_argument("--low", type=_pct, default=80.0, help="stop at this %% (default 80)")
    e.add_argument("--tmp-age", type=_tmp_age, default=600.0,
                   help=f"delete our temp files older than this many seconds on the file server's clock "
                        f"(default 600, at least {MIN_TMP_AGE_S:g})")
    e.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    e.add_argument("--budget-scope", choices=("namespace", "total"), default="namespace",
                   help="--budget for each namespace on its own (default), or for all in scope together")

    i = sub.add_parser("inspect", help="namespaces, sizes, counts and ages")
    common(i)

    v = sub.add_parser("verify", help="check every file's header and checksum")
    common(v)
    g = v.add_mutually_exclusive_group()
    g.add_argument("--quarantine", action="store_true", help="move bad files to <namespace>/quarantine/")
    g.add_argument("--delete", action="store_true", help="delete bad files")
    return p


def main(argv: list[str] | None = None, env=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_errors = "--json" in argv
    try:
        args = _parser().parse_args(argv)
    finally:
        _Parser.json_errors = False
    if args.cmd == "make-secret":
        try:
            make_secret_file(args.path)
        except OSError as e:
            _say(f"tpu-offload-fs: cannot create {args.path!r}: {e.strerror or e} (it must not exist yet)",
                 sys.stderr)
            return EXIT_USAGE
        _say(f"wrote a 32-byte secret to {args.path} (mode 0600)")
        return EXIT_OK

    def fail(msg: str, code: int) -> int:
        """One line on stderr; under --json one object on stdout instead, so a parser of stdout sees why."""
        if args.json:
            _say(json.dumps(_clean({"error": f"tpu-offload-fs: {msg}", "exit_code": code})))
        else:
            _say(f"tpu-offload-fs: {msg}", sys.stderr)
        return code

    try:
        args.keyring = _keyring(args, os.environ if env is None else env)
    except ValueError as e:
        return fail(str(e), EXIT_USAGE)
    if not os.path.isdir(args.root) or not os.access(args.root, os.R_OK | os.X_OK):
        return fail(f"root {args.root!r} is missing or unreadable", EXIT_NO_ROOT)
    if args.cmd == "evict" and args.low > args.high:
        return fail(f"--low {args.low} is above --high {args.high}; allowed: --low <= --high", EXIT_USAGE)
    if not admin.tier_namespaces(args.root, args.namespace):
        what = f"namespace {args.namespace!r}" if args.namespace else "namespace directory"
        return fail(f"{args.root!r} holds no file tier (no {what} of one: <model>-<digest>, or kv-<tag> "
                    "with a secret); is it the shared_storage_path the engines use?", EXIT_NO_TIER)
    try:
        problems, unreadable, not_ours = _run(args)
    except admin.KeyRequired as e:
        return fail(str(e), EXIT_USAGE)
    except OSError as e:  # only the root itself can fail this way: everything below is skipped and listed
        return fail(f"cannot read root {args.root!r}: {e.strerror or e}", EXIT_NO_ROOT)
    if unreadable:
        _say(f"tpu-offload-fs: {len(unreadable)} path(s) could not be read and were skipped:", sys.stderr)
        for line in unreadable:
            _say(f"  {line}", sys.stderr)
    if not_ours:
        _say(f"tpu-offload-fs: {len(not_ours)} namespace(s) hold files of which not one verifies under this secret "
             "(another deployment's, or every file forged):", sys.stderr)
        for ns in not_ours:
            _say(f"  NOT OURS {ns}", sys.stderr)
    return EXIT_PROBLEMS if problems else EXIT_NOT_OURS if not_ours else EXIT_PARTIAL if unreadable else EXIT_OK


def _keyring(args, env) -> Keyring | None:
    """The secret the connectors would use, from the flags, then the environment; None without one."""
    salts = tuple(s.encode() for s in args.salt)
    if args.secret_file:
        try:
            return Keyring(read_secret_file(args.secret_file), salts)
        except ValueError as e:
            raise ValueError(f"--secret-file {args.secret_file!r}: not allowed; allowed: {e}") from None
    if args.config:
        obj = _read_config(args.config)
        extra = obj.get("kv_connector_extra_config", obj) if isinstance(obj, dict) else None
        path = extra.get("fs_secret_file") if isinstance(extra, dict) else None
        if not path:
            raise ValueError(f"--config {args.config!r}: no fs_secret_file in it; allowed: a kv-transfer-config "
                             "or extra config naming the tier's secret file")
        try:
            return Keyring(read_secret_file(path), salts)
        except ValueError as e:
            raise ValueError(f"--config {args.config!r}: fs_secret_file {path!r}: not allowed; allowed: {e}") from None
    if env.get("TPU_OFFLOAD_FS_SECRET_FILE"):
        path = env["TPU_OFFLOAD_FS_SECRET_FILE"]
        try:
            return Keyring(read_secret_file(path), salts)
        except ValueError as e:
            raise ValueError(f"TPU_OFFLOAD_FS_SECRET_FILE {path!r}: not allowed; allowed: {e}") from None
    if env.get("TPU_OFFLOAD_FS_SECRET"):
        try:
            return Keyring(check_secret(env["TPU_OFFLOAD_FS_SECRET"].encode()), salts)
        except ValueError as e:
            raise ValueError(f"TPU_OFFLOAD_FS_SECRET (value hidden): not allowed; allowed: {e}") from None
    if salts:
        raise ValueError("--salt needs the secret (--secret-file, --config, or the environment)")
    return None


MAX_CONFIG_BYTES = 1 << 20


def _read_config(path: str):
    """The JSON in ``path``, a regular file: a FIFO, a device or a directory is refused, never waited on."""
    allowed = f"allowed: a regular JSON file of at most {MAX_CONFIG_BYTES} bytes"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"--config {path!r}: cannot open it ({e.strerror or e}); {allowed}") from None
    try:
        st = os.fstat(fd)
        data = os.read(fd, MAX_CONFIG_BYTES + 1) if stat.S_ISREG(st.st_mode) else None
    except OSError as e:
        raise ValueError(f"--config {path!r}: cannot read it ({e.strerror or e}); {allowed}") from None
    finally:
        os.close(fd)
    if data is None:
        raise ValueError(f"--config {path!r}: not a regular file ({_kind(st.st_mode)}); {allowed}")
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path!r}: larger than {MAX_CONFIG_BYTES} bytes; {allowed}")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"--config {path!r}: cannot read a JSON object ({e}); {allowed}") from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def _run(args) -> tuple[bool, list[str], list[str]]:
    """Do the command and print its report; (problems found, paths skipped, namespaces not ours)."""
    if args.cmd == "evict":
        rep = admin.evict(args.root, budget_bytes=args.budget, high_pct=args.high, low_pct=args.low,
                          namespace=args.namespace, tmp_age_s=args.tmp_age, dry_run=args.dry_run,
                          keyring=args.keyring, per_namespace=args.budget_scope == "namespace")
        _emit(args, {**dataclasses.asdict(rep), "reached_low": rep.reached_low}, _evict_text(rep))
        return not rep.reached_low, rep.unreadable, []
    if args.cmd == "inspect":
        out = admin.inspect(args.root, args.namespace, keyring=args.keyring)
        _emit(args, out, _inspect_text(out))
        return False, out["unreadable"], []
    action = "quarantine" if args.quarantine else "delete" if args.delete else "report"
    rep = admin.verify(args.root, args.namespace, action, keyring=args.keyring)
    _emit(args, dataclasses.asdict(rep), _verify_text(rep))
    return bool(rep.bad), rep.unreadable, rep.foreign_namespaces


def _emit(args, obj, text: str) -> None:
    _say(json.dumps(_clean(obj), indent=2, default=str) if args.json else text)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _evict_text(r: admin.EvictReport) -> str:
    head = (f"{r.mode}: used {_gib(r.used_before)} of {_gib(r.total_bytes)} "
            f"(high {_gib(r.high_bytes)}, low {_gib(r.low_bytes)})")
    if not r.triggered:
        return f"{head}; below the high mark, nothing evicted; {r.temps_removed} stale temp files removed"
    verb = "would evict" if r.dry_run else "evicted"
    return (f"{head}\n{verb} {r.evicted_files} files ({_gib(r.evicted_bytes)}), now {_gib(r.used_after)}; "
            f"{r.temps_removed} stale temps removed ({r.clock} clock); "
            + (f"{r.temps_over_cap_removed} of {r.temps_over_cap} temps over the temp cap removed; "
               if r.temps_over_cap else "")
            + f"skipped: {r.skipped_vanished} vanished, "
            f"{r.skipped_recently_used} used meanwhile, {r.skipped_not_ours} without our magic; "
            f"{r.not_ours} files not ours (no magic, or not signed with the secret) not counted"
            + ("" if r.reached_low else "\nWARNING: could not reach the low mark"))


def _age(s) -> str:
    return "-" if s is None else f"{s:.0f}s"


def _inspect_text(out: dict) -> str:
    lines = [f"{out['root']}: filesystem {_gib(out['fs_used_bytes'])} used of {_gib(out['fs_total_bytes'])}",
             f"{'namespace':<60} {'files':>8} {'size':>12} {'temps':>6} {'quar':>5} "
             f"{'newest':>8} {'median':>8} {'oldest':>8}"]
    for n in out["namespaces"]:
        lines.append(f"{n['namespace'][:60]:<60} {n['files']:>8} {_gib(n['bytes']):>12} {n['temps']:>6} "
                     f"{n['quarantined']:>5} {_age(n['newest_access_age_s']):>8} "
                     f"{_age(n['median_access_age_s']):>8} {_age(n['oldest_access_age_s']):>8}")
        if n["foreign_entries"]:
            lines.append(f"  {n['foreign_entries']} foreign entries (not ours: never counted, deleted or moved), "
                         f"e.g. {n['foreign'][0] if n['foreign'] else '?'}")
    if not out["namespaces"]:
        lines.append("(no namespaces)")
    return "\n".join(lines)


def _verify_text(r: admin.VerifyReport) -> str:
    lines = [f"checked {r.checked} files: {r.ok} ok, {len(r.bad)} bad"
             + (f" ({r.forged} forged)" if r.forged else "")
             + (f", {r.unverified_salt} of a tenant salt not given (header ours, payload unchecked: --salt)"
                if r.unverified_salt else "")
             + (f" ({r.action}d)" if r.bad and r.action != "report" else "")
             + (f", {r.vanished} vanished during the check" if r.vanished else "")]
    lines += [f"BAD {path}: {reason}" for path, reason in r.bad]
    lines += [f"NOT OURS {ns}: nothing there verifies under this secret" for ns in r.foreign_namespaces]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
