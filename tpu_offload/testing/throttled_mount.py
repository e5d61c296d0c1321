"""A slow mount made at the OS level: a FUSE passthrough of a directory with per-read latency and a
shared bandwidth cap, for proving what a slow shared mount does to the file tier and the load decision.

    python -m tpu_offload.testing.throttled_mount SRC MNT --latency-ms 2 --mbps 40 [--control FILE]

Why not the file tier's fault hook (``fileio.fault``): it delays only the reads the tier's own
wrapper makes, inside the engine's process, so it cannot show what the kernel, the page cache, a
probe or a second process see of a slow mount. Here every ``read`` request the kernel sends the
mount waits ``latency`` (requests in flight overlap) and then its turn at a bandwidth shared by all
threads (a token bucket with no burst: ``n`` bytes occupy the link for ``n / rate`` seconds, one
request after another), before the bytes are read from ``SRC``. The mount uses ``direct_io``: no
page cache answers a read twice, so every read of the tier crosses the throttle. The kernel splits a
large read into requests of at most ``max_read`` bytes (128 KiB by default), so latency is
paid per request, as on a network mount. Writes, metadata and directory operations pass through
unthrottled; owners, modes, inode numbers (``use_ino``), link counts and times are the source's, so
the file tier's safety checks see what they would on a local disk. An unlinked file still open is
removed at once (``hard_remove``), not renamed to a hidden name a directory scan would see.

The speed can change while mounted: ``ThrottledMount.set`` rewrites the control file (outside the
mount), and the mount rereads it before the next read request. ``ThrottledMount`` (a context
manager) starts the mount in a subprocess, waits until it is mounted, and always unmounts
(``fusermount3 -u``, then a lazy unmount); ``skip_reason()`` says why a mount cannot be made here.
Needs ``/dev/fuse``, ``fusermount3`` (the fuse3 package), libfuse and ``mfusepy`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

FUSERMOUNT = ("fusermount3", "fusermount")


class Throttle:
    """Per-request latency and a bandwidth shared by every thread, reread from ``control`` when it changes."""

    def __init__(self, latency_ms: float, mbps: float, control: str | None = None):
        self.latency_s, self.rate = latency_ms / 1e3, mbps * 1e6  # MB/s (10^6 bytes); 0: uncapped
        self.control = control
        self._seen = None
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link is next free (monotonic seconds)
        self.reads = self.bytes = 0

    def _reload(self) -> None:
        if self.control is None:
            return
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            return
        ident = (st.st_ino, st.st_mtime_ns, st.st_size)
        if ident != self._seen:
            with open(self.control) as f:
                c = json.load(f)
            self.latency_s, self.rate, self._seen = c["latency_ms"] / 1e3, c["mbps"] * 1e6, ident

    def wait(self, nbytes: int) -> None:
        """Block for one read request of ``nbytes``: its latency, then its turn on the link."""
        with self._lock:
            self._reload()
            self.reads, self.bytes = self.reads + 1, self.bytes + nbytes
            latency, rate = self.latency_s, self.rate
        if latency > 0:
            time.sleep(latency)
        if rate > 0:
            with self._lock:
                start = max(time.monotonic(), self._free_at)
                self._free_at = done = start + nbytes / rate
            time.sleep(max(0.0, done - time.monotonic()))


def _operations(src: str, throttle: Throttle, stats: str | None):
    """mfusepy operations passing every call through to ``src`` (file handles are real descriptors)."""
    import mfusepy

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self):
            self.root = os.path.realpath(src)
            self._as_root = os.geteuid() == 0
            self._written = (0, 0)

        def _real(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _own(self, real: str) -> None:
            """What the caller creates is the caller's (the daemon may run as root for everyone)."""
            if self._as_root:
                uid, gid, _ = mfusepy.fuse_get_context()
                os.lchown(real, uid, gid)

        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
            keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_blksize", "st_rdev")
            out = {k: getattr(st, k) for k in keys}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return out

        def access(self, path, amode):
            if not os.access(self._real(path), amode, follow_symlinks=False):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def readdir(self, path, fh):
            # with inode numbers (use_ino): an entry of inode 0 is one libc's readdir skips
            real = self._real(path)
            out = [(n, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0)
                   for n, st in ((n, os.lstat(os.path.join(real, n))) for n in (".", ".."))]
            with os.scandir(real) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed meanwhile
                        continue
                    out.append((e.name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
            return out

        def readlink(self, path):
            return os.readlink(self._real(path))

        def mkdir(self, path, mode):
            os.mkdir(self._real(path), mode)
            self._own(self._real(path))
            return 0

        def rmdir(self, path):
            os.rmdir(self._real(path))
            return 0

        def unlink(self, path):
            os.unlink(self._real(path))
            return 0

        def symlink(self, target, source):  # target: the link's path; source: what it points at
            os.symlink(source, self._real(target))
            self._own(self._real(target))
            return 0

        def link(self, target, source):  # target: the new name; source: an existing file
            os.link(self._real(source), self._real(target))
            return 0

        def rename(self, old, new):
            os.rename(self._real(old), self._real(new))
            return 0

        def chmod(self, path, mode):
            os.chmod(self._real(path), mode, follow_symlinks=False)
            return 0

        def chown(self, path, uid, gid):
            os.lchown(self._real(path), uid, gid)
            return 0

        def utimens(self, path, times=None):
            os.utime(self._real(path), ns=times, follow_symlinks=False) if times else os.utime(self._real(path))
            return 0

        def truncate(self, path, length, fh=None):
            os.ftruncate(fh, length) if fh is not None else os.truncate(self._real(path), length)
            return 0

        @staticmethod
        def _flags(flags: int) -> int:
            # The kernel already applied O_EXCL (with O_CREAT) and O_NOFOLLOW at lookup; O_DIRECT would
            # need aligned buffers here (the mount's direct_io keeps reads off the page cache already).
            return (flags & ~getattr(os, "O_DIRECT", 0)) | os.O_CLOEXEC

        def open(self, path, flags):
            return os.open(self._real(path), self._flags(flags))

        def create(self, path, mode, flags):
            real = self._real(path)
            fd = os.open(real, self._flags(flags) | os.O_CREAT | os.O_EXCL, mode)
            self._own(real)
            return fd

        def read(self, path, size, offset, fh):
            data = os.pread(fh, size, offset)
            throttle.wait(len(data))  # the bytes sent (a request past the end asks for more)
            self._write_stats()
            return data

        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

        def fsync(self, path, datasync, fh):
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        def fsyncdir(self, path, datasync, fh):
            fd = os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return 0

        def statfs(self, path):
            sv = os.statvfs(self._real(path))
            keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                    "f_flag", "f_namemax")
            return {k: getattr(sv, k) for k in keys}

        def _write_stats(self) -> None:
            if stats is None or (throttle.reads, throttle.bytes) == self._written:
                return
            self._written = (throttle.reads, throttle.bytes)
            tmp = f"{stats}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"reads": throttle.reads, "bytes": throttle.bytes}, f)
            os.replace(tmp, stats)

    class _Fuse(mfusepy.FUSE):
        def rename_fuse_3(self, old, new, flags):
            if flags:  # RENAME_NOREPLACE / RENAME_EXCHANGE: refused rather than silently replacing
                return -errno.EINVAL
            return super().rename_fuse_3(old, new, flags)

    return Passthrough(), _Fuse


def serve(src: str, mnt: str, latency_ms: float, mbps: float, control: str | None, stats: str | None) -> None:
    """Mount (in the foreground) until unmounted."""
    throttle = Throttle(latency_ms, mbps, control)
    ops, fuse = _operations(src, throttle, stats)
    fuse(ops, mnt, foreground=True, direct_io=True, use_ino=True, hard_remove=True, default_permissions=True,
         attr_timeout=0, entry_timeout=0, negative_timeout=0, fsname="throttled")


def _fusermount() -> str | None:
    return next((p for p in map(shutil.which, FUSERMOUNT) if p), None)


@functools.cache
def skip_reason() -> str | None:
    """Why a throttled mount cannot be made on this machine (``None``: it can; a trial mount says so)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if _fusermount() is None:
        return "no fusermount3 on PATH (install the fuse3 package)"
    import ctypes.util

    if not (ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")):
        return "no libfuse (install the fuse3 package)"
    try:
        import mfusepy  # noqa: F401
    except ImportError as e:
        return f"mfusepy is not installed (the test extra pins it): {e}"
    except Exception as e:  # it loads libfuse when imported
        return f"mfusepy cannot load libfuse: {e}"
    with tempfile.TemporaryDirectory(prefix="throttled-probe-") as tmp:
        src, mnt = os.path.join(tmp, "src"), os.path.join(tmp, "mnt")
        os.mkdir(src)
        os.mkdir(mnt)
        try:
            with ThrottledMount(src, mnt, timeout_s=20):
                pass
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"a FUSE mount is not permitted here: {e}"
    return None


class ThrottledMount:
    """``SRC`` mounted throttled at ``MNT`` in a subprocess while the ``with`` block runs."""

    def __init__(self, src, mnt, latency_ms: float = 0.0, mbps: float = 0.0, timeout_s: float = 30.0):
        self.src, self.mnt = os.fspath(src), os.fspath(mnt)
        self.timeout_s = timeout_s
        self._tmp = tempfile.mkdtemp(prefix="throttled-ctl-")
        self.control = os.path.join(self._tmp, "control.json")
        self.stats_path = os.path.join(self._tmp, "stats.json")
        self.log = os.path.join(self._tmp, "mount.log")
        self.proc: subprocess.Popen | None = None
        self.set(latency_ms, mbps)

    def set(self, latency_ms: float, mbps: float) -> None:
        """New speed for every read request after this returns (``mbps`` 0: no cap)."""
        self.latency_ms, self.mbps = float(latency_ms), float(mbps)
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"latency_ms": self.latency_ms, "mbps": self.mbps}, f)
        os.replace(tmp, self.control)  # a new inode: the mount sees the change at its next read

    def stats(self) -> dict:
        """Read requests and bytes the mount served so far."""
        try:
            with open(self.stats_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {"reads": 0, "bytes": 0}

    def __enter__(self) -> "ThrottledMount":
        os.makedirs(self.mnt, exist_ok=True)
        dev = os.stat(self.mnt).st_dev
        cmd = [sys.executable, "-m", "tpu_offload.testing.throttled_mount", self.src, self.mnt,
               "--latency-ms", str(self.latency_ms), "--mbps", str(self.mbps), "--control", self.control,
               "--stats", self.stats_path]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with open(self.log, "wb") as log:  # its own session: a ^C to the caller does not kill the mount under it
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + self.timeout_s
        while not self._mounted(dev):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                with open(self.log, errors="replace") as f:
                    out = f.read()[-2000:].strip() or "no output"
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise RuntimeError(f"mount of {self.mnt} failed: {out}")
            time.sleep(0.02)
        return self

    def _mounted(self, dev: int) -> bool:
        try:
            return os.stat(self.mnt).st_dev != dev
        except OSError:  # mounted, but its daemon is gone (it failed after mounting)
            return False

    def __exit__(self, *exc) -> None:
        self._stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _stop(self) -> None:
        fm = _fusermount()
        if self.proc is not None and fm is not None:
            for args in ((fm, "-u", self.mnt), (fm, "-u", "-z", self.mnt)):
                if subprocess.run(args, capture_output=True).returncode == 0:
                    break
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("mnt")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to every read request")
    ap.add_argument("--mbps", type=float, default=0.0, help="MB/s (10^6 bytes) shared by all reads; 0: no cap")
    ap.add_argument("--control", help="JSON {latency_ms, mbps} reread when it changes (set at runtime)")
    ap.add_argument("--stats", help="where to write the read requests and bytes served")
    a = ap.parse_args(argv)
    serve(a.src, a.mnt, a.latency_ms, a.mbps, a.control, a.stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
