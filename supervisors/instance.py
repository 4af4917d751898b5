"""The Instance actor: one engine child process serving one resident model, for any lane.

Lifecycle (only the loop changes `self.state`; `TRANSITIONS` below is the whole table, and
tests/test_instance_table.py walks every (state, message) pair of it):

    starting --Ready--> ready <--> busy --Stop--> draining --(in-flight and queued done)--> stopping --> stopped
    starting --Stop--> stopping (queued requests get 503 model_unloading at once: the forwarder retries them)
    starting --SpawnFailed--> failed           ready/busy/draining --Exited--> failed --> stopping --> stopped

- starting: the child (lanes.child.EngineProcess) is spawned in its own process group, its output in a
  bounded ring; the lane's health path is polled racing the child's exit and the spawn deadline.
  Requests queue.
- ready/busy: requests are admitted into the child's slots in earliest-deadline order (priority tiers
  or a strict client deadline); one that waits past its bound gets 503 all_slots_busy; one whose
  client leaves is withdrawn at once. The idle TTL counts only with nothing in flight.
- draining: no new requests; the ones in flight or queued finish, then the child stops.
- stopping: SIGTERM to the group, grace, SIGKILL, always reaped; the pidfile goes with it.
- failed: queued requests get a 502 carrying the engine's own last lines.

Each admitted request runs as a task in this actor's nursery: it talks to the child over HTTP and
hands the caller either the whole answer or a bounded channel of `StreamChunk`s (then maybe one
`StreamFailure`). A caller that stops reading closes the channel, which closes the upstream request,
so the engine stops generating. Child tasks report back with messages; the lane hears every state
change as an `InstanceEvent` carrying a snapshot, and never reads this actor's attributes.
An exception inside this actor is reported to the lane as a crash of this model, never raised into it.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import msgspec
import trio

from lanes.base import Lane
from lanes.child import (
    TRANSPORT_ERRORS,
    ChildFailed,
    EngineHTTP,
    EngineProcess,
    exit_cause,
    free_port,
    header,
    once_more_if_stale,
)

from .actor import Envelope, Err, Ok, answer, tell

log = logging.getLogger("blazar.instance")

STOP_GRACE_SECS = 5.0
STREAM_BUFFER = 32

__all__ = ["free_port"]


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# ---------------------------------------------------------------- what callers send and get


class UpstreamCall(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    path: str
    body: bytes  # b"" for none
    stream: bool
    content_type: str  # of the body


class UpstreamReply(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    body: bytes
    content_type: str
    queued_secs: float
    engine_message: str  # "" or, for a 4xx/5xx: the engine's own words, read by its lane


class StreamChunk(msgspec.Struct, frozen=True, kw_only=True):
    data: bytes


class StreamFailure(msgspec.Struct, frozen=True, kw_only=True):
    """Last item on a stream channel when the engine broke mid-stream."""

    message: str


class UpstreamStream(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    chunks: Any  # trio.MemoryReceiveChannel[StreamChunk | StreamFailure]
    queued_secs: float
    content_type: str


class Submit(Envelope, frozen=True, kw_only=True, tag="submit"):
    ticket: int
    call: UpstreamCall
    due: float  # EDF key: trio time by which it should start
    expire_at: float  # trio time after which waiting is refused with 503
    keep_alive: float | None  # a request's own keep_alive (Ollama), or None for the model's
    on_usage: Callable[[int], None] | None  # charged with the engine's prompt + completion count


class Withdraw(Envelope, frozen=True, kw_only=True, tag="withdraw"):
    ticket: int


class Stop(Envelope, frozen=True, kw_only=True, tag="stop"):
    reason: str
    if_idle: bool  # True: refuse (409 busy) while a request is queued or running, or the model still loads


class Describe(Envelope, frozen=True, kw_only=True, tag="describe"):
    pass


class _Ready(Envelope, frozen=True, kw_only=True, tag="ready"):
    pass


class _SpawnFailed(Envelope, frozen=True, kw_only=True, tag="spawn_failed"):
    reason: str


class _Exited(Envelope, frozen=True, kw_only=True, tag="exited"):
    returncode: int


class _Finished(Envelope, frozen=True, kw_only=True, tag="finished"):
    ticket: int
    clean: bool  # the engine answered without breaking (any HTTP status)


class _Timer(Envelope, frozen=True, kw_only=True, tag="timer"):
    """Not mailed: what the loop handles when its next deadline (queue expiry, idle TTL) passes."""


class InstanceEvent(Envelope, frozen=True, kw_only=True, tag="instance_event"):
    """Told to the lane on every state change, with everything the lane may show or decide on."""

    key: str
    serial: int
    state: str
    detail: str
    crashed: bool
    snapshot: dict[str, Any]


# Every (state, message) pair and the states the instance may be in after handling it. A pair the
# table leaves out is a bug the instance reports as a crash.
_ANY = frozenset(State)
_LIVE = frozenset({State.READY, State.BUSY})
_SAME = {s: frozenset({s}) for s in State}
TRANSITIONS: dict[tuple[State, type[Envelope]], frozenset[State]] = {}
for _state in State:
    TRANSITIONS[(_state, Describe)] = _SAME[_state]
    TRANSITIONS[(_state, Withdraw)] = _LIVE if _state in _LIVE else _SAME[_state]
    TRANSITIONS[(_state, Submit)] = _LIVE if _state in _LIVE else _SAME[_state]
    TRANSITIONS[(_state, _Finished)] = _LIVE if _state in _LIVE else _SAME[_state]
    TRANSITIONS[(_state, _Timer)] = (_LIVE | {State.DRAINING}) if _state in _LIVE else _SAME[_state]
    TRANSITIONS[(_state, _Ready)] = _SAME[_state]
    TRANSITIONS[(_state, _SpawnFailed)] = _SAME[_state]
    TRANSITIONS[(_state, _Exited)] = _SAME[_state]
    TRANSITIONS[(_state, Stop)] = _SAME[_state]
TRANSITIONS.update({
    (State.STARTING, _Ready): _LIVE,
    (State.STARTING, _SpawnFailed): frozenset({State.FAILED}),
    (State.STARTING, _Exited): frozenset({State.FAILED}),
    (State.STARTING, Stop): frozenset({State.STARTING, State.STOPPING}),  # if_idle refuses while loading
    (State.READY, _Exited): frozenset({State.FAILED}),
    (State.BUSY, _Exited): frozenset({State.FAILED}),
    (State.DRAINING, _Exited): frozenset({State.FAILED}),
    (State.READY, Stop): frozenset({State.READY, State.DRAINING}),
    (State.BUSY, Stop): frozenset({State.BUSY, State.DRAINING}),
})
TERMINAL = frozenset({State.STOPPING, State.STOPPED})


@dataclass(order=True)
class _Waiter:
    due: float
    seq: int
    ticket: int = field(compare=False)
    call: UpstreamCall = field(compare=False)
    reply: Any = field(compare=False)
    expire_at: float = field(compare=False)
    enqueued_at: float = field(compare=False)
    cold: bool = field(compare=False, default=False)  # it waited for the child to load
    on_usage: Any = field(compare=False, default=None)


_tickets = itertools.count(1)
_serials = itertools.count(1)


@dataclass
class StreamSeen:
    """What a relay has seen of one stream: enough to time it, and to charge it if it is cut short."""

    tail: bytes = b""  # its last 8 KiB: where the engine's (running or final) usage is
    events: int = 0  # `data:` events relayed
    first_chunk: float | None = None  # seconds from the request to its first chunk


async def pump_stream(response: httpcore.Response, send: trio.MemorySendChannel,
                      seen: StreamSeen) -> Exception | None:
    """Relay an upstream body into a stream channel as it arrives, noting in `seen` what passed. Returns the
    transport error that broke it (None when it ended cleanly). A caller that stopped reading raises trio's
    Broken/ClosedResourceError out of here."""
    started = trio.current_time()
    try:
        async for chunk in response.aiter_stream():
            if seen.first_chunk is None:
                seen.first_chunk = trio.current_time() - started
            seen.tail = (seen.tail + chunk)[-8192:]
            seen.events += chunk.count(b"data:")
            await send.send(StreamChunk(data=chunk))
    except TRANSPORT_ERRORS as error:
        return error
    return None


def cut_stream_tokens(reported: int, seen: StreamSeen, request_body: bytes) -> int:
    """What a stream cut short (the client hung up, or it was cancelled) is charged: the engine's own running
    count when its events carry one (`reported`, read from the last event relayed), else an estimate that
    never charges nothing: one token per event relayed plus the prompt at 4 bytes a token."""
    if reported:
        return reported
    return seen.events + len(request_body) // 4


def next_ticket() -> int:
    return next(_tickets)


def next_serial() -> int:
    return next(_serials)


class Instance:
    def __init__(self, key: str, plan: Any, *, lane: Lane, report_to: trio.MemorySendChannel, keep_alive: float,
                 spawn_timeout: float, serial: int, gone: trio.Event, children_dir: Path | None = None,
                 wait_before_spawn: list[trio.Event] | None = None, spawn_delay: float = 0.0,
                 obs: Any = None) -> None:
        self.obs = obs
        self.key = key
        self.name = f"instance[{key}]"
        self.plan = plan
        self.engine_lane = lane
        self.report_to = report_to
        self.keep_alive = keep_alive
        self.spawn_timeout = spawn_timeout
        self.children_dir = children_dir
        self.wait_before_spawn = wait_before_spawn
        self.spawn_delay = spawn_delay
        self.serial = serial
        self.gone = gone  # the lane's event: set once the child is reaped and the memory is free
        self.state = State.STARTING
        self.port = 0
        self.child: EngineProcess | None = None
        self.waiting: list[_Waiter] = []
        self.by_ticket: dict[int, _Waiter] = {}
        self.in_flight = 0
        self.served = 0
        self.clean_answers = 0
        self.last_used = trio.current_time()
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.stop_replies: list[Any] = []
        self.failure = ""
        self.crashed = False
        self._reported_state: State | None = None
        self.running: dict[int, trio.CancelScope] = {}  # ticket -> its upstream request, while in flight
        self._seq = itertools.count()
        self.mailbox: trio.MemorySendChannel | None = None
        self.http: EngineHTTP | None = None

    # ------------------------------------------------------------ run

    async def run(self, inbox: trio.MemoryReceiveChannel, mailbox: trio.MemorySendChannel, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.mailbox = mailbox
        try:
            async with EngineHTTP() as http, trio.open_nursery() as nursery:
                self.http = http
                self.nursery = nursery
                task_status.started()
                nursery.start_soon(self._spawn)
                try:
                    await self._loop(inbox)
                finally:
                    with trio.move_on_after(STOP_GRACE_SECS + 5) as cleanup:
                        cleanup.shield = True
                        await self._terminate()
                    nursery.cancel_scope.cancel()
        except Exception as error:  # a bug here is this model's crash, never the lane's
            log.error("%s failed: %s", self.name, "".join(traceback.format_exception(error)))
            self.crashed = True
            self.failure = f"{self.key}'s instance failed inside Blazar: {type(error).__name__}: {error}"
            with trio.move_on_after(STOP_GRACE_SECS + 5) as cleanup:
                cleanup.shield = True
                await self._terminate()
        finally:
            self.state = State.STOPPED
            self._fail_waiters(503, "model_unloaded", f"{self.key} was unloaded before this request started; retry")
            self._close_inbox(inbox)
            for reply in self.stop_replies:
                answer(reply, Ok(self.describe()))
            self.gone.set()
            event = self._event()
            with trio.move_on_after(1) as notify:  # the lane must hear this one; it may be shutting down
                notify.shield = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.report_to.send(event)

    def _close_inbox(self, inbox: trio.MemoryReceiveChannel) -> None:
        """Nothing reaches a stopped instance: what is still in its mailbox is answered now, and a later
        sender (a route holding a cached handle) fails at once and asks the lane again."""
        while True:
            try:
                message = inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, Submit):
                answer(message.reply, Err("model_unloaded", f"{self.key} was unloaded before this request "
                                          "reached it; retry", status=503))
            elif isinstance(message, Stop) and message.reply is not None:
                self.stop_replies.append(message.reply)
            elif isinstance(message, Describe):
                answer(message.reply, Ok(self.describe()))
        inbox.close()

    # ------------------------------------------------------------ the loop

    async def _loop(self, inbox: trio.MemoryReceiveChannel) -> None:
        while True:
            if self._should_stop_now():
                return
            with trio.move_on_at(self._next_wakeup()):
                try:
                    message = await inbox.receive()
                except trio.EndOfChannel:
                    return
                self.handle(message)
                continue
            self.handle(_Timer(reply=None))

    def handle(self, message: Envelope) -> None:
        """One message through the transition table."""
        before = self.state
        allowed = TRANSITIONS.get((before, type(message)))
        if allowed is None:
            raise RuntimeError(f"{self.name}: no transition for {type(message).__name__} in state {before}")
        self._HANDLERS[type(message)](self, message)
        if self.state not in allowed:
            raise RuntimeError(f"{self.name}: {type(message).__name__} moved {before} -> {self.state}, "
                               f"the table allows {sorted(allowed)}")

    def _should_stop_now(self) -> bool:
        if self.state is State.STOPPING:
            return True
        if self.state is State.DRAINING and self.in_flight == 0 and not self.waiting:
            return True
        return self.state is State.FAILED and self.in_flight == 0

    def _next_wakeup(self) -> float:
        wake = float("inf")
        if self.waiting:
            wake = min(w.expire_at for w in self.waiting)
        if self.state is State.READY and self.in_flight == 0 and not self.waiting:
            wake = min(wake, self.last_used + self.keep_alive)
        return wake

    def _on_timer(self, _message: _Timer) -> None:
        now = trio.current_time()
        expired = [w for w in self.waiting if w.expire_at <= now]
        for waiter in expired:
            self._remove_waiter(waiter.ticket)
            answer(waiter.reply, Err(
                "all_slots_busy",
                f"all {self.plan.slots} slots of {self.key} stayed busy for {now - waiter.enqueued_at:.1f}s; "
                "the request was not started",
                fix="retry later, send X-Blazar-Priority: high, raise X-Blazar-Deadline-Ms, or give the model more "
                f'slots: blazar config set \'models."{self.key}".parallel\' {self.plan.slots * 2}',
                status=503))
        if self.state is State.READY and self.in_flight == 0 and not self.waiting and \
                now >= self.last_used + self.keep_alive:
            log.info("%s idle for %.0fs: evicting", self.key, now - self.last_used)
            self.failure = "idle"
            self.state = State.DRAINING
        self._report()

    def _on_withdraw(self, message: Withdraw) -> None:
        self._remove_waiter(message.ticket)
        scope = self.running.get(message.ticket)
        if scope is not None:
            scope.cancel()  # the client left mid-request: close the upstream so the engine stops
        self._report()

    def _on_finished(self, message: _Finished) -> None:
        self.in_flight -= 1
        self.served += 1
        self.clean_answers += message.clean
        self.last_used = trio.current_time()
        self._dispatch()
        self._report(force=message.clean and self.clean_answers == 1)  # the breaker's probe succeeded

    def _on_ready(self, _message: _Ready) -> None:
        if self.state is not State.STARTING:
            return
        self.state = State.READY
        self.ready_at = time.time()
        self.last_used = trio.current_time()
        log.info("%s ready on port %d (%.1fs)", self.key, self.port, self.ready_at - self.started_at)
        self._dispatch()
        self._report()

    def _on_spawn_failed(self, message: _SpawnFailed) -> None:
        if self.state is not State.STARTING:
            return
        self.failure = message.reason
        self.crashed = True
        self.state = State.FAILED
        self._report()  # the lane hears of the failure before any client can ask again
        self._fail_waiters(502, "engine_failed", message.reason)

    def _on_exited(self, message: _Exited) -> None:
        if self.state in (State.STOPPING, State.STOPPED, State.FAILED):
            return
        tail = self.child.crash_report() if self.child else ""
        when = " while loading" if self.state is State.STARTING else ""
        self.failure = f"{self.key}'s engine {exit_cause(message.returncode)}{when}" + (
            f":\n{tail}" if tail else "")
        log.warning("%s", self.failure)
        self.crashed = True
        self.state = State.FAILED
        self._report()
        self._fail_waiters(502, "engine_crashed", self.failure)

    def _on_stop(self, message: Stop) -> None:
        busy = self.in_flight or self.waiting or self.state is State.STARTING
        if message.if_idle and busy:
            answer(message.reply, Err("busy", f"{self.key} is busy", status=409))
            return
        if message.reply is not None:
            self.stop_replies.append(message.reply)
        if self.state in TERMINAL or self.state in (State.DRAINING, State.FAILED):
            return
        self.failure = self.failure or message.reason
        if self.state is State.STARTING:
            # Nothing has reached the child yet: the queued requests are told now, not when their wait runs out.
            self._fail_waiters(503, "model_unloading",
                               f"{self.key} was stopped ({message.reason}) before it finished loading; retry",
                               fix="send the request again: it loads the model anew")
            self.state = State.STOPPING
        else:
            self.state = State.DRAINING
        self._report()

    def _on_describe(self, message: Describe) -> None:
        answer(message.reply, Ok(self.describe()))

    def _on_submit(self, message: Submit) -> None:
        if self.state in (State.DRAINING, State.STOPPING, State.STOPPED):
            answer(message.reply, Err("model_unloading", f"{self.key} is being unloaded", fix="retry in a moment",
                                      status=503))
            return
        if self.state is State.FAILED:
            # It never reached the engine: the forwarder asks the lane again, which restarts the model or
            # answers with its crash breaker.
            answer(message.reply, Err("instance_failed", self.failure, status=502))
            return
        if message.keep_alive is not None:
            self.keep_alive = message.keep_alive
        waiter = _Waiter(due=message.due, seq=next(self._seq), ticket=message.ticket, call=message.call,
                         reply=message.reply, expire_at=message.expire_at, enqueued_at=trio.current_time(),
                         cold=self.ready_at is None, on_usage=message.on_usage)
        heapq.heappush(self.waiting, waiter)
        self.by_ticket[waiter.ticket] = waiter
        self._dispatch()
        self._report()

    _HANDLERS: dict[type[Envelope], Callable[[Instance, Any], None]] = {
        Submit: _on_submit, Withdraw: _on_withdraw, _Finished: _on_finished, _Ready: _on_ready,
        _SpawnFailed: _on_spawn_failed, _Exited: _on_exited, Stop: _on_stop, Describe: _on_describe,
        _Timer: _on_timer,
    }

    def _remove_waiter(self, ticket: int) -> None:
        waiter = self.by_ticket.pop(ticket, None)
        if waiter is not None:
            self.waiting.remove(waiter)
            heapq.heapify(self.waiting)

    def _dispatch(self) -> None:
        if self.state not in (State.READY, State.BUSY, State.DRAINING) or self.ready_at is None:
            return
        while self.waiting and self.in_flight < self.plan.slots:
            waiter = heapq.heappop(self.waiting)
            self.by_ticket.pop(waiter.ticket, None)
            self.in_flight += 1
            self.nursery.start_soon(self._serve, waiter, trio.current_time() - waiter.enqueued_at)
        if self.state is not State.DRAINING:
            self.state = State.BUSY if self.in_flight else State.READY

    def _fail_waiters(self, status: int, code: str, message: str, fix: str = "") -> None:
        for waiter in list(self.waiting):
            answer(waiter.reply, Err(code, message, fix=fix, status=status))
        self.waiting.clear()
        self.by_ticket.clear()

    def _event(self) -> InstanceEvent:
        return InstanceEvent(reply=None, key=self.key, serial=self.serial, state=str(self.state), detail=self.failure,
                             crashed=self.crashed, snapshot=self.describe())

    def _report(self, *, force: bool = False) -> None:
        """Tell the lane when the state changed (busy/ready is all its decisions need): one message per
        transition, not per request."""
        if self.state == self._reported_state and not force:
            return
        self._reported_state = self.state
        tell(self.report_to, self._event())

    def describe(self) -> dict[str, Any]:
        idle_left = None
        if self.state is State.READY and self.in_flight == 0:
            idle_left = max(0.0, self.last_used + self.keep_alive - trio.current_time())
        return {
            "model": self.key, "state": str(self.state), "lane": self.engine_lane.kind, "port": self.port,
            "pid": self.child.pid if self.child else None, "engine": self.plan.engine_tag,
            "context": self.plan.context, "context_source": self.plan.context_source, "slots": self.plan.slots,
            "in_flight": self.in_flight, "queued": len(self.waiting), "served": self.served,
            "clean_answers": self.clean_answers,
            "keep_alive_secs": None if self.keep_alive == float("inf") else self.keep_alive,
            "idle_expires_in_secs": None if idle_left in (None, float("inf")) else round(idle_left, 1),
            "last_used": self.last_used,
            "started_at": self.started_at, "ready_at": self.ready_at, "size_bytes": self.plan.size_bytes,
            "digest": self.plan.digest, "gpu_engine": self.plan.gpu_engine, "failure": self.failure or None,
        }

    # ------------------------------------------------------------ the child

    def output_tail(self, lines: int = 15) -> str:
        return self.child.output_tail(lines) if self.child else ""

    async def _spawn(self) -> None:
        assert self.mailbox is not None  # run() set it before starting this task
        for predecessor_gone in self.wait_before_spawn or []:
            await predecessor_gone.wait()  # the memory it frees is what this child needs
        if self.spawn_delay:
            await trio.sleep(self.spawn_delay)
        self.port = free_port()
        self.child = EngineProcess(self.engine_lane.argv(self.plan, self.port), name=self.key)
        try:
            await self.child.start(self.nursery, on_exit=self._on_child_exit)
            await trio.to_thread.run_sync(self._write_pidfile)
            assert self.http is not None
            await self.child.wait_ready(self.http, f"http://127.0.0.1:{self.port}{self.engine_lane.health_path}",
                                        self.spawn_timeout)
        except ChildFailed as failure:
            tell(self.mailbox, _SpawnFailed(reply=None, reason=str(failure)))
            return
        await self.mailbox.send(_Ready(reply=None))

    async def _on_child_exit(self, code: int) -> None:
        assert self.mailbox is not None  # run() set it before the child was spawned
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.mailbox.send(_Exited(reply=None, returncode=code))

    async def _terminate(self) -> None:
        if self.child is None or self.child.process is None:
            return
        if self.child.alive:
            self.state = State.STOPPING
        await self.child.terminate(STOP_GRACE_SECS)
        await trio.to_thread.run_sync(self._remove_pidfile)

    def _pidfile(self) -> Path | None:
        if not self.children_dir or self.child is None or self.child.pid is None:
            return None
        return Path(self.children_dir) / f"{self.child.pid}.json"

    def _write_pidfile(self) -> None:
        path = self._pidfile()
        if path is not None:
            assert self.child is not None  # a pidfile path is only named for a child
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"pid": self.child.pid, "model": self.key, "engine_tag": self.plan.engine_tag,
                                        "port": self.port, "argv0": str(self.plan.binary),
                                        "gateway_pid": os.getpid()}))  # doctor: is its gateway gone?

    def _remove_pidfile(self) -> None:
        path = self._pidfile()
        if path is not None:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ one request

    async def _serve(self, waiter: _Waiter, queued_secs: float) -> None:
        clean = False
        with trio.CancelScope() as scope:
            self.running[waiter.ticket] = scope
            try:
                clean = await self._exchange(waiter, queued_secs)
            finally:
                self.running.pop(waiter.ticket, None)
                assert self.mailbox is not None  # run() set it before serving anything
                with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError,
                                                                        trio.ClosedResourceError):
                    await self.mailbox.send(_Finished(reply=None, ticket=waiter.ticket, clean=clean))

    def _child_alive(self) -> bool:
        return self.child is not None and self.child.alive

    async def _request(self, call: UpstreamCall, url: str) -> tuple[int, bytes, str]:
        http = self.http
        assert http is not None
        response = await once_more_if_stale(lambda: http.request(call.method, url, call.body, call.content_type),
                                            may_retry=self._child_alive)
        return response.status, response.content, header(response, b"content-type")

    async def _exchange(self, waiter: _Waiter, queued_secs: float) -> bool:
        """Relay one request; True when the engine answered without breaking."""
        call = waiter.call
        url = f"http://127.0.0.1:{self.port}{call.path}"
        lane = self.engine_lane
        assert self.http is not None
        seen = StreamSeen()
        if call.stream and waiter.on_usage is not None and call.path in lane.generation_paths:
            call = msgspec.structs.replace(call, body=lane.metered(call.body))
        try:
            if not call.stream:
                status, body, content_type = await self._request(call, url)
                answer(waiter.reply, Ok(self._reply(status, body, content_type, queued_secs)))
                if status == 200 and call.path in lane.generation_paths:
                    self._observe(waiter, queued_secs, lane.decode(body), first_chunk=None)
                return True
            async with contextlib.AsyncExitStack() as stack:
                http = self.http
                response = await once_more_if_stale(lambda: stack.enter_async_context(
                    http.stream(call.method, url, call.body, call.content_type)), may_retry=self._child_alive)
                content_type = header(response, b"content-type")
                if response.status != 200:
                    body = await response.aread()
                    answer(waiter.reply, Ok(self._reply(response.status, body, content_type, queued_secs)))
                    return True
                send, receive = trio.open_memory_channel[StreamChunk | StreamFailure](STREAM_BUFFER)
                with send:
                    if not answer(waiter.reply, Ok(UpstreamStream(status=200, chunks=receive,
                                                                  queued_secs=queued_secs,
                                                                  content_type="text/event-stream"))):
                        return True  # the caller left before the first byte
                    try:
                        broken = await pump_stream(response, send, seen)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._charge_cut(waiter, seen)  # the client hung up or was cancelled mid-stream
                        raise
                    if broken is None:
                        if call.path in lane.generation_paths:
                            self._observe(waiter, queued_secs, lane.final_event(seen.tail),
                                          first_chunk=seen.first_chunk)
                        return True
                    self._charge_cut(waiter, seen)  # the engine broke: what it generated was still served
                    await trio.sleep(0.05)  # let the exit watcher and output drain see the crash
                    with contextlib.suppress(trio.BrokenResourceError):
                        await send.send(StreamFailure(message=self._broken(broken)))
                    return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True  # the client hung up: leaving the `async with` closes the upstream request
        except TRANSPORT_ERRORS as error:
            await trio.sleep(0.05)
            if isinstance(error, httpcore.ConnectError):
                # Refused at connect: the child died before this request reached it, so the forwarder may
                # place it once more (the lane restarts the model or answers with its breaker).
                answer(waiter.reply, Err("instance_failed", f"{self.key}'s engine was gone before this request "
                                         f"reached it: {self._broken(error)}", status=502))
            else:
                answer(waiter.reply, Err("engine_error", self._broken(error), status=502))
            return False

    def _reply(self, status: int, body: bytes, content_type: str, queued_secs: float) -> UpstreamReply:
        return UpstreamReply(status=status, body=body, content_type=content_type, queued_secs=queued_secs,
                             engine_message=self.engine_lane.error_text(body) if status >= 400 else "")

    def _observe(self, waiter: _Waiter, queued: float, payload: dict[str, Any], first_chunk: float | None) -> None:
        """Tokens for the key's limits; TTFT from admission (engine timings for buffered answers), TPOT from
        the engine's timings."""
        usage = self.engine_lane.usage(payload)
        if waiter.on_usage is not None:
            waiter.on_usage(usage.total)
        if self.obs is None:
            return
        ttft = first_chunk if first_chunk is not None else usage.ttft_secs
        self.obs.generation(self.key, ttft=ttft, cold=waiter.cold, tpot=usage.per_token_secs, queued=queued,
                            prompt_tokens=usage.prompt, completion_tokens=usage.completion,
                            cached_tokens=usage.cached)

    def _charge_cut(self, waiter: _Waiter, seen: StreamSeen) -> None:
        if waiter.on_usage is None or waiter.call.path not in self.engine_lane.generation_paths:
            return
        reported = self.engine_lane.usage(self.engine_lane.final_event(seen.tail)).total
        waiter.on_usage(cut_stream_tokens(reported, seen, waiter.call.body))

    def _broken(self, error: Exception) -> str:
        code = self.child.returncode if self.child else None
        what = exit_cause(code) if code is not None else f"broke the connection ({type(error).__name__})"
        tail = self.child.crash_report(8) if self.child else ""
        return f"{self.key}'s engine {what} during the request" + (f":\n{tail}" if tail else "")
