"""The actor kit: request/reply, typed errors, deadlines, supervised restarts (autojump clock)."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from supervisors.actor import (
    ActorError,
    ActorGaveUp,
    ActorUnavailable,
    Envelope,
    Err,
    MessageLoop,
    Ok,
    RestartPolicy,
    call,
    supervise,
    tell,
)


class Add(Envelope, frozen=True, tag="add"):
    amount: int


class Boom(Envelope, frozen=True, tag="boom"):
    pass


class Refuse(Envelope, frozen=True, tag="refuse"):
    pass


class Hang(Envelope, frozen=True, tag="hang"):
    pass


class Counter(MessageLoop):
    name = "counter"
    incarnations = 0

    def __init__(self) -> None:
        Counter.incarnations += 1
        self.total = 0

    async def handle(self, message):
        match message:
            case Add(amount=amount):
                self.total += amount
                return Ok(self.total)
            case Boom():
                raise RuntimeError("boom")
            case Refuse():
                return Err("nope", "refused on purpose", fix="ask nicely", status=409)
            case Hang():
                await trio.sleep_forever()


@pytest.fixture(autouse=True)
def reset_counter():
    Counter.incarnations = 0


async def test_call_returns_the_actors_reply(nursery):
    mailbox = await nursery.start(partial(supervise, Counter))
    assert await call(mailbox, lambda r: Add(reply=r, amount=2)) == 2
    assert await call(mailbox, lambda r: Add(reply=r, amount=3)) == 5


async def test_err_reply_raises_with_the_typed_error(nursery):
    mailbox = await nursery.start(partial(supervise, Counter))
    with pytest.raises(ActorError) as caught:
        await call(mailbox, lambda r: Refuse(reply=r))
    assert caught.value.err == Err("nope", "refused on purpose", fix="ask nicely", status=409)


async def test_call_deadline_gives_actor_unavailable(nursery, autojump_clock):
    mailbox = await nursery.start(partial(supervise, Counter))
    with pytest.raises(ActorUnavailable, match="no reply within 2s"):
        await call(mailbox, lambda r: Hang(reply=r), within=2)


async def test_crash_answers_the_caller_then_restarts_with_fresh_state(nursery, autojump_clock):
    mailbox = await nursery.start(partial(supervise, Counter))
    await call(mailbox, lambda r: Add(reply=r, amount=10))
    with pytest.raises(ActorError) as caught:
        await call(mailbox, lambda r: Boom(reply=r))
    assert caught.value.err.code == "internal"
    # The same mailbox reaches the restarted actor, whose state starts over.
    assert await call(mailbox, lambda r: Add(reply=r, amount=1)) == 1
    assert Counter.incarnations == 2


async def test_messages_queued_during_a_restart_are_served(nursery, autojump_clock):
    mailbox = await nursery.start(partial(supervise, Counter, policy=RestartPolicy(backoff_base_secs=1)))
    assert tell(mailbox, Boom(reply=None))
    assert await call(mailbox, lambda r: Add(reply=r, amount=4)) == 4


async def test_restart_budget_spent_gives_up(autojump_clock):
    policy = RestartPolicy(max_restarts=3, window_secs=60, backoff_base_secs=0.5, backoff_max_secs=2)
    started = trio.current_time()
    with pytest.RaisesGroup(pytest.RaisesExc(ActorGaveUp, match="counter crashed 4 times")):
        async with trio.open_nursery() as nursery:
            mailbox = await nursery.start(partial(supervise, Counter, policy=policy))
            for _ in range(4):
                tell(mailbox, Boom(reply=None))
    # Backoff doubles: 0.5 + 1 + 2 seconds of waiting before the fourth crash.
    assert trio.current_time() - started == pytest.approx(3.5)
    assert Counter.incarnations == 4


async def test_crashes_outside_the_window_do_not_count(nursery, autojump_clock):
    policy = RestartPolicy(max_restarts=1, window_secs=10, backoff_base_secs=0.1)
    mailbox = await nursery.start(partial(supervise, Counter, policy=policy))
    for _ in range(3):
        tell(mailbox, Boom(reply=None))
        await trio.sleep(11)
    assert await call(mailbox, lambda r: Add(reply=r, amount=1)) == 1
    assert Counter.incarnations == 4


async def test_a_full_mailbox_refuses_tell_instead_of_blocking(nursery):
    mailbox = await nursery.start(partial(supervise, Counter, mailbox_size=1))
    tell(mailbox, Hang(reply=None))
    await trio.testing.wait_all_tasks_blocked()
    assert tell(mailbox, Add(reply=None, amount=1))
    assert not tell(mailbox, Add(reply=None, amount=1))


def test_mailboxes_must_be_bounded():
    with pytest.raises(ValueError, match="bounded"):
        trio.run(partial(supervise, Counter, mailbox_size=float("inf")))
