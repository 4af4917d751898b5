"""The Instance actor: one engine child process serving one resident model.

Lifecycle (only `_loop` changes `self.state`):

    starting --Ready--> ready <--> busy --Stop--> draining --(in-flight done)--> stopping --> stopped
    starting --SpawnFailed--> failed            ready/busy --Exited(crash)--> failed --> stopped

- starting: the child is spawned in its own process group with its output drained into a bounded
  ring; `/health` is polled racing the child's exit and the spawn deadline. Requests queue.
- ready/busy: requests are admitted into the child's slots in earliest-deadline order (priority
  tiers or a strict client deadline); a request that waits past its bound gets 503 all_slots_busy;
  one whose client leaves is withdrawn at once. The idle TTL counts only with nothing in flight.
- draining: no new requests; the ones in flight or queued finish, then the child stops.
- stopping: SIGTERM to the group, grace, SIGKILL, always reaped; the pidfile goes with it.
- failed: queued requests get a 502 carrying the engine's own last lines.

Each admitted request runs as a task in this actor's nursery: it talks to the child over HTTP and
hands the caller either the whole answer or a bounded channel of stream chunks. A caller that stops
reading closes the channel, which closes the upstream request, so the engine stops generating.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import trio

from lanes.llamacpp import HEALTH_PATH, SpawnPlan

from .actor import Envelope, Err, Ok, answer, tell

log = logging.getLogger("blazar.instance")

OUTPUT_RING_BYTES = 64 * 1024
STOP_GRACE_SECS = 5.0
STREAM_BUFFER = 32


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
    method: str = "POST"
    path: str
    body: bytes = b""
    stream: bool = False
    content_type: str = "application/json"


class UpstreamReply(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    body: bytes
    content_type: str = "application/json"
    queued_secs: float = 0.0


@dataclass(frozen=True)
class StreamFailure:
    """Last item on a stream channel when the engine broke mid-stream."""

    message: str


@dataclass
class UpstreamStream:
    status: int
    chunks: trio.MemoryReceiveChannel  # bytes, then maybe one StreamFailure
    content_type: str = "text/event-stream"
    queued_secs: float = 0.0


class Submit(Envelope, frozen=True, tag="submit"):
    ticket: int = 0
    call: UpstreamCall | None = None
    due: float = 0.0  # EDF key: trio time by which it should start
    expire_at: float = 0.0  # trio time after which waiting is refused with 503
    keep_alive: float | None = None
    on_usage: Any = None  # called with the engine's prompt + completion token count of a generation


class Withdraw(Envelope, frozen=True, tag="withdraw"):
    ticket: int = 0


class Stop(Envelope, frozen=True, tag="stop"):
    reason: str = "requested"
    if_idle: bool = False


class Describe(Envelope, frozen=True, tag="describe"):
    pass


class _Ready(Envelope, frozen=True, tag="ready"):
    pass


class _SpawnFailed(Envelope, frozen=True, tag="spawn_failed"):
    reason: str = ""


class _Exited(Envelope, frozen=True, tag="exited"):
    returncode: int = 0


class _Finished(Envelope, frozen=True, tag="finished"):
    ticket: int = 0


class InstanceEvent(Envelope, frozen=True, tag="instance_event"):
    """Told to the lane on every state change."""

    key: str = ""
    state: str = ""
    last_used: float = 0.0
    detail: str = ""
    crashed: bool = False
    serial: int = 0


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


GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/completion")


def _decode_or_empty(body: bytes) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _final_event(tail: bytes) -> dict[str, Any]:
    """The last SSE event that carries timings or usage (llama-server puts them in the final chunk)."""
    for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        if b'"timings"' in event or b'"usage"' in event:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    return _decode_or_empty(line[5:].strip())
    return {}


_tickets = itertools.count(1)
_serials = itertools.count(1)


def next_ticket() -> int:
    return next(_tickets)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Instance:
    def __init__(self, key: str, plan: SpawnPlan, *, lane: trio.MemorySendChannel, keep_alive: float,
                 spawn_timeout: float, children_dir: os.PathLike | None = None,
                 wait_before_spawn: list[trio.Event] | None = None, spawn_delay: float = 0.0,
                 obs: Any = None) -> None:
        self.obs = obs
        self.key = key
        self.name = f"instance[{key}]"
        self.plan = plan
        self.lane = lane
        self.keep_alive = keep_alive
        self.spawn_timeout = spawn_timeout
        self.children_dir = children_dir
        self.wait_before_spawn = wait_before_spawn
        self.spawn_delay = spawn_delay
        self.state = State.STARTING
        self.port = 0
        self.process: trio.Process | None = None
        self.output: deque[bytes] = deque()
        self.output_bytes = 0
        self.waiting: list[_Waiter] = []
        self.by_ticket: dict[int, _Waiter] = {}
        self.in_flight = 0
        self.served = 0
        self.last_used = trio.current_time()
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.stop_replies: list[Any] = []
        self.failure = ""
        self.gone = trio.Event()
        self.output_closed = trio.Event()
        self.crashed = False
        self.serial = next(_serials)
        self._reported_state: State | None = None
        self.running: dict[int, trio.CancelScope] = {}  # ticket -> its upstream request, while in flight
        self._seq = itertools.count()
        self.mailbox: trio.MemorySendChannel | None = None
        self.client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------ run

    async def run(self, inbox: trio.MemoryReceiveChannel, mailbox: trio.MemorySendChannel, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.mailbox = mailbox
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                         limits=httpx.Limits(max_keepalive_connections=64)) as client, \
                    trio.open_nursery() as nursery:
                self.client = client
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
        finally:
            self.state = State.STOPPED
            self._fail_waiters(503, "model_unloaded", f"{self.key} was unloaded before this request started; retry")
            for reply in self.stop_replies:
                answer(reply, Ok(self.describe()))
            self.gone.set()
            event = InstanceEvent(key=self.key, state=State.STOPPED, detail=self.failure, crashed=self.crashed,
                                  serial=self.serial)
            with trio.move_on_after(1) as notify:  # the lane must hear this one; it may be shutting down
                notify.shield = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.lane.send(event)

    # ------------------------------------------------------------ the loop

    async def _loop(self, inbox: trio.MemoryReceiveChannel) -> None:
        while self.state not in (State.STOPPED,):
            if self._should_stop_now():
                return
            with trio.move_on_at(self._next_wakeup()):
                try:
                    message = await inbox.receive()
                except trio.EndOfChannel:
                    return
                self._handle(message)
                continue
            self._on_timer()

    def _should_stop_now(self) -> bool:
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

    def _on_timer(self) -> None:
        now = trio.current_time()
        expired = [w for w in self.waiting if w.expire_at <= now]
        for waiter in expired:
            self._remove_waiter(waiter.ticket)
            answer(waiter.reply, Err(
                "all_slots_busy",
                f"all {self.plan.slots} slots of {self.key} stayed busy for {now - waiter.enqueued_at:.1f}s; "
                "the request was not started",
                hint="retry later, send X-Blazar-Priority: high, raise X-Blazar-Deadline-Ms, or give the model more "
                f'slots: blazar config set \'models."{self.key}".parallel\' {self.plan.slots * 2}',
                status=503))
        if self.state is State.READY and self.in_flight == 0 and not self.waiting and \
                now >= self.last_used + self.keep_alive:
            log.info("%s idle for %.0fs: evicting", self.key, now - self.last_used)
            self.failure = "idle"
            self.state = State.DRAINING
            self._report()

    def _handle(self, message: Envelope) -> None:
        match message:
            case Submit():
                self._submit(message)
            case Withdraw(ticket=ticket):
                self._remove_waiter(ticket)
                scope = self.running.get(ticket)
                if scope is not None:
                    scope.cancel()  # the client left mid-request: close the upstream so the engine stops
                self._report()
            case _Finished():
                self.in_flight -= 1
                self.served += 1
                self.last_used = trio.current_time()
                self._dispatch()
                self._report()
            case _Ready():
                if self.state is State.STARTING:
                    self.state = State.READY
                    self.ready_at = time.time()
                    self.last_used = trio.current_time()
                    log.info("%s ready on port %d (%.1fs)", self.key, self.port, self.ready_at - self.started_at)
                    self._dispatch()
                    self._report()
            case _SpawnFailed(reason=reason):
                self.failure = reason
                self.crashed = True
                self.state = State.FAILED
                self._report()  # the lane hears of the failure before any client can ask again
                self._fail_waiters(502, "engine_failed", reason)
            case _Exited(returncode=code):
                if self.state not in (State.STOPPING, State.STOPPED, State.FAILED):
                    tail = self.output_tail()
                    when = " while loading" if self.state is State.STARTING else ""
                    self.failure = f"{self.key}'s engine exited with code {code}{when}" + (f":\n{tail}" if tail else "")
                    log.warning("%s", self.failure)
                    self.crashed = True
                    self.state = State.FAILED
                    self._report()
                    self._fail_waiters(502, "engine_crashed", self.failure)
            case Stop(reason=reason, if_idle=if_idle):
                busy = self.in_flight or self.waiting or self.state is State.STARTING
                if if_idle and busy:
                    answer(message.reply, Err("busy", f"{self.key} is busy", status=409))
                    return
                self.failure = self.failure or reason
                if message.reply is not None:
                    self.stop_replies.append(message.reply)
                if self.state in (State.READY, State.BUSY, State.STARTING):
                    self.state = State.DRAINING
                self._report()
            case Describe():
                answer(message.reply, Ok(self.describe()))

    def _submit(self, message: Submit) -> None:
        if self.state in (State.DRAINING, State.STOPPING, State.STOPPED):
            answer(message.reply, Err("model_unloading", f"{self.key} is being unloaded", hint="retry in a moment",
                                      status=503))
            return
        if self.state is State.FAILED:
            answer(message.reply, Err("engine_failed", self.failure, status=502))
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

    def _fail_waiters(self, status: int, code: str, message: str) -> None:
        for waiter in list(self.waiting):
            answer(waiter.reply, Err(code, message, status=status))
        self.waiting.clear()
        self.by_ticket.clear()

    def _report(self) -> None:
        """Tell the lane when the state changed (busy/ready is all its decisions need): one message per
        transition, not per request."""
        if self.state == self._reported_state:
            return
        self._reported_state = self.state
        tell(self.lane, InstanceEvent(key=self.key, state=self.state, last_used=self.last_used, detail=self.failure,
                                      crashed=self.crashed, serial=self.serial))

    def describe(self) -> dict[str, Any]:
        idle_left = None
        if self.state is State.READY and self.in_flight == 0:
            idle_left = max(0.0, self.last_used + self.keep_alive - trio.current_time())
        return {
            "model": self.key, "state": str(self.state), "port": self.port,
            "pid": self.process.pid if self.process else None, "engine": self.plan.engine_tag,
            "context": self.plan.context, "context_source": self.plan.context_source, "slots": self.plan.slots,
            "in_flight": self.in_flight, "queued": len(self.waiting), "served": self.served,
            "keep_alive_secs": None if self.keep_alive == float("inf") else self.keep_alive,
            "idle_expires_in_secs": None if idle_left in (None, float("inf")) else round(idle_left, 1),
            "started_at": self.started_at, "ready_at": self.ready_at, "size_bytes": self.plan.size_bytes,
            "failure": self.failure or None,
        }

    # ------------------------------------------------------------ the child

    def output_tail(self, lines: int = 15) -> str:
        text = b"".join(self.output).decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    async def _spawn(self) -> None:
        for predecessor_gone in self.wait_before_spawn or []:
            await predecessor_gone.wait()  # the memory it frees is what this child needs
        if self.spawn_delay:
            await trio.sleep(self.spawn_delay)
        self.port = free_port()
        argv = self.plan.argv(self.port)
        try:
            self.process = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
        except OSError as error:
            tell(self.mailbox, _SpawnFailed(reason=f"could not start {argv[0]}: {error}"))
            return
        await trio.to_thread.run_sync(self._write_pidfile)
        self.nursery.start_soon(self._drain_output)
        self.nursery.start_soon(self._watch_exit)
        deadline = trio.current_time() + self.spawn_timeout
        url = f"http://127.0.0.1:{self.port}{HEALTH_PATH}"
        assert self.client is not None
        while True:
            if self.process.returncode is not None:
                await trio.sleep(0.05)  # let the output drain catch the last lines
                tell(self.mailbox, _SpawnFailed(
                    reason=f"{self.key}'s engine exited with code {self.process.returncode} while loading:\n"
                    f"{self.output_tail()}"))
                return
            with contextlib.suppress(httpx.TransportError):
                if (await self.client.get(url, timeout=2)).status_code == 200:
                    await self.mailbox.send(_Ready())
                    return
            if trio.current_time() > deadline:
                tell(self.mailbox, _SpawnFailed(
                    reason=f"{self.key}'s engine did not become healthy within {self.spawn_timeout:g}s:\n"
                    f"{self.output_tail()}"))
                return
            await trio.sleep(0.1)

    async def _drain_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for chunk in self.process.stdout:
            self.output.append(chunk)
            self.output_bytes += len(chunk)
            while self.output_bytes > OUTPUT_RING_BYTES and len(self.output) > 1:
                self.output_bytes -= len(self.output.popleft())
        self.output_closed.set()

    async def _watch_exit(self) -> None:
        assert self.process is not None
        code = await self.process.wait()
        with trio.move_on_after(0.5):
            await self.output_closed.wait()  # the engine's last words explain the exit
        with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.mailbox.send(_Exited(returncode=code))

    async def _terminate(self) -> None:
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            self.state = State.STOPPING
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE_SECS):
                await process.wait()
            if process.returncode is None:
                log.warning("%s ignored SIGTERM for %gs: SIGKILL", self.key, STOP_GRACE_SECS)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        await trio.to_thread.run_sync(self._remove_pidfile)

    def _pidfile(self):
        from pathlib import Path

        return Path(self.children_dir) / f"{self.process.pid}.json" if self.children_dir and self.process else None

    def _write_pidfile(self) -> None:
        path = self._pidfile()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"pid": self.process.pid, "model": self.key, "engine_tag": self.plan.engine_tag,
                                        "port": self.port, "argv0": str(self.plan.binary)}))

    def _remove_pidfile(self) -> None:
        path = self._pidfile()
        if path is not None:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ one request

    async def _serve(self, waiter: _Waiter, queued_secs: float) -> None:
        with trio.CancelScope() as scope:
            self.running[waiter.ticket] = scope
            try:
                await self._exchange(waiter, queued_secs)
            finally:
                self.running.pop(waiter.ticket, None)

    async def _exchange(self, waiter: _Waiter, queued_secs: float) -> None:
        call = waiter.call
        url = f"http://127.0.0.1:{self.port}{call.path}"
        headers = {"content-type": call.content_type}
        assert self.client is not None
        try:
            if not call.stream:
                try:
                    response = await self.client.request(call.method, url, content=call.body or None,
                                                         headers=headers)
                except httpx.RemoteProtocolError:
                    if self.process is None or self.process.returncode is not None:
                        raise
                    # The engine closed a pooled keep-alive connection (it does after a stream): the
                    # request never reached it, so it is safe to send once more on a fresh connection.
                    response = await self.client.request(call.method, url, content=call.body or None,
                                                         headers=headers)
                answer(waiter.reply, Ok(UpstreamReply(status=response.status_code, body=response.content,
                                                      content_type=response.headers.get("content-type", ""),
                                                      queued_secs=queued_secs)))
                if response.status_code == 200 and call.path in GENERATION_PATHS:
                    self._observe(waiter, queued_secs, _decode_or_empty(response.content), first_chunk=None)
                return
            async with contextlib.AsyncExitStack() as stack:
                try:
                    response = await stack.enter_async_context(
                        self.client.stream(call.method, url, content=call.body, headers=headers))
                except httpx.RemoteProtocolError:
                    if self.process is None or self.process.returncode is not None:
                        raise
                    response = await stack.enter_async_context(  # a stale pooled connection: once more
                        self.client.stream(call.method, url, content=call.body, headers=headers))
                if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", ""):
                    body = await response.aread()
                    answer(waiter.reply, Ok(UpstreamReply(status=response.status_code, body=body,
                                                          content_type=response.headers.get("content-type", ""),
                                                          queued_secs=queued_secs)))
                    return
                send, receive = trio.open_memory_channel[Any](STREAM_BUFFER)
                with send:
                    if not answer(waiter.reply, Ok(UpstreamStream(status=200, chunks=receive,
                                                                  queued_secs=queued_secs))):
                        return  # the caller left before the first byte
                    sent_at = trio.current_time()
                    first_chunk: float | None = None
                    tail = b""
                    try:
                        async for chunk in response.aiter_raw():
                            if first_chunk is None:
                                first_chunk = trio.current_time() - sent_at
                            tail = (tail + chunk)[-8192:]
                            await send.send(chunk)
                        if call.path in GENERATION_PATHS:
                            self._observe(waiter, queued_secs, _final_event(tail), first_chunk=first_chunk)
                    except httpx.TransportError as error:
                        await trio.sleep(0.05)  # let the exit watcher and output drain see the crash
                        with contextlib.suppress(trio.BrokenResourceError):
                            await send.send(StreamFailure(self._broken(error)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client hung up: leaving the `async with` closes the upstream request
        except httpx.TransportError as error:
            await trio.sleep(0.05)
            answer(waiter.reply, Err("engine_error", self._broken(error), status=502))
        finally:
            with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError,
                                                                    trio.ClosedResourceError):
                await self.mailbox.send(_Finished(ticket=waiter.ticket))

    def _observe(self, waiter: _Waiter, queued: float, payload: dict[str, Any], first_chunk: float | None) -> None:
        """Tokens for the key's limits; TTFT from admission (engine timings for buffered answers), TPOT from
        the engine's timings."""
        timings = payload.get("timings") or {}
        usage = payload.get("usage") or {}
        if waiter.on_usage is not None:
            prompt = usage.get("prompt_tokens") or (timings.get("prompt_n") or 0) + (timings.get("cache_n") or 0)
            completion = usage.get("completion_tokens") or timings.get("predicted_n") or 0
            waiter.on_usage(int(prompt) + int(completion))
        if self.obs is None:
            return
        ttft = first_chunk if first_chunk is not None else (timings.get("prompt_ms") or 0) / 1000 or None
        per_token = timings.get("predicted_per_token_ms")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or timings.get("cache_n") or 0
        self.obs.generation(self.key, ttft=ttft, cold=waiter.cold, tpot=per_token / 1000 if per_token else None,
                            queued=queued, prompt_tokens=usage.get("prompt_tokens") or timings.get("prompt_n") or 0,
                            completion_tokens=usage.get("completion_tokens") or timings.get("predicted_n") or 0,
                            cached_tokens=cached)

    def _broken(self, error: Exception) -> str:
        code = self.process.returncode if self.process else None
        what = f"exited with code {code}" if code is not None else f"broke the connection ({type(error).__name__})"
        tail = self.output_tail(8)
        return f"{self.key}'s engine {what} during the request" + (f":\n{tail}" if tail else "")
