"""The Session supervisor: every long-lived session (a /v1/realtime connection; a streamed transcription's
decoder and a live transcode's ffmpeg pipe, which outlive their route's handler; session pins and MCP servers
join it) runs as a task in this actor's nursery, so it is listed while it lives, counted per key, and closed
with a word to its client when the gateway drains. No route starts a task of its own.

Lifecycle of one session (only this loop changes the table):

    Start --(room for its key, not draining)--> running --work returns--> gone
    running --Drain--> stopping (its `stop` event is set: it tells its client and returns) --> gone
    running --its connection's handler leaves--> cancelled --> gone

- `Start` carries the session's work: an async function of a `stop` event. The supervisor starts it in its
  nursery and answers a `Ticket` (id, stop, done). The WebSocket route waits on `done`; if the route itself
  is cancelled (the client vanished), it cancels the ticket's scope.
- Per key at most `per_key` capped sessions of a kind (0: no cap); over it, 429. While draining, 503. A stream's
  task is not capped here (its request was admitted under the key's max_concurrent already).
- `Drain` (sent by its own watcher when the gateway's drain event fires: the first SIGINT/SIGTERM) sets every
  session's `stop`; the sessions say goodbye and
  close, so the HTTP server's own drain is not left waiting on open sockets.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell

log = logging.getLogger("blazar.sessions")

Work = Callable[[trio.Event], Awaitable[str]]


@dataclass
class Ticket:
    """What the route holds of its session: the id, and the events and scope to follow or end it."""

    id: str
    stop: trio.Event
    done: trio.Event
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    reason: str = ""


class Start(Envelope, frozen=True, kw_only=True, tag="start_session"):
    kind: str
    key: str | None
    work: Any  # Work
    describe: Any  # Callable[[], dict]: what the listing shows of it
    capped: bool  # counts against realtime_sessions_per_key (a realtime connection does; a stream's task not)


class _Ended(Envelope, frozen=True, kw_only=True, tag="session_ended"):
    id: str


class List(Envelope, frozen=True, kw_only=True, tag="list_sessions"):
    viewer: str | None  # a scoped key sees only its own sessions; None sees all


class Drain(Envelope, frozen=True, kw_only=True, tag="drain_sessions"):
    reason: str


@dataclass
class _Live:
    ticket: Ticket
    kind: str
    key: str | None
    describe: Callable[[], dict[str, Any]]
    opened_at: float
    state: str = "running"


class SessionSupervisor(MessageLoop):
    name = "sessions"

    def __init__(self, per_key: int, *, drain_on: trio.Event | None = None) -> None:
        self.per_key = per_key
        self.drain_on = drain_on  # the gateway's drain (its first SIGINT/SIGTERM): every session is told to close
        self.live: dict[str, _Live] = {}
        self.draining = ""
        self._ids = itertools.count(1)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        if self.drain_on is not None:
            nursery.start_soon(self._drain_when, self.drain_on)

    async def _drain_when(self, event: trio.Event) -> None:
        await event.wait()
        await self.mailbox.send(Drain(reply=None, reason="the gateway is shutting down"))

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case Start():
                return self._start(message)
            case _Ended(id=session_id):
                self.live.pop(session_id, None)
                return None
            case List(viewer=viewer):
                return Ok([self._row(live) for live in self.live.values()
                           if viewer is None or live.key == viewer])
            case Drain(reason=reason):
                self.draining = reason
                for live in self.live.values():
                    live.state = "stopping"
                    live.ticket.reason = reason
                    live.ticket.stop.set()
                if self.live:
                    log.info("draining: %d session(s) told to close", len(self.live))
                return Ok(len(self.live))
        return Err("unknown_op", f"sessions does not understand {type(message).__name__}")

    def _start(self, message: Start) -> Reply:
        if self.draining:
            return Err("gateway_draining", f"no new sessions: {self.draining}", fix="reconnect once it is back",
                       status=503, retry_after=1.0)
        held = sum(1 for live in self.live.values() if live.key == message.key and live.kind == message.kind)
        if message.capped and self.per_key and held >= self.per_key:
            whose = f"the API key {message.key!r}" if message.key is not None else "this gateway"
            return Err("sessions_exhausted", f"{whose} already has {held} open {message.kind} sessions; "
                       f"realtime_sessions_per_key allows {self.per_key}",
                       fix="close one first, or raise realtime_sessions_per_key in config.toml", status=429,
                       retry_after=1.0)
        ticket = Ticket(id=f"{message.kind}-{next(self._ids)}", stop=trio.Event(), done=trio.Event())
        self.live[ticket.id] = _Live(ticket=ticket, kind=message.kind, key=message.key, describe=message.describe,
                                     opened_at=time.time())
        self.nursery.start_soon(self._run, ticket, message.work)
        return Ok(ticket)

    async def _run(self, ticket: Ticket, work: Work) -> None:
        try:
            with ticket.scope:
                reason = await work(ticket.stop)
                ticket.reason = ticket.reason or reason
        except Exception:  # a session's bug ends that session, never the supervisor
            log.exception("session %s failed", ticket.id)
            ticket.reason = ticket.reason or "internal error in the session (see the gateway log)"
        finally:
            ticket.done.set()
            tell(self.mailbox, _Ended(reply=None, id=ticket.id))

    @staticmethod
    def _row(live: _Live) -> dict[str, Any]:
        return {"id": live.ticket.id, "kind": live.kind, "key": live.key, "state": live.state,
                "opened_at": live.opened_at, "age_secs": round(time.time() - live.opened_at, 1), **live.describe()}


class SessionsClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def start(self, kind: str, key: str | None, work: Work, describe: Callable[[], dict[str, Any]], *,
                    capped: bool) -> Ticket:
        return await call(self.mailbox, lambda r: Start(reply=r, kind=kind, key=key, work=work, describe=describe,
                                                        capped=capped))

    async def run_task(self, kind: str, key: str | None, task: Callable[[], Awaitable[None]],
                       describe: Callable[[], dict[str, Any]]) -> Ticket:
        """A stream's task that outlives the route handler that starts it (its body is relayed afterwards):
        run under this supervisor, listed while it runs, never capped; it ends when its work is done."""
        async def work(stop: trio.Event) -> str:
            await task()
            return ""

        return await self.start(kind, key, work, describe, capped=False)

    async def list(self, viewer: str | None = None) -> list[dict[str, Any]]:
        return await call(self.mailbox, lambda r: List(reply=r, viewer=viewer))
