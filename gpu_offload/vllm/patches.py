"""The one module that changes vLLM's classes: what ``HostOffloadSpec`` still patches, why, and the start check.

Everything else of the vLLM path goes through vLLM's extension points
(``OffloadingSpec`` / ``OffloadingManager`` / ``OffloadingWorker``, the
manager's ``get_stats`` and ``take_events``, ``get_load_source``). What those
cannot do is listed in ``PATCHES``: each entry names the member of vLLM's
``OffloadingConnector`` (or of its offloading scheduler module) it wraps or
fills in, what it does, what vLLM's API lacks, and the parameters we expect
the member to have. ``docs/vllm.md`` carries the same table (a test keeps
them equal). The behaviour of each patch lives in ``hooks``; only this module
puts it on vLLM's classes.

``install`` runs when a ``HostOffloadSpec`` is built (never at import), is
idempotent, and first checks every entry against the installed vLLM: a member
that is gone, has other parameters, or that vLLM now implements itself (an
``add`` entry) stops the start with one ``VllmMismatch`` naming each such
member, the vLLM version found and the one supported, before anything is
patched. The patches are class-wide, so they also sit on an engine of this
process that uses another spec; each hook checks for our manager or worker
and otherwise runs vLLM's own code unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, Callable

from gpu_offload.vllm import compat, hooks
from gpu_offload.vllm.compat import OffloadingConnector

SUPPORTED_VLLM = "0.32"  # the version the expectations below were read from
CONNECTOR = "OffloadingConnector"
SCHEDULER_MODULE = "offloading.scheduler"  # vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler
MARK = "_tpu_offload_hook"


class VllmMismatch(RuntimeError):
    """The installed vLLM's connector no longer matches what our patches expect."""


@dataclasses.dataclass(frozen=True)
class Patch:
    owner: str  # CONNECTOR or SCHEDULER_MODULE
    name: str
    kind: str  # "wrap": ours runs around vLLM's member; "add": vLLM's base member does nothing, ours does the job
    params: tuple[str, ...]  # the parameters of vLLM's member we expect
    make: Callable  # wrap: vLLM's member -> ours; add: ours
    does: str
    lacks: str  # what vLLM's API lacks, so that a patch is needed
    since: str = SUPPORTED_VLLM

    @property
    def title(self) -> str:
        return f"{self.owner}.{self.name}"


PATCHES: tuple[Patch, ...] = (
    Patch(CONNECTOR, "get_transfer_results", "wrap", ("self", "finished_req_ids"), hooks.wrap_get_transfer_results,
          "reports a failed load job: its engine blocks (one KV-cache group) or its request (`failed_recving`, "
          "hybrid models), for vLLM to recompute",
          "`OffloadingWorker.get_finished` can report `success=False`, but vLLM's worker side asserts success"),
    Patch(CONNECTOR, "get_block_ids_with_load_errors", "add", ("self",), hooks.get_block_ids_with_load_errors,
          "hands vLLM the blocks of failed loads",
          "`OffloadingConnector` does not implement it (the base returns nothing)"),
    Patch(CONNECTOR, "update_connector_output", "wrap", ("self", "connector_output"),
          hooks.wrap_update_connector_output,
          "hands each step's worker report to our manager: failed loads (their chunks stop being hits: no reload "
          "loop), file-tier outcomes (KV events), worker metrics, the steps done (the load decision's clock)",
          "the manager sees a finished job only as `complete_load(keys)`, with no success flag and no "
          "worker report"),
    Patch(CONNECTOR, "build_connector_meta", "wrap", ("self", "scheduler_output"), hooks.wrap_build_connector_meta,
          "numbers each step's metadata and tells our manager the step's token count (the load-or-recompute "
          "decision times each step from its scheduling to its output)",
          "`on_schedule_end` carries no token count, and the manager cannot tag the metadata the workers get"),
    Patch(CONNECTOR, "build_connector_worker_meta", "wrap", ("self",), hooks.wrap_build_connector_worker_meta,
          "adds each worker's file-tier outcomes, failed chunks, metrics and the step's number to the worker "
          "report",
          "an `OffloadingWorker` reports only `TransferResult`s (job id, success, bytes, time)"),
    Patch(CONNECTOR, "register_kv_caches", "wrap", ("self", "kv_caches"), hooks.wrap_register_kv_caches,
          "refuses a second offloading engine in the same process with one clear error",
          "vLLM keeps one worker connector per process and maps a second engine's KV caches with the first "
          "engine's layout before the spec sees them; `get_worker` still refuses it when the layouts agree"),
    Patch(CONNECTOR, "bind_gpu_block_pool", "add", ("self", "gpu_block_pool"), hooks.bind_gpu_block_pool,
          "hands vLLM's device block pool to our manager: chunks the device still caches are hits past a chunk "
          "only our tiers hold (interleaved HBM/host lookups)",
          "`OffloadingConnector` does not implement it, and the manager has no access to the block pool"),
    Patch(CONNECTOR, "get_num_new_matched_tokens", "wrap", ("self", "request", "num_computed_tokens"),
          hooks.wrap_get_num_new_matched_tokens,
          "opens and closes a request's lookup, so the device blocks it references are the hit's and no more",
          "the manager sees one key at a time (`lookup`): not the request's block hashes, vLLM's own hit, or the "
          "lookup's end"),
    Patch(CONNECTOR, "update_state_after_alloc", "wrap", ("self", "request", "blocks", "num_external_tokens"),
          hooks.wrap_update_state_after_alloc,
          "releases the device blocks a lookup referenced once vLLM has allocated the request",
          "a request that loads nothing gets no manager call after its allocation, and `on_schedule_end` comes "
          "after every allocation of the step: too late to free the blocks for the step's other requests"),
    Patch(SCHEDULER_MODULE, "_create_req_context", "wrap", ("req",), hooks.wrap_create_req_context,
          "keeps the request's `cache_salt` in its `ReqContext` (files named and signed per tenant)",
          "`ReqContext` carries `kv_transfer_params` and `kv_hints`, not the `cache_salt`"),
)

# Attributes of vLLM's objects the hooks read (owner, attribute, who reads it).
ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("OffloadingConnectorWorker", "_load_jobs", "get_transfer_results: a failed job's request"),
    ("OffloadingConnectorScheduler", "_jobs", "update_connector_output: a failed job's chunks"),
    ("OffloadingConnectorScheduler", "manager", "the scheduler-side hooks"),
    ("KVConnectorTransferResults", "failed_recving", "get_transfer_results: hybrid models"),
    ("ReqContext", "set_state", "_create_req_context: the request's salt"),
)

_lock = threading.Lock()


def _owners() -> dict[str, Any]:
    return {CONNECTOR: OffloadingConnector, SCHEDULER_MODULE: compat.offloading_scheduler}


def _attribute_owners() -> dict[str, Any]:
    return {"OffloadingConnectorWorker": compat.OffloadingConnectorWorker,
            "OffloadingConnectorScheduler": compat.OffloadingConnectorScheduler,
            "KVConnectorTransferResults": compat.KVConnectorTransferResults, "ReqContext": compat.ReqContext}


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # pragma: no cover - vLLM imported above through compat
        return "unknown"


def _params(fn) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _vllm_member(patch: Patch, owner) -> tuple[Any, str | None]:
    """(vLLM's own member behind ``patch``, or why it does not match)."""
    current = getattr(owner, patch.name, None)
    if patch.kind == "add":  # vLLM calls the base's member (checked below); ours takes its place on the class
        own = vars(owner).get(patch.name)
        if own is not None and not getattr(own, MARK, False):
            return own, "vLLM now implements it itself"
        current = next((vars(k)[patch.name] for k in owner.__mro__[1:] if patch.name in vars(k)), None)
    elif current is not None and getattr(current, MARK, False):
        current = getattr(current, "__wrapped__", None)
    if current is None or not callable(current):
        return None, "it is missing"
    found = _params(current)
    if found != patch.params:
        shown = "(unreadable)" if found is None else f"({', '.join(found)})"
        return current, f"expected parameters ({', '.join(patch.params)}), found {shown}"
    return current, None


def _attribute_missing(cls, attr: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return attr not in {f.name for f in dataclasses.fields(cls)} and not hasattr(cls, attr)
    if hasattr(cls, attr):
        return False
    init = getattr(cls, "__init__", None)
    code = getattr(init, "__code__", None)
    return code is None or attr not in code.co_names


def mismatches() -> list[str]:
    """Each way the installed vLLM differs from what ``PATCHES`` and ``ATTRIBUTES`` expect, as one line."""
    out = []
    owners = _owners()
    for p in PATCHES:
        _, why = _vllm_member(p, owners[p.owner])
        if why:
            out.append(f"{p.title}: {why}")
    for owner, attr, reader in ATTRIBUTES:
        cls = _attribute_owners()[owner]
        if _attribute_missing(cls, attr):
            out.append(f"{owner}.{attr} is missing (read by {reader})")
    return out


def check() -> None:
    """Raise ``VllmMismatch`` naming every member that no longer matches."""
    bad = mismatches()
    if bad:
        raise VllmMismatch(
            f"gpu_offload: HostOffloadSpec cannot run on vLLM {vllm_version()}: its OffloadingConnector no longer "
            f"matches what our patches of it expect (supported: vLLM {SUPPORTED_VLLM}.x):\n  - "
            + "\n  - ".join(bad)
            + f"\nInstall vllm=={SUPPORTED_VLLM}.*, or keep this vLLM and add only our file tier to its own "
            "offloading (TieringOffloadingSpec with secondary_tiers SharedFileTier, docs/vllm-tiers.md), "
            "which patches nothing."
        )


def installed() -> list[str]:
    """The patches in place now (``owner.name``)."""
    owners = _owners()
    return [p.title for p in PATCHES if getattr(vars(owners[p.owner]).get(p.name), MARK, False)]


def install() -> None:
    """Check the installed vLLM, then put every patch in place once (idempotent, thread-safe)."""
    with _lock:
        check()
        owners = _owners()
        for p in PATCHES:
            owner = owners[p.owner]
            if getattr(vars(owner).get(p.name), MARK, False):
                continue
            if p.kind == "wrap":
                orig = getattr(owner, p.name)
                new = p.make(orig)
                new.__wrapped__ = orig
            else:
                new = p.make
            setattr(new, MARK, True)
            setattr(owner, p.name, new)
