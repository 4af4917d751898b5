"""ASGI middleware, outermost to innermost:

request log + trace id -> Host check -> auth -> CORS -> body limit -> session pin (slot) -> app

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
                echo = scope.get("blazar.echo")  # a supervisors.caller.Echo, once a route built its caller
                extra = [(k.encode(), v.encode()) for k, v in echo.headers.items()] if echo is not None else []
                message["headers"] = [*message.get("headers", ()), (TRACE_HEADER, trace.encode()), *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_trace)
        finally:
            elapsed = time.perf_counter() - started
            access_log.info("%s %s %s %.1fms %s", scope["method"], scope["path"], status or "-", elapsed * 1000, trace)
            if self.obs is not None and status:
                from blazar.errors import dialect_for_path

                self.obs.request(metrics_route(scope), dialect_for_path(scope["path"]),
                                 _served_model(scope), status, elapsed)


def _served_model(scope: Scope) -> str:
    """The model that served the request (set by the relay once the name resolved), for the metrics' label."""
    echo = scope.get("blazar.echo")
    return echo.model if echo is not None else ""


# What a request's metrics are labelled with when no route template is known: the layer that refused it
# before routing (`blazar.refused`), else `unmatched`. A fixed set, so no client can mint a series.
REFUSAL_LABELS = frozenset({"host", "origin", "fetch_site", "auth", "auth_throttled", "body_limit"})


def metrics_route(scope: Scope) -> str:
    """The route label: the matched rule's template (`/v1/jobs/<job_id>`, set by the app before its view
    runs), never the raw path."""
    route = scope.get("blazar.route")
    if isinstance(route, str) and route:
        return route
    refused = scope.get("blazar.refused")
    return f"refused:{refused}" if refused in REFUSAL_LABELS else "unmatched"


def _wildcard(pattern: str) -> re.Pattern[str]:
    """`*` stands for one DNS label (or one IPv4 number in an IPv4 pattern); `scheme://*` for anything
    after the scheme. Labels never swallow dots, so `http://127.*.*.*` cannot match 127.0.0.evil.com."""
    scheme, sep, rest = pattern.partition("://")
    if sep and rest == "*":
        return re.compile(re.escape(scheme) + "://.*", re.IGNORECASE)
    ipv4 = re.fullmatch(r"[\d*]+(\.[\d*]+){3}", pattern.rsplit("://", 1)[-1]) is not None
    label = r"\d{1,3}" if ipv4 else r"[A-Za-z0-9-]+"
    return re.compile(label.join(re.escape(part) for part in pattern.split("*")), re.IGNORECASE)


def _split_port(value: str) -> str:
    """`http://localhost:3000` -> `http://localhost`; `[::1]:8080` -> `[::1]`."""
    match = re.fullmatch(r"(.*?)(:\d{1,5})?", value)
    return match.group(1) if match else value


def _trim(value: str) -> str:
    """One trailing slash off (`http://a/` -> `http://a`), never the scheme's own (`file://`)."""
    return value[:-1] if value.endswith("/") and not value.endswith("://") else value


class Patterns:
    """Origins or hosts as the user writes them: exact, `*` wildcards, any port; `*` alone allows all."""

    def __init__(self, entries: list[str]) -> None:
        self.entries = [_trim(e.strip()) for e in entries if e.strip()]
        self.any = "*" in self.entries
        self._compiled = [_wildcard(e) for e in self.entries if e != "*"]

    def match(self, value: str) -> bool:
        if self.any:
            return True
        value = _trim(value)
        bare = _split_port(value)
        return any(p.fullmatch(value) or p.fullmatch(bare) for p in self._compiled)


def _host_name(value: str) -> str:
    """The host part of a Host header or bind host: `[::1]:8080` -> `::1`, `localhost:3000` -> `localhost`;
    a bare IPv6 address (`::1`, `::ffff:127.0.0.1`, as a bind host is written) stays whole."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


def loopback_host(host: str) -> bool:
    """localhost, *.localhost, 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.0.0.1), bracketed or
    bare, with or without a port: for Host headers and for the bind address alike."""
    import ipaddress

    name = _host_name(host).rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class HostGuard:
    """Refuses Host values a DNS-rebinding page would send. Bound to loopback, only loopback hosts (plus
    `allowed_hosts`) are served; bound beyond it, `allowed_hosts` when set, else any."""

    def __init__(self, app: ASGIApp, *, bound_loopback: bool, allowed_hosts: list[str]) -> None:
        self.app = app
        self.bound_loopback = bound_loopback
        self.allowed = Patterns(allowed_hosts)
        self.checking = bound_loopback or bool(self.allowed.entries)

    def allows(self, host: str) -> bool:
        # A loopback name is never a rebinding attempt: the box's own tools keep working however it is bound.
        return loopback_host(host) or self.allowed.match(host) or self.allowed.match(_split_port(host))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.checking and scope["type"] in ("http", "websocket"):
            raw = header(scope, b"host")
            host = raw.decode("latin-1") if raw is not None else ""
            if raw is not None and not self.allows(host):
                where = "a loopback address" if self.bound_loopback else "this address"
                message = (f"Host {host!r} is not served: this gateway listens on {where} and answers only "
                           f"{'localhost, 127.0.0.0/8 and [::1]' if self.bound_loopback else 'the allowed_hosts'}"
                           " (a foreign Host is how DNS-rebinding pages reach local servers). Behind a reverse "
                           f"proxy, allow it: blazar config set allowed_hosts '[\"{_split_port(host)}\"]' "
                           "(or BLAZAR_ALLOWED_HOSTS), then restart blazar serve")
                scope["blazar.refused"] = "host"
                await refuse_scope(scope, send, 403, error_bytes(scope["path"], 403, message))
                return
        await self.app(scope, receive, send)


async def refuse_scope(scope: Scope, send: Send, status: int, body: bytes, content_type: bytes = b"application/json",
                       extra_headers: list | None = None) -> None:
    """An HTTP refusal for an HTTP request or a WebSocket handshake (hypercorn's http.response extension;
    a plain close where the server lacks it)."""
    if scope["type"] == "websocket":
        if "websocket.http.response" in scope.get("extensions", {}):
            headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                       *(extra_headers or [])]
            await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "websocket.close", "code": 1008})
        return
    await send_simple(send, status, body, content_type=content_type, extra_headers=extra_headers)


def is_preflight(scope: Scope) -> bool:
    return scope["method"] == "OPTIONS" and header(scope, b"origin") is not None and \
        header(scope, b"access-control-request-method") is not None


# What a page on another site may still load without an Origin header (an <img>, a link, a form GET): the
# health probes, and the console page itself, which holds no data (it asks for everything it shows with
# same-origin fetches, and holds no key until the user types one into it).
CROSS_SITE_OPEN = frozenset({"/healthz", "/health", "/ui"})


def cross_site_without_origin(scope: Scope) -> str | None:
    """The Sec-Fetch-Site value of a browser request that came from another site (or a sibling subdomain)
    but carries no Origin: an <img>, a plain navigation, a form GET. None for anything else: programs send
    no Sec-Fetch-Site, and `same-origin` / `none` (the console's own fetches, a typed URL) are the user's."""
    site = header(scope, b"sec-fetch-site")
    if site is None or header(scope, b"origin") is not None:
        return None
    value = site.decode("latin-1").strip().lower()
    return value if value in ("cross-site", "same-site") else None


class Cors:
    """Browser origins: an allowed one gets its preflight answered and allow-origin on responses; any
    other gets 403 on every method, preflight included. Requests without Origin (SDKs, curl) pass, unless
    the browser says they came from another site (Sec-Fetch-Site: cross-site or same-site)."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.patterns = Patterns(origins)

    @staticmethod
    def _fetch_site_refusal(scope: Scope, site: str) -> bytes:
        message = (f"a browser request from another site (Sec-Fetch-Site: {site}, no Origin) may not reach "
                   f"{scope['path']}: an <img>, link or form on any page could otherwise make your browser "
                   "call this gateway. Open the gateway's own pages directly (a typed URL or a bookmark), or "
                   "call it from a program (SDKs and curl send no Sec-Fetch-Site). GET /healthz, /health and "
                   "/ui stay reachable. See docs/security.md")
        return error_bytes(scope["path"], 403, message)

    def _refusal(self, scope: Scope, origin: str) -> bytes:
        wanted = [*self.patterns.entries, origin]
        listed = ", ".join(f'"{o}"' for o in wanted)
        message = (f"browser origin {origin!r} may not call this gateway: a web page from another site could "
                   "otherwise read your models and prompts or change them. If you trust that page, allow it: "
                   f"blazar config set cors_origins '[{listed}]' (or BLAZAR_CORS_ORIGINS), then restart "
                   "blazar serve. See docs/security.md")
        return error_bytes(scope["path"], 403, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = header(scope, b"origin") if scope["type"] in ("http", "websocket") else None
        if raw is None:
            site = cross_site_without_origin(scope) if scope["type"] in ("http", "websocket") else None
            if site is not None and not (scope["type"] == "http" and scope["method"] in ("GET", "HEAD")
                                         and scope["path"] in CROSS_SITE_OPEN):
                scope["blazar.refused"] = "fetch_site"
                await refuse_scope(scope, send, 403, self._fetch_site_refusal(scope, site),
                                   extra_headers=[(b"vary", b"sec-fetch-site")])
                return
            await self.app(scope, receive, send)
            return
        origin = raw.decode("latin-1")
        if not self.patterns.match(origin):
            scope["blazar.refused"] = "origin"
            await refuse_scope(scope, send, 403, self._refusal(scope, origin), extra_headers=[(b"vary", b"origin")])
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allow = b"*" if self.patterns.any else raw
        if is_preflight(scope):
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
            scope["blazar.refused"] = "body_limit"
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
                scope["blazar.refused"] = "body_limit"
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
                session_pin: Callable[[ASGIApp], ASGIApp] | None = None, bound_loopback: bool = True,
                allowed_hosts: list[str] | None = None) -> ASGIApp:
    """Wrap `app` in the spec's middleware order (with the Host check ahead of auth). `session_pin` is
    the open slot."""
    inner: ASGIApp = session_pin(app) if session_pin else app
    inner = BodyLimit(inner, body_limit_bytes)
    inner = Cors(inner, cors_origins)
    if auth:
        inner = auth(inner)
    inner = HostGuard(inner, bound_loopback=bound_loopback, allowed_hosts=allowed_hosts or [])
    return RequestLog(inner, trace_ids, obs)


def test_hooks_enabled() -> bool:
    return os.environ.get("BLAZAR_TEST_HOOKS") == "1"
