"""The few CUDA runtime calls torch does not wrap: host (un)registration and
``cudaGetLastError``, through the ``libcudart`` torch already loaded.

A failed ``cudaHostRegister`` leaves its error as the thread's "last error",
and the next kernel launch check (``cudaGetLastError`` after the launch)
raises it as if the kernel had failed. ``torch.cuda.cudart()`` has no
``cudaGetLastError``, so we bind the runtime ourselves (as vLLM's
``CudaRTLibrary`` does) and clear the error right after a failure.
"""

from __future__ import annotations

import ctypes
import functools
import os


def find_loaded_library(prefix: str, maps: str = "/proc/self/maps") -> str | None:
    """Path of the first mapped shared object whose file name starts with ``prefix``."""
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        return None
    return None


class CudaRuntime:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        return int(self._register(ctypes.c_void_p(ptr), size, flags))

    def host_unregister(self, ptr: int) -> int:
        return int(self._unregister(ctypes.c_void_p(ptr)))

    def clear_last_error(self) -> int:
        """Return and clear this thread's pending CUDA error (0: none)."""
        return int(self._last_error())

    def error_string(self, err: int) -> str:
        s = self._error_string(err)
        return s.decode() if s else f"cudaError {err}"


@functools.lru_cache(maxsize=1)
def runtime() -> CudaRuntime:
    """The process's CUDA runtime (initialise CUDA first, e.g. via torch)."""
    path = find_loaded_library("libcudart") or os.environ.get("VLLM_CUDART_SO_PATH")
    if not path:
        raise RuntimeError("libcudart is not loaded in this process; set VLLM_CUDART_SO_PATH")
    return CudaRuntime(path)
