"""Who a unit of work is for, as a value: the caller that travels from a route (or a job, a batch item, a
realtime turn) into the supervisors.

A route builds one from its request (`dialects.edge.caller_of`), a job builds one for its owner's key
(`dialects.edge.acting_for`); nothing below the route reads the HTTP request or a context variable to find
out whose work it is, what it may do or how urgent it is.

The caller's admission leases (`LeaseBook`) are the one mutable part: admission adds to them as the work is
admitted, and whoever started the work gives them back when it ends (the auth middleware when an HTTP
response or WebSocket has ended, `acting_for` when a job's unit of work has).
"""

from __future__ import annotations

import msgspec


class LeaseBook:
    """The admission leases one caller holds. `once`: an HTTP request or WebSocket is admitted once however
    often it reaches an engine (a failover chain, a retry); a job's unit of work is admitted once per model it
    calls, however often it calls it (a video job polls its engine)."""

    def __init__(self, *, once: bool) -> None:
        self.once = once
        self.held: list[int] = []
        self.models: set[str] = set()  # admitted already (a job's unit polling its engine is admitted once)

    def wants_admission(self, model: str) -> bool:
        return not self.held if self.once else model not in self.models

    def admitted(self, model: str, lease: int) -> None:
        self.held.append(lease)
        self.models.add(model)


class Echo:
    """What the work tells the response of the request it serves: headers to add (`x-blazar-remote`,
    `x-blazar-failover`, …) and the model that served it (the request metrics' label). The request-log
    middleware reads it from the ASGI scope (`blazar.echo`); a job's echo is read by no one."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.model = ""


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    """Identity, permissions and schedule of one unit of work; every field is required."""

    key: str | None  # the API key's name it is charged to and scoped by; None on an open gateway
    admin: bool  # may change shared state (an unscoped key, the local CLI token, or an open gateway)
    reshapes_engines: bool  # may send spawn options that restart an engine other keys share
    priority: str | None  # X-Blazar-Priority as sent (checked where the work is scheduled)
    deadline_ms: str | None  # X-Blazar-Deadline-Ms as sent
    num_ctx: int | None  # X-Blazar-Num-Ctx, checked
    trace_id: str  # the request's trace id; a job's unit of work has the job's
    hops: int  # gateways this request has already crossed (remote relays)
    leases: LeaseBook
    echo: Echo

    def remote_headers(self) -> tuple[tuple[str, str], ...]:
        """What a relay to a remote peer passes on of the caller (the hop count is added by the relay)."""
        passed = (("x-blazar-trace-id", self.trace_id), ("x-blazar-priority", self.priority),
                  ("x-blazar-deadline-ms", self.deadline_ms))
        return tuple((name, value) for name, value in passed if value)


def job_caller(key: str | None, *, trace_id: str, priority: str | None = "low") -> Caller:
    """The caller of a job's unit of work (a batch item, an async transcription, a background response, a
    realtime turn): its owner's key, admitted per unit, at low priority unless a live client waits on it."""
    return Caller(key=key, admin=key is None, reshapes_engines=False, priority=priority, deadline_ms=None,
                  num_ctx=None, trace_id=trace_id, hops=0, leases=LeaseBook(once=False), echo=Echo())
