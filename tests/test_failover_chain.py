"""The failover actor's chain state under the autojump clock: benches expire, sticky chains stay where they
switched, non-sticky ones return to their first target, a pin holds, and every target benched still leaves
an order to try (soonest back first)."""

from __future__ import annotations

from functools import partial

import trio

from blazar.config import FailoverEntry
from supervisors.actor import supervise
from supervisors.failover import FailoverActor, FailoverClient

TARGETS = ["remote:den:qwen3:8b", "local:smollm2:135m", "remote:attic:smollm2:135m"]


async def chains(nursery, **entry) -> FailoverClient:
    entries = [FailoverEntry(name="chat", alias="chat-any", targets=TARGETS, bench_secs=60, **entry)]
    return FailoverClient(await nursery.start(partial(supervise, lambda: FailoverActor(entries))), entries)


async def order(client: FailoverClient) -> list[int]:
    return (await client.plan("chat"))["order"]


async def test_a_failed_target_is_benched_until_its_time_is_up(nursery, autojump_clock):
    client = await chains(nursery)
    assert await order(client) == [0, 1, 2]
    await client.report("chat", 0, False, "connect refused")
    await client.report("chat", 1, True)
    assert await order(client) == [1, 2]
    shown = await client.show("chat-any")
    assert shown["serving"] == "local:smollm2:135m" and shown["targets"][0]["last_failure"] == "connect refused"
    assert shown["history"][-1] | {"at": 0} == {"at": 0, "event": "switch", "from": TARGETS[0], "to": TARGETS[1],
                                                "reason": "connect refused"}
    await trio.sleep(61)
    assert await order(client) == [0, 1, 2]  # not sticky: the first target is tried first again
    await client.report("chat", 0, True)
    shown = await client.show("chat")
    assert shown["serving"] == TARGETS[0] and shown["history"][-1]["reason"] == "a preferred target answered again"


async def test_a_sticky_chain_stays_on_the_target_that_took_over(nursery, autojump_clock):
    client = await chains(nursery, sticky=True)
    await client.report("chat", 0, False, "503")
    await client.report("chat", 1, True)
    await trio.sleep(61)
    assert await order(client) == [1, 0, 2]
    await client.report("chat", 1, False, "crashed")
    assert await order(client) == [0, 2]


async def test_every_target_benched_still_leaves_an_order_soonest_back_first(nursery, autojump_clock):
    client = await chains(nursery)
    for index in (2, 0, 1):
        await client.report("chat", index, False, "down")
        await trio.sleep(1)
    assert await order(client) == [2, 0, 1]


async def test_a_pin_holds_through_failures_and_unpin_restores_the_order(nursery, autojump_clock):
    client = await chains(nursery)
    await client.pin("chat", 2)
    await client.report("chat", 2, False, "down")
    assert (await client.plan("chat")) == {"chain": "chat", "pinned": True, "order": [2]}
    shown = await client.pin("chat", None)
    assert shown["pinned"] is None and [h["event"] for h in shown["history"]] == ["pin", "unpin"]
    assert await order(client) == [0, 1]
