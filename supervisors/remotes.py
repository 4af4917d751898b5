"""The remote peers: one RemotePeer actor per `[[remotes]]` entry, the lane whose child is another gateway.

Lifecycle of a peer (only the loop changes state):

    reach:   unknown --probe or request answered--> reachable --connect error / timeout--> unreachable
             unreachable --probe or request answered--> reachable
    breaker: closed --3 failures in a row--> open --cooldown (breaker_cooldown_secs)--> half_open
             half_open: the next request is the one probe (others get 503 while it runs);
             --it answers--> closed;  --it fails--> open (cooldown doubles, ≤ 15 min)

The breaker is a `supervisors.breaker.Breaker` (this loop's state); the trip rule, failures in a row, is the
peer's. Its listing calls it half_open as soon as the cooldown has passed (the next request probes). Any
request the peer answers closes it; only the probe's failure re-opens it (a late failure of a request sent
before the breaker opened counts in a row but moves nothing), and a probe that never left (a route the peer
does not serve) lets the next request probe.

- A request (`RemoteSubmit`) runs as a task in this actor's nursery: it goes to the peer over a
  keep-alive pool with the key read from `key_env`, and the caller gets the whole answer or a bounded
  channel of chunks, exactly as from a local instance, so every dialect relays it the same way.
  A failure is a connect error, a timeout, a broken stream or a 5xx other than 503 (busy) from the peer.
- A prober task reads the peer's health every `poll_secs` (a Blazar peer's `/api/capacity`, which
  also fills the capacity cache); it never holds a request up, and `Describe` answers from the cache at
  once with the snapshot's age and the last error.
- `Exchange` is an admin call (warm, capacity refresh) answered verbatim.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpcore
import msgspec
import trio

from blazar.fabric_config import PROBE_PATHS, redacted_url
from lanes import remote as lane
from lanes.child import TRANSPORT_ERRORS, header, once_more_if_stale

from .actor import Envelope, Err, MessageLoop, Ok, Reply, answer, call
from .breaker import Breaker, Verdict
from .instance import (
    StreamChunk,
    StreamFailure,
    StreamSeen,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    cut_stream_tokens,
    pump_stream,
)

log = logging.getLogger("blazar.remotes")

BREAKER_FAILURES = 3
BREAKER_MAX_SECS = 900.0
STREAM_BUFFER = 32


def broken_answer(status: int) -> bool:
    """A peer answer that counts against its breaker: a 5xx, but not 503 (the peer is up and busy: its own
    queue refused the request, which says nothing about its health)."""
    return status >= 500 and status != 503


class RemoteSubmit(Envelope, frozen=True, kw_only=True, tag="remote_submit"):
    call: UpstreamCall
    model: str  # the model's name on the peer
    headers: tuple[tuple[str, str], ...]  # the client's headers passed on (trace, priority, hops)
    on_usage: Callable[[int], None] | None


class Exchange(Envelope, frozen=True, kw_only=True, tag="exchange"):
    method: str
    path: str
    body: bytes
    timeout_secs: float


class Describe(Envelope, frozen=True, kw_only=True, tag="describe"):
    refresh: bool  # read the peer's capacity first (bounded by its connect timeout)


class _Outcome(Envelope, frozen=True, kw_only=True, tag="outcome"):
    ok: bool
    error: str
    probe: bool  # a health probe, not a request: it moves reach, never the breaker
    breaker_probe: int | None  # the breaker's ticket when this request was its half-open probe


class _Probed(Envelope, frozen=True, kw_only=True, tag="probed"):
    ok: bool
    error: str
    capacity: dict[str, Any] | None


class RemotePeer(MessageLoop):
    def __init__(self, entry: Any, *, cooldown_secs: float, environ: dict[str, str] | None = None) -> None:
        self.entry = entry
        self.name = f"remote:{entry.name}"
        self.base = entry.url.rstrip("/")
        self.shown_url = redacted_url(entry.url)  # what answers and errors show: no user:pass@
        self.key = (environ if environ is not None else os.environ).get(entry.key_env, "") if entry.key_env else ""
        self.reach = "unknown"
        self.last_error = ""
        self.last_error_at: float | None = None
        self.last_ok_at: float | None = None
        self.capacity: dict[str, Any] | None = None
        self.capacity_at: float | None = None
        self.failures = 0
        self.breaker = Breaker(max(1.0, cooldown_secs), max_cool_down=BREAKER_MAX_SECS)
        self.in_flight = 0
        self.served = 0
        self.pool: httpcore.AsyncConnectionPool | None = None
        self.refresh_waiters: list[trio.MemorySendChannel] = []
        self.probing = False

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.pool = httpcore.AsyncConnectionPool(max_connections=None, max_keepalive_connections=32)
        nursery.start_soon(self._prober)

    async def on_stop(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    # ---------------------------------------------------------------- the loop

    async def handle(self, message: Envelope) -> Reply | None:
        if isinstance(message, RemoteSubmit):
            return self._submit(message)
        if isinstance(message, _Outcome):
            self._outcome(message)
            return None
        if isinstance(message, _Probed):
            self._probed(message)
            return None
        if isinstance(message, Describe):
            if message.refresh:
                self.refresh_waiters.append(message.reply)
                self._start_probe()
                return None
            return Ok(self.describe())
        if isinstance(message, Exchange):
            self.nursery.start_soon(self._exchange, message)
            return None
        return Err("unknown_message", f"{self.name} does not handle {type(message).__name__}")

    def _submit(self, message: RemoteSubmit) -> Reply | None:
        if self.entry.key_env and not self.key:
            return Err("remote_key_missing", f"remote {self.entry.name} sends its key from ${self.entry.key_env}, "
                       "which is not set in the gateway's environment", status=503,
                       fix=f"export {self.entry.key_env}=<the peer's key> and restart blazar serve")
        now = trio.current_time()
        admission = self.breaker.admit(now)
        if admission.verdict is Verdict.COOLING:
            wait = admission.wait
            return Err("remote_breaker_open", f"remote {self.entry.name}'s breaker is open after {self.failures} "
                       f"failures in a row (last: {self.last_error}); the next request after {wait:.0f}s probes it",
                       status=503, fix="wait, or see GET /api/route/<model>", retry_after=max(1.0, wait))
        if admission.verdict is Verdict.PROBING:
            return Err("remote_breaker_open", f"remote {self.entry.name} is being probed after failing "
                       f"(last: {self.last_error})", status=503, fix="retry in a moment", retry_after=1.0)
        try:
            path = lane.peer_path(self.entry.kind, message.call.path)
        except lane.NotServed as error:
            self.breaker.ended(now)  # if this was to be the probe, it never left: the next request probes
            return Err("remote_route_unserved", f"remote {self.entry.name}: {error}", status=400,
                       fix="address this route to a local model or a Blazar peer")
        self.in_flight += 1
        self.nursery.start_soon(self._relay, message, path, admission.ticket)
        return None

    def _outcome(self, message: _Outcome) -> None:
        now = trio.current_time()
        if not message.probe:
            self.in_flight -= 1
        if message.ok:
            self.reach, self.last_ok_at = "reachable", time.time()
            if not message.probe:
                self.served += 1
                self.failures = 0
                self.breaker.succeeded()
            return
        self.last_error, self.last_error_at = message.error, time.time()
        if message.probe:
            self.reach = "unreachable"
            return
        self.failures += 1
        if self.breaker.is_probe(message.breaker_probe):
            self.breaker.failed(now, message.error)
            log.warning("remote %s: breaker open (%s)", self.entry.name, message.error)
        elif self.breaker.state == "closed" and self.failures >= BREAKER_FAILURES:
            self.breaker.open(now, message.error)
            log.warning("remote %s: breaker open (%s)", self.entry.name, message.error)

    def _probed(self, message: _Probed) -> None:
        self.probing = False
        self._outcome(_Outcome(reply=None, ok=message.ok, error=message.error, probe=True, breaker_probe=None))
        if message.capacity is not None:
            self.capacity, self.capacity_at = lane.capacity_summary(message.capacity), time.time()
        waiters, self.refresh_waiters = self.refresh_waiters, []
        for reply in waiters:
            answer(reply, Ok(self.describe()))

    def describe(self) -> dict[str, Any]:
        now = trio.current_time()
        wait = self.breaker.wait(now)
        # Listed half-open as soon as the cooldown has passed: the next request is the probe.
        state = "half_open" if self.breaker.state == "open" and wait == 0 else self.breaker.state
        row: dict[str, Any] = {
            "name": self.entry.name, "url": self.shown_url, "kind": self.entry.kind, "reach": self.reach,
            "breaker": state, "failures_in_a_row": self.failures, "in_flight": self.in_flight,
            "served": self.served, "last_error": self.last_error or None, "last_error_at": self.last_error_at,
            "last_ok_at": self.last_ok_at,
            "key": f"${self.entry.key_env} ({'set' if self.key else 'NOT SET'})" if self.entry.key_env else None,
        }
        if state == "open":
            row["breaker_probe_in_secs"] = round(wait, 1)
        if self.entry.kind == "blazar":
            row["capacity"] = None if self.capacity is None else {
                **self.capacity, "age_secs": round(time.time() - (self.capacity_at or time.time()), 1)}
        return row

    # ---------------------------------------------------------------- tasks

    def _headers(self, extra: list[tuple[bytes, bytes]], passed: tuple[tuple[str, str], ...],
                 content_type: str | None) -> list[tuple[bytes, bytes]]:
        headers = [(k.encode(), v.encode()) for k, v in passed]
        if content_type:
            headers.append((b"content-type", content_type.encode()))
        if self.key:
            headers.append((b"authorization", b"Bearer " + self.key.encode()))
        return headers + extra

    def _extensions(self, read_secs: float | None = None) -> dict[str, Any]:
        return {"timeout": {"connect": self.entry.connect_timeout_secs,
                            "read": read_secs or self.entry.read_timeout_secs, "write": 60.0, "pool": 60.0}}

    def _failure_text(self, error: BaseException) -> str:
        what = "did not accept a connection" if isinstance(error, httpcore.ConnectError) else \
            "timed out" if isinstance(error, httpcore.TimeoutException) else "broke the connection"
        return f"remote {self.entry.name} ({self.shown_url}) {what}: {type(error).__name__}: {error}".rstrip(": ")

    async def _report(self, ok: bool, error: str = "", breaker_probe: int | None = None) -> None:
        with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.mailbox.send(_Outcome(reply=None, ok=ok, error=error, probe=False, breaker_probe=breaker_probe))

    async def _relay(self, message: RemoteSubmit, path: str, breaker_probe: int | None) -> None:
        ok, error = True, ""
        try:
            ok, error = await self._relay_once(message, path)
        finally:
            await self._report(ok, error, breaker_probe)

    async def _relay_once(self, message: RemoteSubmit, path: str) -> tuple[bool, str]:
        assert self.pool is not None
        body, extra = lane.addressed(message.call.path, message.call.body, message.model)
        if message.call.stream and message.on_usage is not None:
            body = lane.metered(self.entry.kind, message.call.path, body)
        headers = self._headers(extra, message.headers, message.call.content_type if body else None)
        url = self.base + path
        usage = message.on_usage
        try:
            if not message.call.stream:
                pool = self.pool
                response = await once_more_if_stale(lambda: pool.request(
                    message.call.method, url, content=body or None, headers=headers, extensions=self._extensions()))
                reply = self._reply(response.status, response.content, header(response, b"content-type"))
                if isinstance(reply, Err):
                    answer(message.reply, reply)
                    return False, reply.message
                answer(message.reply, Ok(reply))
                if usage is not None and reply.status == 200:
                    usage(lane.usage_total(message.call.path, body=reply.body))
                failed = broken_answer(reply.status)
                return not failed, f"{self.entry.name} answered {reply.status}" if failed else ""
            async with contextlib.AsyncExitStack() as stack:
                pool = self.pool
                response = await once_more_if_stale(lambda: stack.enter_async_context(pool.stream(
                    message.call.method, url, content=body, headers=headers, extensions=self._extensions())))
                if response.status != 200:
                    reply = self._reply(response.status, await response.aread(), header(response, b"content-type"))
                    answer(message.reply, reply if isinstance(reply, Err) else Ok(reply))
                    failed = isinstance(reply, Err) or broken_answer(response.status)
                    return not failed, f"{self.entry.name} answered {response.status}" if failed else ""
                send, receive = trio.open_memory_channel[StreamChunk | StreamFailure](STREAM_BUFFER)
                with send:
                    if not answer(message.reply, Ok(UpstreamStream(status=200, chunks=receive, queued_secs=0.0,
                                                                   content_type=header(response, b"content-type")
                                                                   or "text/event-stream"))):
                        return True, ""
                    seen = StreamSeen()
                    try:
                        broken = await pump_stream(response, send, seen)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._charge_cut(message, seen, body)  # the client hung up or was cancelled mid-stream
                        raise
                    if broken is not None:
                        self._charge_cut(message, seen, body)
                        text = self._failure_text(broken) + " in the middle of the stream"
                        with contextlib.suppress(trio.BrokenResourceError):
                            await send.send(StreamFailure(message=text))
                        return False, text
                    if usage is not None:
                        usage(lane.usage_total(message.call.path, tail=seen.tail))
                    return True, ""
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True, ""  # the client hung up: leaving the `async with` closes the peer's request
        except TRANSPORT_ERRORS as error:
            text = self._failure_text(error)
            code = "remote_timeout" if isinstance(error, httpcore.TimeoutException) else "remote_unreachable"
            answer(message.reply, Err(code, text, status=504 if code == "remote_timeout" else 502,
                                      fix=f"is the peer up? check [[remotes]] {self.entry.name} url; "
                                      "GET /api/route/<model> shows its state"))
            return False, text

    @staticmethod
    def _charge_cut(message: RemoteSubmit, seen: StreamSeen, body: bytes) -> None:
        """A peer's stream cut short is charged like a local one: the peer's running count when its events carry
        one (a Blazar peer's llama-server does, asked through the body), else the estimate."""
        if message.on_usage is not None and message.call.path in lane.GENERATION_PATHS:
            message.on_usage(cut_stream_tokens(lane.usage_total(message.call.path, tail=seen.tail), seen, body))

    def _reply(self, status: int, body: bytes, content_type: str) -> UpstreamReply | Err:
        if status in (401, 403):
            return Err("remote_auth", f"remote {self.entry.name} refused Blazar's key ({status}): "
                       f"{lane.error_text(body)}", status=502,
                       fix=f"set {self.entry.key_env or 'key_env'} to a key the peer accepts (the [[remotes]] entry's "
                       "key_env names the variable)")
        return UpstreamReply(status=status, body=body, content_type=content_type or "application/json",
                             queued_secs=0.0, engine_message=lane.error_text(body) if status >= 400 else "")

    async def _exchange(self, message: Exchange) -> None:
        assert self.pool is not None
        headers = self._headers([], (), "application/json" if message.body else None)
        try:
            with trio.fail_after(message.timeout_secs):
                response = await self.pool.request(message.method, self.base + message.path,
                                                   content=message.body or None, headers=headers,
                                                   extensions=self._extensions(message.timeout_secs))
            answer(message.reply, Ok({"status": response.status, "body": response.content,
                                      "content_type": header(response, b"content-type")}))
        except trio.TooSlowError:
            answer(message.reply, Err("remote_timeout", f"remote {self.entry.name} did not answer {message.path} "
                                      f"within {message.timeout_secs:g}s", status=504))
        except TRANSPORT_ERRORS as error:
            answer(message.reply, Err("remote_unreachable", self._failure_text(error), status=502))

    def _start_probe(self) -> None:
        if not self.probing:
            self.probing = True
            self.nursery.start_soon(self._probe)

    async def _prober(self) -> None:
        while True:
            self._start_probe()
            await trio.sleep(self.entry.poll_secs)

    async def _probe(self) -> None:
        assert self.pool is not None
        path = PROBE_PATHS[self.entry.kind]
        result = _Probed(reply=None, ok=False, error="", capacity=None)
        try:
            with trio.fail_after(self.entry.connect_timeout_secs + 10):
                response = await self.pool.request("GET", self.base + path, headers=self._headers([], (), None),
                                                   extensions=self._extensions(10.0))
            if response.status >= 400:
                result = _Probed(reply=None, ok=False, error=f"{path} answered {response.status}: "
                                 f"{lane.error_text(response.content)[:300]}", capacity=None)
            else:
                capacity = None
                if self.entry.kind == "blazar":
                    with contextlib.suppress(msgspec.DecodeError):
                        decoded = msgspec.json.decode(response.content)
                        capacity = decoded if isinstance(decoded, dict) else None
                result = _Probed(reply=None, ok=True, error="", capacity=capacity)
        except trio.TooSlowError:
            result = _Probed(reply=None, ok=False, capacity=None,
                             error=f"remote {self.entry.name} ({self.shown_url}) did not answer {path} in time")
        except TRANSPORT_ERRORS as error:
            result = _Probed(reply=None, ok=False, error=self._failure_text(error), capacity=None)
        with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.mailbox.send(result)


class RemotesClient:
    """Every peer's mailbox by name, and the config entries (pure facts) routes read."""

    def __init__(self, peers: dict[str, trio.MemorySendChannel], entries: list[Any]) -> None:
        self.peers = peers
        self.entries = {e.name: e for e in entries}

    async def submit(self, peer: str, model: str, upstream: UpstreamCall, headers: tuple[tuple[str, str], ...],
                     on_usage: Callable[[int], None] | None, within: float) -> UpstreamReply | UpstreamStream:
        return await call(self.peers[peer], lambda r: RemoteSubmit(reply=r, call=upstream, model=model,
                                                                   headers=headers, on_usage=on_usage), within=within)

    async def describe(self, peer: str, refresh: bool = False) -> dict[str, Any]:
        entry = self.entries[peer]
        within = entry.connect_timeout_secs + 15 if refresh else 5
        return await call(self.peers[peer], lambda r: Describe(reply=r, refresh=refresh), within=within)

    async def describe_all(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.peers:
            try:
                rows.append(await self.describe(name))
            except Exception as error:  # an actor that cannot answer is shown, never raised
                rows.append({"name": name, "reach": "unknown", "last_error": f"its actor did not answer: {error}"})
        return rows

    async def exchange(self, peer: str, method: str, path: str, body: bytes, timeout_secs: float) -> dict[str, Any]:
        return await call(self.peers[peer], lambda r: Exchange(reply=r, method=method, path=path, body=body,
                                                               timeout_secs=timeout_secs),
                          within=timeout_secs + 5)

