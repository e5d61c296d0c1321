"""Flush at interpreter exit: tpu-inference never shuts a worker down.

TPUWorker has no shutdown, and a multi-host replica's Ray workers just exit,
so queued file writes and the warm-restart snapshot would be lost. Apart
from the worker because it runs outside every engine hook, at interpreter
shutdown, where what may still run (threads, pools) is limited.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading

log = logging.getLogger(__name__)


class ExitHook:
    """Shuts down, at process exit, a worker nobody shut down (its file writes and snapshot would be lost).

    Holds the worker until its ``shutdown`` (which clears ``worker``), so one
    dropped without a shutdown still flushes.
    """

    def __init__(self, worker):
        self.worker = worker

    def __call__(self) -> None:
        worker, self.worker = self.worker, None
        if worker is None or worker.engine is None:
            return
        log.info("tpu_offload: process exiting without a connector shutdown: flushing file writes")
        if worker._snapshot_id and sys.version_info >= (3, 12):
            # Python 3.12 starts no thread once the interpreter is exiting, and orbax's writers are threads.
            log.warning("tpu_offload: the warm-restart slabs cannot be saved at interpreter exit; shut the engine "
                        "down (the executor's shutdown reaches the workers' connectors first) to keep them")
            worker._snapshot_id = ""
        try:
            worker.shutdown()
        except Exception:
            log.exception("tpu_offload: shutdown at exit failed")


def register_at_exit(hook: ExitHook) -> None:
    """Run ``hook`` when the interpreter exits, while thread pools still take work.

    ``threading._register_atexit`` hooks run at the start of interpreter
    shutdown, last registered first, so before ``concurrent.futures`` refuses
    new work (the snapshot's writers use it) and before any atexit handler
    (jax's among them); the file tier's I/O threads are daemons, alive until
    then. Plain ``atexit`` where it is missing.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(hook)
            return
    except RuntimeError:  # already shutting down
        return
    atexit.register(hook)
