"""The instance's transition table, walked pair by pair: every (state, message) the loop can meet is in
`TRANSITIONS`, handling it never raises, and it leaves the instance in a state the table allows. The
pairs a user feels are checked for what the caller hears. No engine: the instance's child is never spawned."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing

from lanes import LANES
from lanes.llamacpp import SpawnPlan
from supervisors.actor import Err, Ok
from supervisors.instance import (
    TRANSITIONS,
    Describe,
    Instance,
    State,
    Stop,
    Submit,
    UpstreamCall,
    Withdraw,
    _Exited,
    _Finished,
    _Ready,
    _SpawnFailed,
    _Timer,
)

PLAN = SpawnPlan(model="m:1", model_path=Path("/nonexistent.gguf"), binary=Path("/nonexistent/llama-server"),
                 engine_tag="b0-cpu", slots=1)


def messages(reply) -> list:
    call = UpstreamCall(method="POST", path="/v1/chat/completions", body=b"{}", stream=False,
                        content_type="application/json")
    return [
        Submit(reply=reply, ticket=900, call=call, due=0.0, expire_at=float("inf"), keep_alive=None, on_usage=None),
        Withdraw(reply=None, ticket=1), _Finished(reply=None, ticket=2, clean=True), _Ready(reply=None),
        _SpawnFailed(reply=None, reason="boom"), _Exited(reply=None, returncode=9),
        Stop(reply=reply, reason="test", if_idle=False), Stop(reply=reply, reason="test", if_idle=True),
        Describe(reply=reply), _Timer(reply=None),
    ]


async def instance_in(state: State, nursery: trio.Nursery) -> tuple[Instance, list]:
    """An instance placed in `state`, with one request queued and, past loading, one in flight."""
    events_send, _events = trio.open_memory_channel(100)
    instance = Instance("m:1", PLAN, lane=LANES["llamacpp"], report_to=events_send, keep_alive=0.0,
                        spawn_timeout=1, serial=1, gone=trio.Event())
    instance.nursery = nursery
    served: list = []

    async def serve(waiter, queued):  # the request would go to the child: record it instead
        served.append(waiter.ticket)

    instance._serve = serve
    instance.state = state
    if state not in (State.STARTING,):
        instance.ready_at = time.time()
    instance.in_flight = 1 if state is not State.STARTING else 0
    queued_send, queued_recv = trio.open_memory_channel(1)
    if state in (State.STARTING, State.BUSY):  # BUSY with its one slot taken: the request waits
        health = UpstreamCall(method="GET", path="/health", body=b"", stream=False, content_type="application/json")
        instance.handle(Submit(reply=queued_send, ticket=1, call=health,
                               due=0.0, expire_at=float("inf"), keep_alive=None, on_usage=None))
    instance.state = state  # placing the queued request must not move the instance out of the state under test
    return instance, [queued_recv, served]


def test_the_table_covers_every_state_and_message():
    kinds = {type(m) for m in messages(None)}
    missing = [(s, k.__name__) for s in State for k in kinds if (s, k) not in TRANSITIONS]
    assert missing == []


@pytest.mark.parametrize("state", list(State))
async def test_every_message_in_every_state_lands_where_the_table_says(state, nursery):
    for index in range(len(messages(None))):
        instance, _ = await instance_in(state, nursery)
        reply_send, _unread = trio.open_memory_channel(4)
        message = messages(reply_send)[index]
        instance.handle(message)  # raises if the table has no entry or the handler leaves it elsewhere
        assert instance.state in TRANSITIONS[(state, type(message))], (state, type(message).__name__)


async def test_stop_while_loading_answers_queued_requests_at_once_and_stops(nursery):
    instance, (queued, _) = await instance_in(State.STARTING, nursery)
    instance.handle(Stop(reply=None, reason="unloaded on request", if_idle=False))
    assert instance.state is State.STOPPING
    err = queued.receive_nowait()
    assert isinstance(err, Err) and err.status == 503 and err.code == "model_unloading"
    assert "before it finished loading" in err.message and "retry" in err.message


async def test_a_queued_request_waits_for_loading_then_runs_when_ready(nursery):
    instance, (_, served) = await instance_in(State.STARTING, nursery)
    instance.handle(_Ready(reply=None))
    assert instance.state is State.BUSY
    await trio.testing.wait_all_tasks_blocked()
    assert served == [1]


async def test_an_exit_while_busy_fails_queued_requests_with_the_engines_words(nursery):
    instance, (queued, _) = await instance_in(State.BUSY, nursery)
    instance.handle(_Exited(reply=None, returncode=9))
    assert instance.state is State.FAILED
    err = queued.receive_nowait()
    assert err.status == 502 and "exited with code 9" in err.message


@pytest.mark.parametrize(("state", "status", "code"), [
    (State.DRAINING, 503, "model_unloading"), (State.FAILED, 502, "instance_failed"),
])
async def test_a_request_to_a_leaving_instance_is_refused_with_a_lever(state, status, code, nursery):
    instance, _ = await instance_in(state, nursery)
    instance.failure = "the engine exited"
    reply_send, reply_recv = trio.open_memory_channel(1)
    instance.handle(messages(reply_send)[0])
    err = reply_recv.receive_nowait()
    assert (err.status, err.code) == (status, code)


async def test_stop_if_idle_is_refused_while_loading_or_busy(nursery):
    for state in (State.STARTING, State.BUSY):
        instance, _ = await instance_in(state, nursery)
        reply_send, reply_recv = trio.open_memory_channel(1)
        instance.handle(Stop(reply=reply_send, reason="idle check", if_idle=True))
        assert instance.state is state
        assert reply_recv.receive_nowait().status == 409


async def test_describe_answers_in_every_state(nursery):
    for state in State:
        instance, _ = await instance_in(state, nursery)
        reply_send, reply_recv = trio.open_memory_channel(1)
        instance.handle(Describe(reply=reply_send))
        described = reply_recv.receive_nowait()
        assert isinstance(described, Ok) and described.value["state"] == str(state)
