"""Request cards on a real llama-server: listing, cancel and interrupt from another connection,
singleflight, metadata cards, and the memory floor."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, ps, register_engine

pytestmark = pytest.mark.engine

LONG = {"text": "Write a very long story about the sea.", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def lane_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


async def _running_card(client) -> dict:
    while True:
        rows = (await client.get("/v1/requests", params={"state": "running"})).json()["data"]
        if rows and rows[0]["partial"]:
            return rows[0]
        await trio.sleep(0.05)


@pytest.mark.parametrize("kind", ["cancel", "interrupt"])
async def test_a_stream_is_stopped_from_another_connection(nursery, lane_home, kind):
    gateway = await start_gateway(nursery, lane_home)
    frames: list[str] = []
    with trio.fail_after(60):
        async with gateway.client() as client, gateway.client() as operator:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))

            async def stream():
                async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            frames.append(line[6:])

            async with trio.open_nursery() as inner:
                inner.start_soon(stream)
                card = await _running_card(operator)
                assert card["trace_id"].startswith("plm-") and card["model"] == "smollm2:135m"
                signalled = await operator.post(f"/v1/requests/{card['id']}/{kind}")
                assert signalled.status_code == 200 and signalled.json()["signal"] == kind
            final = (await operator.get(f"/v1/requests/{card['id']}")).json()
            # The engine notices the closed connection at its next token: wait until it has (the test's
            # deadline bounds it; an engine that kept generating would run into it).
            while any(slot.get("is_processing") for slot in (await operator.get("/slots")).json()):  # noqa: ASYNC110
                await trio.sleep(0.05)
            [row] = await ps(operator)
            async with httpx.AsyncClient() as direct:  # the engine's own count of what it generated
                metrics = (await direct.get(f"http://127.0.0.1:{row['port']}/metrics")).text
            generated = next(float(line.split()[-1]) for line in metrics.splitlines()
                             if line.startswith("llamacpp:tokens_predicted_total"))
    assert frames[-1] == "[DONE]"
    assert len(frames) < 300  # generation stopped long before max_tokens
    last = json.loads(frames[-2])
    if kind == "cancel":
        assert last["error"]["code"] == 499 and final["state"] == "cancelled"
    else:
        assert last["blazar_interrupted"] is True and last["choices"][0]["finish_reason"] == "stop"
        assert final["state"] == "interrupted" and final["partial"].strip()
    assert generated < 300  # the engine stopped generating long before its 400 tokens


async def test_a_buffered_request_can_be_cancelled_but_not_interrupted(nursery, lane_home):
    gateway = await start_gateway(nursery, lane_home)
    outcome = {}
    with trio.fail_after(60):
        async with gateway.client() as client, gateway.client() as operator:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))

            async def buffered():
                outcome["response"] = await client.post("/v1/chat/completions", json=chat_body(**LONG))

            async with trio.open_nursery() as inner:
                inner.start_soon(buffered)
                while not (rows := (await operator.get("/v1/requests", params={"state": "queued"})).json()[  # noqa: ASYNC110
                        "data"]):
                    await trio.sleep(0.05)
                card_id = rows[0]["id"]
                refused = await operator.post(f"/v1/requests/{card_id}/interrupt")
                assert refused.status_code == 409 and "cancel" in refused.json()["error"]["message"]
                assert (await operator.post(f"/v1/requests/{card_id}/cancel")).status_code == 200
            assert outcome["response"].status_code == 499
            assert outcome["response"].json()["error"]["type"] == "request_cancelled"
            assert (await operator.get(f"/v1/requests/{card_id}")).json()["state"] == "cancelled"
            assert (await operator.post(f"/v1/requests/{card_id}/cancel")).status_code == 409
            missing = await operator.get("/v1/requests/req_nope")
            assert missing.status_code == 404 and "/v1/requests" in missing.json()["error"]["message"]


SAME_QUESTION = {
    "/v1/chat/completions": chat_body(text="Name three colours.", max_tokens=40, temperature=0.9, seed=-1),
    "/api/chat": {"model": "smollm2:135m", "stream": False, "options": {"num_predict": 40, "temperature": 0.9},
                  "messages": [{"role": "user", "content": "Name three colours."}]},
}


@pytest.mark.parametrize("route", list(SAME_QUESTION))
async def test_identical_concurrent_requests_share_one_upstream_call(nursery, lane_home, route):
    gateway = await start_gateway(nursery, lane_home)
    answers = []
    with trio.fail_after(60):
        async with gateway.client() as client:
            await client.post("/api/generate", json={"model": "smollm2:135m"})  # loads it; no card
            served_before = (await ps(client))[0]["served"]

            async def ask():
                answers.append((await client.post(route, json=SAME_QUESTION[route])).json())

            async with trio.open_nursery() as inner:
                inner.start_soon(ask)
                inner.start_soon(ask)
            assert (await ps(client))[0]["served"] == served_before + 1
            cards = (await client.get("/v1/requests", params={"state": "done"})).json()["data"]
            assert sum(card["route"] == route for card in cards) == 2  # two cards, one engine call
    text = [a["choices"][0]["message"] if route.startswith("/v1") else a["message"] for a in answers]
    assert text[0] == text[1] and text[0]["content"]


async def test_metadata_cards_can_be_updated_after_the_fact(nursery, lane_home):
    gateway = await start_gateway(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            created = (await client.post("/v1/chat/completions", json=chat_body(
                max_tokens=2, metadata={"ticket": "T-1"}))).json()
            updated = await client.post(f"/v1/chat/completions/{created['id']}", json={"metadata": {"ticket": "T-2"}})
            assert updated.status_code == 200
            assert updated.json() == {"id": created["id"], "object": "chat.completion", "created": created["created"],
                                      "model": "smollm2:135m", "metadata": {"ticket": "T-2"}}
            plain = (await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))).json()
            missing = await client.post(f"/v1/chat/completions/{plain['id']}", json={"metadata": {}})
            assert missing.status_code == 404 and "metadata" in missing.json()["error"]["message"]
            too_many = await client.post("/v1/chat/completions", json=chat_body(
                metadata={f"k{i}": "v" for i in range(17)}))
            assert too_many.status_code == 400 and "at most 16" in too_many.json()["error"]["message"]


async def test_the_memory_floor_refuses_a_spawn_with_507(nursery, lane_home):
    gateway = await start_gateway(nursery, lane_home, spawn_mem_floor_mib=10**8)
    with trio.fail_after(30):
        async with gateway.client() as client:
            response = await client.post("/v1/chat/completions", json=chat_body())
            assert response.status_code == 507
            message = response.json()["error"]["message"]
            assert "MemAvailable" in message and "spawn_mem_floor_mib 0" in message
            assert await ps(client) == []


async def test_a_buffered_client_that_hangs_up_frees_its_slot(nursery, lane_home):
    """The gateway drops the request and closes its upstream connection at once. (llama-server
    b11434 still finishes a buffered answer it started: it only notices closed connections on
    streams, which the cancel/interrupt test above shows stopping.)"""
    gateway = await start_gateway(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            leaving = trio.CancelScope()

            async def impatient():
                with leaving:
                    async with gateway.client() as other:
                        await other.post("/v1/chat/completions", json=chat_body(**LONG))

            async with trio.open_nursery() as inner:
                inner.start_soon(impatient)
                # Until the engine itself is decoding it (the gateway's in_flight rises before the request
                # reaches the child).
                while not any(s.get("is_processing") for s in (await client.get("/slots")).json()):  # noqa: ASYNC110
                    await trio.sleep(0.02)
                leaving.cancel()  # the client hangs up mid-answer
            while (await ps(client))[0]["in_flight"]:  # noqa: ASYNC110 - the slot is freed without the answer
                await trio.sleep(0.02)
            # Freed at once, not when the engine is done: the engine is still writing the abandoned answer.
            assert any(slot.get("is_processing") for slot in (await client.get("/slots")).json())
            states = [c["state"] for c in (await client.get("/v1/requests")).json()["data"]]
            assert "disconnected" in states


@pytest.mark.parametrize(("route", "kind"), [("/api/chat", "cancel"), ("/v1/messages", "interrupt"),
                                             ("/v1/completions", "cancel")])
async def test_every_dialects_streams_have_cards_and_can_be_stopped(nursery, lane_home, route, kind):
    """The request-session helper covers every dialect: a card with the streamed text, and a stop from
    another connection that ends the stream in the dialect's own shape."""
    gateway = await start_gateway(nursery, lane_home)
    lines: list[str] = []
    messages = [{"role": "user", "content": LONG["text"]}]
    body = {"/api/chat": {"model": "smollm2:135m", "messages": messages,
                          "options": {"num_predict": 400, "temperature": 0}},
            "/v1/messages": {"model": "smollm2:135m", "messages": messages, "max_tokens": 400, "stream": True,
                             "temperature": 0},
            "/v1/completions": {"model": "smollm2:135m", "prompt": LONG["text"], "max_tokens": 400, "stream": True,
                                "temperature": 0, "ignore_eos": True}}[route]
    with trio.fail_after(60):
        async with gateway.client() as client, gateway.client() as operator:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))

            async def stream():
                async with client.stream("POST", route, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.strip():
                            lines.append(line)

            async with trio.open_nursery() as inner:
                inner.start_soon(stream)
                card = await _running_card(operator)
                assert card["route"] == route and card["stream"] is True
                assert (await operator.post(f"/v1/requests/{card['id']}/{kind}")).status_code == 200
            final = (await operator.get(f"/v1/requests/{card['id']}")).json()
    assert final["state"] == ("cancelled" if kind == "cancel" else "interrupted") and final["partial"].strip()
    if route == "/api/chat":
        assert "cancelled from another connection" in json.loads(lines[-1])["error"]
        assert len(lines) < 300
    elif route == "/v1/completions":
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 499
    else:
        assert lines[-1] == "data: {\"type\":\"message_stop\"}" or "message_stop" in lines[-1]
