"""One start-up decision for every JAX process of a replica (multi-host).

Every host must compile and launch the same programs in the same order. A
host that sized a buffer differently, or refused to start while its peers
went on, stalls the whole mesh (tpu-inference #3429: hosts computed 1850 and
1861 pages, and the mesh halted on a launch-id mismatch). So what a host
measures (free RAM, free HBM, kernel limits) or reads from its own
environment is exchanged once at registration, and every host takes the same
decision from the same table: sizes are min-reduced, settings must be equal,
and one host's refusal is every host's, with the same message.

The exchange goes through JAX's coordination service (the key-value store
``jax.distributed`` starts), not an XLA program: nothing is compiled or
launched, and a peer that never reports is an error after ``timeout_s``,
naming it, not a hang. One process exchanges nothing.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Any, Iterable, Mapping

import jax

from tpu_offload.core.config import ConfigError

_rounds: dict[str, int] = {}  # per name, how many exchanges this process made (peers make the same)


class AgreementError(RuntimeError):
    """A peer sent nothing within the timeout: it failed before this point, or is stuck."""


@dataclasses.dataclass(frozen=True)
class Peer:
    process: int
    host: str
    figures: dict
    error: str | None  # why this host refuses to start (None: it would start)

    @property
    def name(self) -> str:
        return f"process {self.process} ({self.host})"


def _client():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise AgreementError(f"{jax.process_count()} JAX processes but no jax.distributed client: "
                             "the hosts cannot agree on the offload connector's sizes")
    return global_state.client


def exchange(name: str, figures: Mapping[str, Any], error: str | None = None, *,
             timeout_s: float = 300.0) -> list[Peer]:
    """Every process's ``figures`` and ``error``, in process order (the same list on every host).

    ``figures`` must be JSON values. One process: only its own, nothing sent."""
    me = Peer(jax.process_index(), socket.gethostname(), dict(figures), error)
    count = jax.process_count()
    if count == 1:
        return [me]
    client = _client()
    n = _rounds[name] = _rounds.get(name, 0) + 1
    prefix = f"tpu_offload/agree/{name}/{n}"
    client.key_value_set(f"{prefix}/{me.process}", json.dumps(dataclasses.asdict(me), sort_keys=True))
    deadline = time.monotonic() + timeout_s
    peers, missing = [], []
    for p in range(count):
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            peers.append(Peer(**json.loads(client.blocking_key_value_get(f"{prefix}/{p}", wait_ms))))
        except Exception:  # the coordination service's DEADLINE_EXCEEDED (or the service is gone)
            missing.append(p)
    if missing:
        raise AgreementError(
            f"tpu_offload: {len(missing)} of {count} JAX processes (process {', '.join(map(str, missing))}) sent no "
            f"{name} figures within {timeout_s:g} s (multihost_timeout_s, TPU_OFFLOAD_MULTIHOST_TIMEOUT_S): each "
            "failed before registering the offload connector or is stuck there; see its log. This process stops "
            "rather than launch programs its peers would not")
    return peers


def settle(name: str, figures: Mapping[str, Any], error: str | None = None, *, equal: Iterable[str] = (),
           minimum: Iterable[str] = (), timeout_s: float = 300.0) -> dict:
    """Exchange, then decide as every host will: raise ``ConfigError`` (the same message on every host) if
    any host refuses or the ``equal`` keys differ; else the figures with the ``minimum`` keys min-reduced."""
    peers = exchange(name, figures, error, timeout_s=timeout_s)
    refused = [p for p in peers if p.error]
    if refused:
        raise ConfigError(
            f"tpu_offload refuses to start on every host because {len(refused)} of {len(peers)} JAX processes "
            "refused: " + "; ".join(f"{p.name}: {p.error}" for p in refused))
    for key in equal:
        values = {json.dumps(p.figures.get(key), sort_keys=True) for p in peers}
        if len(values) > 1:
            raise ConfigError(
                f"tpu_offload: the hosts disagree on {key}: "
                + ", ".join(f"{p.name} has {p.figures.get(key)!r}" for p in peers)
                + ". Every host must run the same --kv-transfer-config and TPU_OFFLOAD_* environment (and the "
                "same devices): their programs would differ and the mesh would stall")
    out = dict(figures)
    for key in minimum:
        out[key] = min(p.figures[key] for p in peers)
    return out


def unanimous(name: str, ok: bool, detail: str = "", *, timeout_s: float = 300.0) -> tuple[bool, str]:
    """(True, "") if every process says ``ok``; else (False, the hosts that did not, with their ``detail``):
    the same answer on every host, for a choice all must make alike (warm or cold start)."""
    peers = exchange(name, {"ok": bool(ok), "detail": detail}, timeout_s=timeout_s)
    no = [p for p in peers if not p.figures["ok"]]
    return not no, "; ".join(f"{p.name}: {p.figures['detail']}" for p in no)
