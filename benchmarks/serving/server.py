"""Start an OpenAI-compatible server as a child process, wait for it, watch it, stop it.

Every wait is bounded; ``stop`` ends only the process tree this module started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, port: int, startup_s: float = 420):
        """``cmd`` runs in the log's directory: ``python -m`` puts its working directory first
        on ``sys.path``, and only ``env``'s PYTHONPATH may decide which code is imported."""
        self.cmd, self.env, self.log, self.port, self.startup_s = cmd, env, Path(log), port, startup_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            # own session: stop() signals this tree (API server + engine core) and nothing else
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=self.log.parent, start_new_session=True)
        t0, deadline = time.monotonic(), time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log {self.log}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_seconds = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_s:.0f} s; log {self.log}:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def pids(self) -> list[int]:
        """The server process and its descendants (engine core, workers)."""
        if self.proc is None:
            return []
        import psutil

        try:
            p = psutil.Process(self.proc.pid)
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_bytes(self) -> int:
        """Resident memory of the whole server tree."""
        import psutil

        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
