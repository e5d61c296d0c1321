"""An ASGI middleware for vLLM's OpenAI server (``--middleware``) that turns inference-perf's
session header into the lease hint.

inference-perf's session replay cannot add body fields per session; it can send each request's
session id in a header (``api.session_id_header_key``). With ``BENCH_LEASE_TTL_S`` set in the
server's environment, this middleware copies that header into the request body as
``kv_transfer_params = {"tpu_offload_lease": {"session": <id>, "ttl_s": <ttl>}}``, exactly what a
client that knows its agent session would send (docs/leases.md). Without the variable it
passes every request through untouched, so the same server command serves every configuration.
"""

from __future__ import annotations

import json
import os

HEADER = b"x-agent-session"  # perf.SESSION_HEADER
PATHS = ("/v1/chat/completions", "/v1/completions")
TTL_ENV = "BENCH_LEASE_TTL_S"
TTL_S = 120  # the hint's ttl_s in both serving benchmarks' lease configurations


def server_args() -> list[str]:
    """What an OpenAI server (vLLM's, or tpu-inference's through it) needs for the agentic workload:
    tools in every request, so "auto" tool choice needs a parser (pythonic: no special tokens), and
    this middleware, loaded in every configuration (it acts only where ``TTL_ENV`` is set)."""
    return ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
            "--middleware", f"{__name__}.SessionLease"]


def server_env(leased: bool) -> dict[str, str]:
    """The server environment's part: the hint's ``ttl_s`` for a lease configuration, else nothing."""
    return {TTL_ENV: str(TTL_S)} if leased else {}


def lease_params(body: bytes, session: str, ttl_s: float) -> bytes:
    """The request body with the lease hint added (an existing ``kv_transfer_params`` kept)."""
    req = json.loads(body)
    params = dict(req.get("kv_transfer_params") or {})
    params["tpu_offload_lease"] = {"session": session, "ttl_s": ttl_s}
    req["kv_transfer_params"] = params
    return json.dumps(req).encode()


class SessionLease:
    def __init__(self, app):
        self.app = app
        ttl = os.environ.get(TTL_ENV)
        self.ttl_s = float(ttl) if ttl else None

    async def __call__(self, scope, receive, send):
        if self.ttl_s is None or scope["type"] != "http" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        session = dict(scope.get("headers") or ()).get(HEADER)
        if not session:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = lease_params(b"".join(chunks), session.decode(), self.ttl_s)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the disconnect, when it comes

        return await self.app({**scope, "headers": headers}, replay, send)
