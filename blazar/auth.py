"""The auth middleware (the stack's auth slot): who is asking, before any route runs.

Auth is active iff the live key table has a config or environment key. Then every request needs a
secret (`Authorization: Bearer`, else `x-api-key`) except `GET /healthz`, `GET /health` and CORS
preflights (a browser sends those without credentials; the CORS layer answers them and no route
runs). WebSocket handshakes are checked the same way.

The key the request proved is left in the ASGI scope (`blazar.key`) for admission; the admission
leases a route's caller takes (`blazar.leases`) are given back here when the app returns, which is after the
response body has drained, streams included.

Hostile input stays cheap: a hashed key's scrypt runs only after its lookup digest matched (see
blazar/keys.py), one at a time gateway-wide (its own CapacityLimiter, not the shared thread pool), and
an address that sent `auth_failures_per_minute` wrong keys gets 429 with Retry-After, before its keys
are looked at, until its minute is over.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from blazar.errors import error_bytes
from blazar.keys import KeyRecord, KeyTable
from blazar.middleware import ASGIApp, Receive, Scope, Send, header, is_preflight, refuse_scope

UNAUTHORIZED = (b'{"error":{"message":"missing or invalid API key (Authorization: Bearer or x-api-key)",'
                b'"type":"blazar_error","code":401}}')
OPEN_PATHS = frozenset({"/healthz", "/health"})
LOGIN_PAGE = (Path(__file__).resolve().parent.parent / "dialects" / "admin" / "login.html")
FAILURE_WINDOW_SECS = 60.0
THROTTLED_ADDRESSES = 4096  # addresses whose failures are remembered at once; the stalest is forgotten first


def client_address(scope: Scope) -> str:
    """Who is failing: the peer's IP, an IPv6 client counted per /64 (one host owns a whole /64 easily), an
    IPv4-mapped one as its IPv4 address. "" when the server does not say (a Unix socket)."""
    client = scope.get("client")
    if not client:
        return ""
    host = str(client[0])
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


class FailureThrottle:
    """Failed key attempts per client address, in fixed windows of FAILURE_WINDOW_SECS. Once an address
    has `limit` failures in its window, its requests that carry a key get 429 until the window ends,
    without their key being looked at, so guessing runs at `limit` tries a minute per address. Memory
    is bounded: at most THROTTLED_ADDRESSES windows are kept. `limit` 0 turns it off."""

    def __init__(self, limit: int, *, window: float = FAILURE_WINDOW_SECS, capacity: int = THROTTLED_ADDRESSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self.capacity = capacity
        self.clock = clock
        self.windows: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (window start, failures)

    def blocked_for(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        entry = self.windows.get(address) if self.limit else None
        if entry is None:
            return 0.0
        left = entry[0] + self.window - self.clock()
        if left <= 0:
            del self.windows[address]
            return 0.0
        return left if entry[1] >= self.limit else 0.0

    def failed(self, address: str) -> None:
        if not self.limit:
            return
        now = self.clock()
        started, count = self.windows.pop(address, (now, 0))
        if started + self.window <= now:
            started, count = now, 0
        self.windows[address] = (started, count + 1)  # re-inserted: the most recent failure is last
        while len(self.windows) > self.capacity:
            self.windows.popitem(last=False)


class KeyGate:
    """The table the middleware reads. Only the admission actor's loop replaces `table`."""

    def __init__(self, table: KeyTable, *, failures_per_minute: int = 0) -> None:
        self.table = table
        self.release: Callable[[int], Awaitable[None]] | None = None
        self.throttle = FailureThrottle(failures_per_minute)
        # scrypt (16 MiB, ~50 ms) runs one at a time for the whole gateway: a burst of keys to verify queues
        # here, holding one worker thread at most, instead of filling the shared worker pool and memory.
        self.scrypt = trio.CapacityLimiter(1)

    def weight_of(self, name: str | None) -> int:
        """A key's fair-queueing share (1 for an unknown or removed key, and on an open gateway)."""
        record = self.table.get(name) if name is not None else None
        return record.weight if record is not None else 1


def presented_secret(scope: Scope) -> str:
    authorization = header(scope, b"authorization")
    if authorization is not None:
        scheme, _, value = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = header(scope, b"x-api-key")
    return api_key.decode("latin-1").strip() if api_key else ""


async def identify(gate: KeyGate, table: KeyTable, secret: str, address: str = "") -> KeyRecord | None:
    record, owed = table.match_fast(secret)
    if record is None and owed:
        async with gate.scrypt:
            if gate.throttle.blocked_for(address):
                return None  # it failed too often while it waited: no scrypt run for it
            record = await trio.to_thread.run_sync(table.verify_slow, secret, owed)
    return record


def _throttled(scope: Scope, wait: float, limit: int) -> bytes:
    return error_bytes(scope["path"], 429,
                       f"too many wrong API keys from this address ({limit} in a minute): its requests are refused "
                       f"for {math.ceil(wait)} s more (Retry-After) without their key being checked. Check the key "
                       "the client sends (Authorization: Bearer or x-api-key); `blazar keys list` shows each key's "
                       "first characters")


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
        guarded = table.enabled and not _is_open(scope)
        address = client_address(scope)
        throttle = self.gate.throttle
        wait = throttle.blocked_for(address) if guarded and secret else 0.0
        # A key sent to an open path of a locked gateway (/healthz) proves nothing anyone reads: not checked.
        checked = secret and not wait and (guarded or not table.enabled)
        record = await identify(self.gate, table, secret, address) if checked else None
        scope["blazar.key"] = record
        scope["blazar.auth"] = table.enabled
        if guarded and record is None:
            wait = wait or (throttle.blocked_for(address) if secret else 0.0)
            if wait:
                scope["blazar.refused"] = "auth_throttled"
                await refuse_scope(scope, send, 429, _throttled(scope, wait, throttle.limit),
                                   extra_headers=[(b"retry-after", str(math.ceil(wait)).encode())])
                return
            if secret:
                throttle.failed(address)
            scope["blazar.refused"] = "auth"
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
            leases = scope.pop("blazar.leases", None)  # a supervisors.caller.LeaseBook, once a route admitted
            if leases is not None and leases.held and self.gate.release is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    for lease in leases.held:
                        await self.gate.release(lease)
