"""The auth middleware (the stack's auth slot): who is asking, before any route runs.

Auth is active iff the live key table has a config or environment key. Then every request needs a
secret (`Authorization: Bearer`, else `x-api-key`) except `GET /healthz`, `GET /health` and CORS
preflights (a browser sends those without credentials; the CORS layer answers them and no route
runs). WebSocket handshakes are checked the same way.

The key the request proved is left in the ASGI scope (`blazar.key`) for admission; the admission
lease a route takes (`blazar.lease`) is given back here when the app returns, which is after the
response body has drained, streams included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from blazar.keys import KeyRecord, KeyTable
from blazar.middleware import ASGIApp, Receive, Scope, Send, header, is_preflight, refuse_scope

UNAUTHORIZED = (b'{"error":{"message":"missing or invalid API key (Authorization: Bearer or x-api-key)",'
                b'"type":"blazar_error","code":401}}')
OPEN_PATHS = frozenset({"/healthz", "/health"})
LOGIN_PAGE = (Path(__file__).resolve().parent.parent / "dialects" / "admin" / "login.html")


class KeyGate:
    """The table the middleware reads. Only the admission actor's loop replaces `table`."""

    def __init__(self, table: KeyTable) -> None:
        self.table = table
        self.release: Callable[[int], Awaitable[None]] | None = None


def presented_secret(scope: Scope) -> str:
    authorization = header(scope, b"authorization")
    if authorization is not None:
        scheme, _, value = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = header(scope, b"x-api-key")
    return api_key.decode("latin-1").strip() if api_key else ""


async def identify(table: KeyTable, secret: str) -> KeyRecord | None:
    record, owed = table.match_fast(secret)
    if record is None and owed:
        record = await trio.to_thread.run_sync(table.verify_slow, secret, owed)
    return record


def _is_open(scope: Scope) -> bool:
    if scope["type"] != "http":
        return False
    return (scope["method"] in ("GET", "HEAD") and scope["path"] in OPEN_PATHS) or is_preflight(scope)


def _wants_console(scope: Scope) -> bool:
    accept = header(scope, b"accept") or b""
    return scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/ui" and b"text/html" in accept


class Auth:
    def __init__(self, app: ASGIApp, gate: KeyGate) -> None:
        self.app = app
        self.gate = gate
        self.login_page = LOGIN_PAGE.read_bytes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        table = self.gate.table
        secret = presented_secret(scope)
        record = await identify(table, secret) if secret else None
        scope["blazar.key"] = record
        scope["blazar.auth"] = table.enabled
        if table.enabled and record is None and not _is_open(scope):
            if _wants_console(scope):
                # The console page itself holds no data: what a browser gets here is the key prompt.
                await refuse_scope(scope, send, 401, self.login_page, content_type=b"text/html; charset=utf-8",
                                   extra_headers=[(b"www-authenticate", b'Bearer realm="blazar"')])
            else:
                await refuse_scope(scope, send, 401, UNAUTHORIZED,
                                   extra_headers=[(b"www-authenticate", b'Bearer realm="blazar"')])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            lease = scope.pop("blazar.lease", None)
            if lease is not None and self.gate.release is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await self.gate.release(lease)
