"""ASGI middleware, outermost to innermost:

request log + trace id -> auth (slot) -> CORS -> body limit -> session pin (slot) -> app

Plain ASGI callables rather than framework hooks: they run before Quart parses anything, cost a
few microseconds, and see chunked bodies as they arrive.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import count
from typing import Any

from blazar.errors import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TRACE_HEADER = b"x-blazar-trace-id"
_VALID_TRACE = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")

access_log = logging.getLogger("blazar.access")


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def send_simple(send: Send, status: int, body: bytes, *, extra_headers: list | None = None,
                      content_type: bytes = b"application/json") -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers.extend(extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class TraceIds:
    """`plm-<boot hex>-<seq>`: unique per boot, ordered within it."""

    def __init__(self) -> None:
        self.boot = secrets.token_hex(4)
        self._seq = count(1)

    def next(self) -> str:
        return f"plm-{self.boot}-{next(self._seq)}"


class RequestLog:
    """Assigns (or accepts a well-formed incoming) trace id, echoes it, logs one line per request."""

    def __init__(self, app: ASGIApp, trace_ids: TraceIds, obs: Any = None) -> None:
        self.app = app
        self.trace_ids = trace_ids
        self.obs = obs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = header(scope, TRACE_HEADER)
        trace = incoming.decode() if incoming and _VALID_TRACE.match(incoming) else self.trace_ids.next()
        scope["blazar.trace_id"] = trace
        started = time.perf_counter()
        status = 0

        async def send_with_trace(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (TRACE_HEADER, trace.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_trace)
        finally:
            elapsed = time.perf_counter() - started
            access_log.info("%s %s %s %.1fms %s", scope["method"], scope["path"], status or "-", elapsed * 1000, trace)
            if self.obs is not None and status:
                from blazar.errors import dialect_for_path

                self.obs.request(scope["path"], dialect_for_path(scope["path"]), scope.get("blazar.model", ""),
                                 status, elapsed)


class Cors:
    """Answers preflights and stamps allow-origin on responses for the configured origins."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.any_origin = "*" in origins
        self.origins = {o.rstrip("/").encode() for o in origins}

    def _allowed(self, origin: bytes | None) -> bool:
        return origin is not None and (self.any_origin or origin.rstrip(b"/") in self.origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        if not self._allowed(origin):
            await self.app(scope, receive, send)
            return
        allow = b"*" if self.any_origin else origin
        requested_method = header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and requested_method is not None:
            requested_headers = header(scope, b"access-control-request-headers") or b"*"
            await send_simple(send, 204, b"", content_type=b"text/plain", extra_headers=[
                (b"access-control-allow-origin", allow),
                (b"access-control-allow-methods", b"GET, POST, PUT, PATCH, DELETE, OPTIONS"),
                (b"access-control-allow-headers", requested_headers),
                (b"access-control-max-age", b"600"),
                (b"vary", b"origin"),
            ])
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()),
                                      (b"access-control-allow-origin", allow),
                                      (b"access-control-expose-headers", b"*"),
                                      (b"vary", b"origin")]
            await send(message)

        await self.app(scope, receive, send_with_cors)


class BodyLimit:
    """Refuses bodies over the cap with a teaching 413, counting bytes as they arrive.

    A declared Content-Length over the cap is refused before reading; a chunked body is read up to
    the cap and refused the moment it crosses it. The app then sees the body replayed.
    """

    def __init__(self, app: ASGIApp, limit_bytes: int) -> None:
        self.app = app
        self.limit = limit_bytes

    def _refusal(self, path: str) -> bytes:
        mib = self.limit / (1024 * 1024)
        return error_bytes(
            path, 413,
            f"request body is larger than the {mib:g} MiB limit (config key body_limit_mib); send a "
            f"smaller body, or raise the limit: blazar config set body_limit_mib {int(mib * 2)}",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await send_simple(send, 413, self._refusal(scope["path"]),
                              extra_headers=[(b"connection", b"close")])
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.limit:
                await send_simple(send, 413, self._refusal(scope["path"]),
                                  extra_headers=[(b"connection", b"close")])
                return
            if body:
                chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_stack(app: ASGIApp, *, cors_origins: list[str], body_limit_bytes: int,
                trace_ids: TraceIds, obs: Any = None, auth: Callable[[ASGIApp], ASGIApp] | None = None,
                session_pin: Callable[[ASGIApp], ASGIApp] | None = None) -> ASGIApp:
    """Wrap `app` in the spec's middleware order. `auth` and `session_pin` are the open slots."""
    inner: ASGIApp = session_pin(app) if session_pin else app
    inner = BodyLimit(inner, body_limit_bytes)
    inner = Cors(inner, cors_origins)
    if auth:
        inner = auth(inner)
    return RequestLog(inner, trace_ids, obs)


def test_hooks_enabled() -> bool:
    return os.environ.get("BLAZAR_TEST_HOOKS") == "1"
