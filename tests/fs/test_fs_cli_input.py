"""``tpu-offload-fs`` on hostile or careless input: any file name, any ``--config``, errors under ``--json``.

The shared directory is written by others: a name that is not UTF-8 must
be printed escaped (never a traceback and exit 1, which means "bad files"),
a ``--config`` that is a FIFO must be refused at once (never waited on), and
a caller that asked for ``--json`` gets its errors as JSON too.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from test_fs_cli import _fill
from tpu_offload.core.fs.cli import EXIT_NO_ROOT, EXIT_NO_TIER, EXIT_OK, EXIT_USAGE, main

BAD = b"\xff\xfe"  # not UTF-8: Python hands it over as lone surrogates




@pytest.fixture
def hostile_names(root, make_tier):
    """Our tier, plus a directory in the root and a file in our namespace with names that are not UTF-8."""
    t = _fill(make_tier, root, range(3))
    os.mkdir(os.path.join(os.fsencode(root), BAD))
    with open(os.path.join(os.fsencode(t.ns_dir), BAD), "wb") as f:
        f.write(b"junk")
    return t


@pytest.mark.parametrize("argv", [["inspect"], ["verify"], ["evict", "--budget", "1GiB"]])
def test_a_name_that_is_not_utf8_is_printed_escaped(capsys, root, hostile_names, argv):
    code = main([argv[0], root, *argv[1:]], env={})
    cap = capsys.readouterr()
    assert code == EXIT_OK, cap
    if argv[0] == "inspect":
        assert "\\xff\\xfe" in cap.out  # the namespace row and the foreign entry, escaped
        assert "\udcff" not in cap.out


@pytest.mark.parametrize("cmd", ["inspect", "verify", "evict"])
def test_json_reports_hold_no_lone_surrogates(capsys, root, hostile_names, cmd):
    code = main([cmd, root, "--json"], env={})
    out = capsys.readouterr().out
    assert code == EXIT_OK
    out.encode("utf-8")  # strictly: a lone surrogate raises here
    rep = json.loads(out)
    if cmd == "inspect":
        names = [n["namespace"] for n in rep["namespaces"]]
        assert "\\xff\\xfe" in names
        assert any(p.endswith("\\xff\\xfe") for n in rep["namespaces"] for p in n["foreign"])


def test_a_fifo_as_config_is_refused_at_once(capsys, root, hostile_names, tmp_path):
    fifo = str(tmp_path / "config.json")
    os.mkfifo(fifo)
    result = []
    th = threading.Thread(target=lambda: result.append(main(["inspect", root, "--config", fifo], env={})),
                          daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():  # the old code waits for a writer: give it one, so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        th.join(10)
        pytest.fail("--config naming a FIFO blocked")
    err = capsys.readouterr().err
    assert result == [EXIT_USAGE]
    assert err.count("\n") == 1 and "not a regular file (a FIFO)" in err and "--config" in err


def test_a_directory_as_config_is_refused(capsys, root, hostile_names, tmp_path):
    assert main(["inspect", root, "--config", str(tmp_path)], env={}) == EXIT_USAGE
    assert "not a regular file (a directory)" in capsys.readouterr().err


def test_a_config_file_still_names_the_secret(capsys, root, hostile_names, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"kv_connector_extra_config": {}}))
    assert main(["inspect", root, "--config", str(cfg)], env={}) == EXIT_USAGE
    assert "no fs_secret_file in it" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code", [
    (["inspect", "/nonexistent/root"], EXIT_NO_ROOT),
    (["evict", "{root}", "--budget", "lots"], EXIT_USAGE),
    (["evict", "{root}", "--low", "95"], EXIT_USAGE),
    (["inspect", "{root}", "--namespace", "nope-00000000000000000000000000000000"], EXIT_NO_TIER),
    (["verify", "{root}", "--salt", "tenant-a"], EXIT_USAGE),
])
def test_errors_under_json_are_json(capsys, root, hostile_names, argv, code):
    argv = [a.format(root=root) for a in argv] + ["--json"]
    with pytest.raises(SystemExit) if code == EXIT_USAGE and "lots" in argv else _nothing() as exc:
        got = main(argv, env={})
    if exc is not None:
        got = exc.value.code
    cap = capsys.readouterr()
    assert got == code
    obj = json.loads(cap.out)
    assert obj["exit_code"] == code and obj["error"].startswith("tpu-offload-fs")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
