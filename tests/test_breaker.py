"""The one breaker (supervisors/breaker.py), on its own: every transition of its state machine with plain
floats for `now`. Then the remote peer's use of it, its loop's handlers called directly on trio's clock (no
actor, no I/O). The lane's use and the peer's over the network are proven by test_lane_faults,
test_engine_crashes and test_remotes."""

from __future__ import annotations

import pytest
import trio

from blazar.config import RemoteEntry
from supervisors.breaker import Admission, Breaker, Verdict
from supervisors.instance import UpstreamCall
from supervisors.remotes import RemotePeer, RemoteSubmit, _Outcome


def tripped(now: float = 100.0, cool_down: float = 60.0, max_cool_down: float = 900.0) -> Breaker:
    breaker = Breaker(cool_down, max_cool_down=max_cool_down)
    breaker.open(now, "it failed 3 times")
    return breaker


def probing(breaker: Breaker, now: float) -> int:
    admission = breaker.admit(now)
    assert admission.verdict is Verdict.PROBE and admission.ticket is not None
    return admission.ticket


def test_a_closed_breaker_passes_every_request():
    breaker = Breaker(60.0, max_cool_down=900.0)
    assert breaker.state == "closed"
    for now in (0.0, 1e9):
        assert breaker.admit(now) == Admission(Verdict.PASS)
        assert not breaker.admit(now).refused
    assert breaker.wait(5.0) == 0.0
    assert breaker.view(5.0) == {"state": "closed", "cool_down_secs": 60.0, "next_probe_in_secs": None}


def test_open_refuses_until_the_cool_down_has_passed_with_the_wait():
    breaker = tripped(now=100.0)
    assert breaker.state == "open" and breaker.reason == "it failed 3 times"
    admission = breaker.admit(130.0)
    assert admission == Admission(Verdict.COOLING, wait=30.0) and admission.refused and admission.ticket is None
    assert breaker.state == "open"  # a refusal changes nothing
    assert breaker.wait(130.0) == 30.0
    assert breaker.view(130.0) == {"state": "open", "cool_down_secs": 60.0, "next_probe_in_secs": 30.0}


def test_the_listed_wait_is_rounded_up_so_it_reads_0_only_once_a_request_may_probe():
    breaker = tripped(now=100.0)
    assert breaker.view(159.99)["next_probe_in_secs"] == 0.1
    assert breaker.view(160.0)["next_probe_in_secs"] == 0
    assert breaker.view(500.0)["next_probe_in_secs"] == 0  # long past: still 0, never negative
    assert breaker.wait(500.0) == 0.0


def test_the_first_request_after_the_cool_down_is_the_probe_and_the_breaker_is_half_open():
    breaker = tripped(now=100.0)
    ticket = probing(breaker, 160.0)  # exactly at the end of the cool-down
    assert breaker.state == "half_open" and breaker.is_probe(ticket)
    assert breaker.view(161.0) == {"state": "half_open", "cool_down_secs": 60.0, "next_probe_in_secs": None}
    assert breaker.wait(161.0) == 0.0


def test_half_open_refuses_everyone_else_while_the_probe_runs():
    breaker = tripped(now=100.0)
    ticket = probing(breaker, 200.0)
    for now in (200.0, 10_000.0):  # however long it runs
        admission = breaker.admit(now)
        assert admission == Admission(Verdict.PROBING) and admission.refused and admission.wait == 0.0
    assert breaker.is_probe(ticket)


def test_a_probe_that_fails_reopens_with_the_cool_down_doubled_up_to_the_max():
    breaker = tripped(now=0.0, cool_down=60.0, max_cool_down=200.0)
    now, expected = 0.0, [120.0, 200.0, 200.0]  # 60 -> 120 -> 240 capped at 200 -> stays 200
    for cool_down in expected:
        now += breaker.cool_down
        ticket = probing(breaker, now)
        assert breaker.failed(now + 1, "failed again on the probe")
        assert breaker.state == "open" and breaker.cool_down == cool_down
        assert breaker.reason == "failed again on the probe"
        assert not breaker.is_probe(ticket)
        assert breaker.admit(now + 1) == Admission(Verdict.COOLING, wait=cool_down)
        now += 1


def test_a_failed_probe_without_a_new_reason_keeps_the_old_one():
    breaker = tripped(now=0.0)
    probing(breaker, 60.0)
    assert breaker.failed(61.0)
    assert breaker.reason == "it failed 3 times"


def test_failed_moves_nothing_unless_a_probe_is_running():
    closed = Breaker(60.0, max_cool_down=900.0)
    assert not closed.failed(1.0, "late") and closed.state == "closed" and closed.reason == ""
    breaker = tripped(now=100.0)
    assert not breaker.failed(110.0, "a request sent before it opened failed late")
    assert breaker.state == "open" and breaker.cool_down == 60.0 and breaker.wait(110.0) == 50.0
    assert breaker.reason == "it failed 3 times"


def test_a_probe_that_ends_without_a_verdict_lets_the_next_request_probe():
    breaker = tripped(now=100.0)
    ticket = probing(breaker, 170.0)
    assert breaker.ended(175.0)
    assert breaker.state == "open" and breaker.cool_down == 60.0 and not breaker.is_probe(ticket)
    assert breaker.wait(175.0) == 0.0 and breaker.view(175.0)["next_probe_in_secs"] == 0
    second = probing(breaker, 175.0)  # at once, no new cool-down
    assert second != ticket and breaker.is_probe(second)


def test_ended_moves_nothing_unless_a_probe_is_running():
    closed = Breaker(60.0, max_cool_down=900.0)
    assert not closed.ended(1.0) and closed.state == "closed"
    breaker = tripped(now=100.0)
    assert not breaker.ended(110.0)
    assert breaker.wait(110.0) == 50.0  # still cooling: the cool-down was not cut short


@pytest.mark.parametrize("state", ["open", "half_open", "closed"])
def test_a_clean_answer_closes_it_from_any_state_and_the_cool_down_starts_over(state: str):
    breaker = tripped(now=0.0)
    probing(breaker, 60.0)
    breaker.failed(60.0)  # cool-down 120 now
    if state == "half_open":
        probing(breaker, 180.0)
    elif state == "closed":
        breaker.reset()
    assert breaker.state == state
    assert breaker.succeeded() is (state != "closed")
    assert breaker.state == "closed" and breaker.cool_down == 60.0
    assert breaker.admit(181.0) == Admission(Verdict.PASS)


@pytest.mark.parametrize("state", ["open", "half_open"])
def test_reset_closes_it_and_forgets_the_probe(state: str):
    breaker = tripped(now=0.0)
    ticket = probing(breaker, 60.0)
    breaker.failed(60.0)
    if state == "half_open":
        ticket = probing(breaker, 180.0)
    breaker.reset()
    assert breaker.state == "closed" and breaker.cool_down == 60.0 and not breaker.is_probe(ticket)
    assert breaker.admit(181.0) == Admission(Verdict.PASS)
    assert not breaker.failed(182.0) and breaker.state == "closed"  # the old probe's late failure moves nothing


def test_tripping_again_starts_at_the_base_cool_down():
    breaker = tripped(now=0.0)
    probing(breaker, 60.0)
    breaker.failed(60.0)
    breaker.succeeded()
    breaker.open(1000.0, "failed 3 more times")
    assert breaker.state == "open" and breaker.cool_down == 60.0 and breaker.reason == "failed 3 more times"
    assert breaker.admit(1000.0) == Admission(Verdict.COOLING, wait=60.0)


def test_only_the_running_probe_is_the_probe():
    breaker = tripped(now=0.0)
    assert not breaker.is_probe(None)
    first = probing(breaker, 60.0)
    assert not breaker.is_probe(None) and not breaker.is_probe(first + 1)
    breaker.failed(61.0)
    second = probing(breaker, 181.0)
    assert second != first and breaker.is_probe(second) and not breaker.is_probe(first)
    breaker.succeeded()
    assert not breaker.is_probe(second)  # closed: there is no probe
    breaker.open(200.0, "again")
    third = probing(breaker, 260.0)
    assert third not in (first, second)  # tickets are never handed out twice


def test_a_zero_cool_down_lets_the_very_next_request_probe():
    breaker = tripped(now=5.0, cool_down=0.0)
    assert breaker.view(5.0) == {"state": "open", "cool_down_secs": 0.0, "next_probe_in_secs": 0}
    probing(breaker, 5.0)
    assert breaker.failed(5.0) and breaker.cool_down == 0.0  # doubling nothing stays nothing
    probing(breaker, 5.0)


# ------------------------------------------------------------ the remote peer's breaker


def peer(cooldown_secs: float = 10.0) -> RemotePeer:
    return RemotePeer(RemoteEntry(name="attic", url="http://127.0.0.1:9", kind="ollama"), cooldown_secs=cooldown_secs)


def submit(remote: RemotePeer, path: str = "/v1/chat/completions"):
    call = UpstreamCall(method="POST", path=path, body=b"{}", stream=False, content_type="application/json")
    return remote._submit(RemoteSubmit(reply=None, call=call, model="m", headers=(), on_usage=None))


def fail(remote: RemotePeer, breaker_probe: int | None = None) -> None:
    remote._outcome(_Outcome(reply=None, ok=False, error="attic did not accept a connection", probe=False,
                             breaker_probe=breaker_probe))


async def test_a_peer_breaker_opens_after_three_failures_in_a_row_and_a_late_failure_does_not_stretch_it(
        autojump_clock):
    remote = peer()
    fail(remote)
    fail(remote)
    # an answer: the count starts over
    remote._outcome(_Outcome(reply=None, ok=True, error="", probe=False, breaker_probe=None))
    assert remote.failures == 0 and remote.describe()["breaker"] == "closed"
    for _ in range(3):
        fail(remote)
    row = remote.describe()
    assert row["breaker"] == "open" and row["breaker_probe_in_secs"] == 10.0 and row["failures_in_a_row"] == 3
    refused = submit(remote)
    assert refused.code == "remote_breaker_open" and refused.status == 503 and refused.retry_after == 10.0
    assert "after 3 failures in a row" in refused.message and "the next request after 10s probes it" in refused.message
    await trio.sleep(4)
    fail(remote)  # a request sent before it opened fails late: counted, but the cool-down stays as it was
    row = remote.describe()
    assert row["failures_in_a_row"] == 4 and row["breaker"] == "open" and row["breaker_probe_in_secs"] == 6.0


async def test_a_peer_probe_on_a_route_the_peer_does_not_serve_lets_the_next_request_probe(autojump_clock):
    remote = peer()
    for _ in range(3):
        fail(remote)
    await trio.sleep(10)
    assert remote.describe()["breaker"] == "half_open"  # listed half-open: the next request probes
    for _ in range(2):  # it never left: not "being probed" for ever after
        unserved = submit(remote, "/completion")
        assert unserved.code == "remote_route_unserved" and unserved.status == 400
    assert remote.describe()["breaker"] == "half_open"
    assert remote.breaker.admit(trio.current_time()).verdict is Verdict.PROBE


async def test_only_the_peer_probes_failure_doubles_the_cooldown_and_an_answer_closes_it(autojump_clock):
    remote = peer()
    for _ in range(3):
        fail(remote)
    await trio.sleep(10)
    ticket = remote.breaker.admit(trio.current_time()).ticket  # what _submit hands the probe's relay
    refused = submit(remote)
    assert refused.code == "remote_breaker_open" and "is being probed after failing" in refused.message
    assert refused.retry_after == 1.0 and remote.describe()["breaker"] == "half_open"
    fail(remote)  # not the probe: the probe still runs
    assert remote.breaker.is_probe(ticket) and remote.failures == 4
    fail(remote, breaker_probe=ticket)
    row = remote.describe()
    assert row["breaker"] == "open" and row["breaker_probe_in_secs"] == 20.0  # doubled
    await trio.sleep(20)
    ticket = remote.breaker.admit(trio.current_time()).ticket
    remote._outcome(_Outcome(reply=None, ok=True, error="", probe=False, breaker_probe=ticket))
    row = remote.describe()
    assert row["breaker"] == "closed" and row["failures_in_a_row"] == 0 and "breaker_probe_in_secs" not in row
    assert remote.breaker.cool_down == 10.0  # starts over
