"""The actor kit: bounded mailboxes, typed request/reply, supervised restarts.

An actor is an object with `async def run(self, inbox, *, task_status)`: it reads msgspec
envelopes from `inbox` in one loop, and only that loop mutates its state. Slow work runs in child
tasks of the actor's own nursery and reports back with a message.

Callers never touch actor state: they `call()` the actor's mailbox with an envelope that carries a
one-shot reply channel, and get the `Ok` value back or an `ActorError` carrying the typed `Err`.

`supervise()` owns the mailbox, so queued messages survive a restart of the actor behind it, and
restarts it on a crash with exponential backoff until the budget (R restarts in T seconds) is spent.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import trio

log = logging.getLogger("blazar.actors")

MAILBOX_SIZE = 64
DEFAULT_CALL_TIMEOUT = 30.0


class Ok(msgspec.Struct, frozen=True, tag="ok"):
    value: Any


class Err(msgspec.Struct, frozen=True, tag="err"):
    """A refusal an actor owes its caller. `status` is the HTTP status a route should answer."""

    code: str
    message: str
    fix: str = ""  # what the caller can do about it (a route renders it as the error's fix)
    status: int = 500
    retry_after: float = 0.0  # seconds, for a 429/503 the client may retry


Reply = Ok | Err


class Envelope(msgspec.Struct, frozen=True, tag_field="op"):
    """Base for mailbox messages. `reply` is a size-1 channel, or None for fire-and-forget.

    Every field of a message is required, `reply` included: a sender says `reply=None` when it wants
    no answer, so a `call()` whose builder forgets its reply channel fails the type check instead of
    waiting out its deadline.
    """

    reply: Any


class ActorError(Exception):
    def __init__(self, err: Err) -> None:
        super().__init__(err.message)
        self.err = err


class ActorUnavailable(Exception):
    """The actor did not take or answer the message in time, or is gone."""


class ActorStopped(ActorUnavailable):
    """The actor has stopped: its mailbox is closed, so nothing sent there will ever be answered."""


class ActorGaveUp(Exception):
    """A supervised actor crashed more often than its restart budget allows."""


def root_cause(error: BaseException) -> BaseException:
    """The first leaf of nested exception groups: what actually went wrong."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def answer(reply: trio.MemorySendChannel | None, result: Reply) -> bool:
    """Deliver a reply; a caller that already left (timeout, hang-up) is not an error. True if delivered."""
    if reply is None:
        return False
    try:
        reply.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        return False
    return True


async def call(
    mailbox: trio.MemorySendChannel,
    build: Callable[[trio.MemorySendChannel], Envelope],
    *,
    within: float = DEFAULT_CALL_TIMEOUT,
) -> Any:
    """Send `build(reply_channel)` and wait for its reply under a deadline."""
    reply_send, reply_recv = trio.open_memory_channel[Reply](1)
    with reply_recv:
        try:
            with trio.fail_after(within):
                message = build(reply_send)
                try:
                    mailbox.send_nowait(message)  # the common case: room in the mailbox, no extra scheduler pass
                except trio.WouldBlock:
                    await mailbox.send(message)
                result = await reply_recv.receive()
        except trio.TooSlowError:
            raise ActorUnavailable(f"no reply within {within:g}s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel):
            raise ActorStopped("the actor has stopped") from None
    if isinstance(result, Err):
        raise ActorError(result)
    return result.value


def tell(mailbox: trio.MemorySendChannel, message: Envelope) -> bool:
    """Fire-and-forget without blocking; False when the mailbox is full or closed."""
    try:
        mailbox.send_nowait(message)
    except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


class Actor(Protocol):
    name: str
    mailbox: trio.MemorySendChannel  # set by supervise() before run(): the send side of its own mailbox

    async def run(
        self, inbox: trio.MemoryReceiveChannel, *, task_status: trio.TaskStatus[None] = ...
    ) -> None: ...


class MessageLoop:
    """Base for actors whose loop handles one message at a time with `handle()`.

    A handler that raises answers the caller with an `internal` Err first, then crashes the actor so
    its supervisor restarts it from a clean state.
    """

    name = "actor"
    mailbox: trio.MemorySendChannel  # set by supervise() before run(), so child tasks can report back

    async def on_start(self, nursery: trio.Nursery) -> None:
        """Open resources before the first message; runs inside the actor's nursery."""

    async def on_stop(self) -> None:
        """Close resources; runs shielded with a short deadline."""

    async def handle(self, message: Envelope) -> Reply | None:
        raise NotImplementedError

    async def run(
        self, inbox: trio.MemoryReceiveChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await self.on_start(nursery)
                task_status.started()
                async for message in inbox:
                    try:
                        result = await self.handle(message)
                    except Exception as error:
                        answer(message.reply, Err("internal", f"{self.name} failed: {error}"))
                        raise
                    if result is not None:
                        answer(message.reply, result)
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(5) as cleanup:
                cleanup.shield = True
                await self.on_stop()


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_secs: float = 60.0
    backoff_base_secs: float = 0.1
    backoff_max_secs: float = 5.0

    def backoff(self, recent_restarts: int) -> float:
        return min(self.backoff_max_secs, self.backoff_base_secs * (2 ** max(0, recent_restarts - 1)))


async def supervise(
    factory: Callable[[], Actor],
    *,
    policy: RestartPolicy = RestartPolicy(),
    mailbox_size: int = MAILBOX_SIZE,
    on_restart: Callable[[str, BaseException, int], Awaitable[None] | None] | None = None,
    task_status: trio.TaskStatus[trio.MemorySendChannel] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `factory()`'s actor; restart it on crash within the budget. Started value: its mailbox.

    Returns when the actor returns normally (its inbox was closed); raises `ActorGaveUp` when the
    budget is spent. Cancellation passes straight through.
    """
    if not 0 < mailbox_size < math.inf:
        raise ValueError("mailboxes are bounded")
    send, recv = trio.open_memory_channel[Envelope](mailbox_size)
    reported_started = False
    recent: deque[float] = deque()
    with recv:
        while True:
            actor = factory()
            # Each incarnation gets the send side of its own mailbox, so its child tasks can report back.
            actor.mailbox = send
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(actor.run, recv)
                    if not reported_started:
                        task_status.started(send)
                        reported_started = True
                return
            except Exception as error:
                now = trio.current_time()
                recent.append(now)
                while recent and now - recent[0] > policy.window_secs:
                    recent.popleft()
                if len(recent) > policy.max_restarts:
                    raise ActorGaveUp(
                        f"{actor.name} crashed {len(recent)} times in {policy.window_secs:g}s; giving up"
                    ) from error
                delay = policy.backoff(len(recent))
                log.warning("%s crashed (%r); restart %d in %.2fs", actor.name, root_cause(error), len(recent),
                            delay)
                if on_restart is not None:
                    maybe = on_restart(actor.name, error, len(recent))
                    if maybe is not None:
                        await maybe
                await trio.sleep(delay)
