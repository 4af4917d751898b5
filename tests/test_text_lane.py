"""The text lane against a real llama-server on SmolLM2: spawn on demand, buffered and streamed
chat, embeddings, tokenize, idle and LRU eviction, admission order, 503 on expiry, withdrawal."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from blazar.config import ModelSettings
from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, pid_alive, ps, register_engine

pytestmark = pytest.mark.engine


@pytest.fixture
def lane_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


async def gateway_with(nursery, home, **overrides):
    return await start_gateway(nursery, home, **overrides)


async def test_first_request_spawns_a_child_and_chat_answers(nursery, lane_home, shared_engine):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            assert await ps(client) == []
            response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=16))
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["object"] == "chat.completion" and body["model"] == "smollm2:135m"
            assert body["choices"][0]["message"]["content"].strip()
            assert body["usage"]["completion_tokens"] > 0
            (row,) = await ps(client)
            assert row["state"] == "ready" and row["engine"] == shared_engine.tag
            assert pid_alive(row["pid"])
            assert (lane_home.run / "children" / f"{row['pid']}.json").exists()
        events = await gateway.services.ledger.recent_events(kind="spawn")
        assert events and events[0]["model"] == "smollm2:135m"


async def test_streamed_chat_arrives_as_it_is_generated(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))  # warm
            arrivals, pieces = [], []
            async with client.stream("POST", "/v1/chat/completions",
                                     json=chat_body(text="Count from one to twenty.", stream=True, max_tokens=40,
                                                    temperature=0, ignore_eos=True)
                                     ) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        arrivals.append(trio.current_time())
                        pieces.append(line[6:])
    assert pieces[-1] == "[DONE]"
    events = [json.loads(p) for p in pieces[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert len(events) > 10 and text.strip()
    # Relayed as produced: the first token came well before the last.
    assert arrivals[-1] - arrivals[0] > 0.1


async def test_embeddings_and_a_tokenize_round_trip(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            embedded = await client.post("/v1/embeddings", json={"model": "smollm2", "input": ["hello", "world"]})
            assert embedded.status_code == 200, embedded.text
            vectors = [d["embedding"] for d in embedded.json()["data"]]
            assert len(vectors) == 2 and len(vectors[0]) == 576 and vectors[0] != vectors[1]
            tokens = (await client.post("/tokenize", json={"content": "The quick brown fox"})).json()["tokens"]
            assert tokens
            text = (await client.post("/detokenize", json={"tokens": tokens})).json()["content"]
            assert text.strip() == "The quick brown fox"
            counted = await client.post("/v1/chat/completions/input_tokens", json=chat_body(text="The quick brown fox"))
            assert counted.json()["input_tokens"] > len(tokens)


async def test_idle_model_is_evicted_and_its_child_reaped(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home, keep_alive="1s")
    with trio.fail_after(60):
        async with gateway.client() as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            (row,) = await ps(client)
            while await ps(client):  # noqa: ASYNC110 - polling the HTTP API as a user would
                await trio.sleep(0.1)
        assert not pid_alive(row["pid"])
        assert not list((lane_home.run / "children").glob("*.json"))
        assert await gateway.services.ledger.recent_events(kind="evict")


async def test_a_model_with_a_request_in_flight_is_never_evicted(nursery, lane_home, shared_home):
    """keep_alive 0.3 s and room for one resident: a stream that lasts several keep-alives is served to its end
    by one child that stays busy throughout (never ready, draining or replaced); a request for another model
    meanwhile is refused (503 all_models_busy) instead of evicting it. Once idle, the same keep-alive does
    evict it: the keep-alive was live all along, only the request in flight held it off."""
    add_shared_model(lane_home, shared_home, name="second:1")
    gateway = await gateway_with(nursery, lane_home, keep_alive="0.3s", max_resident_models=1)
    with trio.fail_after(180):
        async with gateway.client(timeout=60) as client, gateway.client(timeout=60) as other:
            seen, frames, refused = [], [], []

            async def ask_for_another_model():
                refused.append(await other.post("/v1/chat/completions", json=chat_body("second:1", max_tokens=1)))

            # No warm-up request: an idle gap before the stream would let the 0.3 s keep-alive evict the child.
            async with trio.open_nursery() as requests, client.stream(
                    "POST", "/v1/chat/completions", json=chat_body(
                        text="Write a long story about a dragon.", stream=True, max_tokens=200, temperature=0,
                        ignore_eos=True)) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    frames.append((trio.current_time(), line[6:]))
                    if len(frames) == 5:
                        requests.start_soon(ask_for_another_model)
                    if len(frames) % 3 == 1 and line[6:] != "[DONE]":
                        seen.extend((row["model"], row["state"], row["pid"]) for row in await ps(other))
            lasted = frames[-1][0] - frames[0][0]
            assert lasted > 1.2, f"the stream lasted {lasted:.1f}s: not four times the 0.3 s keep-alive"
            assert frames[-1][1] == "[DONE]"
            assert json.loads(frames[-2][1])["choices"][0]["finish_reason"] == "length"  # all 200 tokens came
            [refusal] = refused
            assert refusal.status_code == 503, refusal.text
            assert "every one is busy" in refusal.json()["error"]["message"]
            assert len({(model, pid) for model, _, pid in seen}) == 1, seen  # one child, never replaced
            states = [state for _, state, _ in seen]
            # Busy while the engine generates; ready only once it is done and the last buffered chunks are still
            # on their way to this client. Never draining or stopping.
            assert states.count("busy") > 10 and states[0] == "busy", states
            assert states == ["busy"] * states.count("busy") + ["ready"] * states.count("ready"), states

            while await ps(client):  # noqa: ASYNC110 - idle now: the keep-alive evicts it
                await trio.sleep(0.05)
            assert not pid_alive(seen[0][2])
        [evicted] = await gateway.services.ledger.recent_events(kind="evict")
        assert evicted["model"] == "smollm2:135m" and "idle keep_alive" in evicted["detail"]


async def test_the_least_recently_used_idle_model_is_evicted_at_the_cap(nursery, lane_home, shared_home):
    add_shared_model(lane_home, shared_home, name="second:1")
    gateway = await gateway_with(nursery, lane_home, max_resident_models=1)
    with trio.fail_after(90):
        async with gateway.client() as client:
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            (first,) = await ps(client)
            assert (await client.post("/v1/chat/completions", json=chat_body("second:1", max_tokens=1))
                    ).status_code == 200
            rows = await ps(client)
            assert [r["model"] for r in rows] == ["second:1"]
            assert not pid_alive(first["pid"])
        evictions = await gateway.services.ledger.recent_events(kind="evict")
        assert evictions[0]["model"] == "smollm2:135m" and "resident cap" in evictions[0]["detail"]


async def until_resident(client, test) -> None:
    """Poll /api/ps until `test(row)` holds: the next step must not race the machine's load."""
    while not ((rows := await ps(client)) and test(rows[0])):  # noqa: ASYNC110 - polling the API a user sees
        await trio.sleep(0.02)


def one_slot(**extra):
    return {"models": {"smollm2:135m": ModelSettings(parallel=1)}, **extra}


async def _long_request(client, done, name):
    response = await client.post("/v1/chat/completions", json=chat_body(
        text="Tell a long story.", max_tokens=120, temperature=0, ignore_eos=True))
    done.append((name, response.status_code))


async def test_high_priority_overtakes_low_in_a_saturated_queue(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home, **one_slot())
    done: list = []
    with trio.fail_after(90):
        async with gateway.client(timeout=60) as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))

            async def tagged(name, priority):
                response = await client.post("/v1/chat/completions", headers={"X-Blazar-Priority": priority},
                                             json=chat_body(text=f"Say {name}.", max_tokens=4))
                done.append((name, response.status_code))

            async with trio.open_nursery() as requests:
                requests.start_soon(_long_request, client, done, "blocker")
                await until_resident(client, lambda row: row["in_flight"] == 1)
                requests.start_soon(tagged, "low", "LOW")
                await until_resident(client, lambda row: row["queued"] == 1)
                requests.start_soon(tagged, "high", "High")
    assert done == [("blocker", 200), ("high", 200), ("low", 200)]


async def test_a_request_that_waits_too_long_gets_503_all_slots_busy(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home, **one_slot(queue_wait_secs=0.5))
    done: list = []
    with trio.fail_after(90):
        async with gateway.client(timeout=60) as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            async with trio.open_nursery() as requests:
                requests.start_soon(_long_request, client, done, "blocker")
                await until_resident(client, lambda row: row["in_flight"] == 1)
                refused = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "all_slots_busy" or error["code"] == "all_slots_busy"
    assert "X-Blazar-Priority" in error["message"] and "parallel" in error["message"]
    assert done == [("blocker", 200)]


async def test_a_client_that_leaves_the_queue_frees_its_place_at_once(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home, **one_slot())
    done: list = []
    with trio.fail_after(90):
        async with gateway.client(timeout=60) as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            async with trio.open_nursery() as requests:
                requests.start_soon(_long_request, client, done, "blocker")
                await until_resident(client, lambda row: row["in_flight"] == 1)
                leaving = trio.CancelScope()

                async def leaver():
                    with leaving:
                        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as other:
                            await other.post("/v1/chat/completions", json=chat_body(max_tokens=4))

                requests.start_soon(leaver)
                await until_resident(client, lambda row: row["queued"] == 1)
                leaving.cancel()  # the client hangs up while queued
                with trio.fail_after(2):
                    await until_resident(client, lambda row: row["queued"] == 0)
                assert done == []  # the blocker is still running: the queue emptied because the client left


async def test_bad_input_is_refused_before_admission(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            for body, needle in ((chat_body(n=9), "`n` must be an integer from 1 to 8"),
                                 (chat_body(n=3), "serves at most 2 choices"),
                                 ({"messages": [{"role": "user", "content": "x"}]}, "`model` is required"),
                                 (chat_body(messages=[]), "`messages` must be a non-empty array")):
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 400, body
                assert needle in response.json()["error"]["message"]
            unknown = await client.post("/v1/chat/completions", json=chat_body("llama3:70b"))
            assert unknown.status_code == 404 and "blazar pull" in unknown.json()["error"]["message"]
            broken = await client.post("/v1/chat/completions", content=b"{not json")
            assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
            assert await ps(client) == []  # nothing was spawned for any of them


async def test_num_ctx_header_restarts_the_model_once(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(90):
        async with gateway.client() as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            (before,) = await ps(client)
            assert before["context"] == 4096
            headers = {"X-Blazar-Num-Ctx": "2048"}
            assert (await client.post("/v1/chat/completions", headers=headers, json=chat_body(max_tokens=1))
                    ).status_code == 200
            rows = [r for r in await ps(client) if r["state"] != "stopped"]
            live = [r for r in rows if r["state"] in ("ready", "busy")]
            assert [(r["context"], r["context_source"]) for r in live] == [(2048, "request header X-Blazar-Num-Ctx")]
            again = await client.post("/v1/chat/completions", headers=headers, json=chat_body(max_tokens=1))
            assert again.status_code == 200
            assert [r["pid"] for r in await ps(client) if r["state"] in ("ready", "busy")] == [live[0]["pid"]]
            assert not pid_alive(before["pid"])
            bad = await client.post("/v1/chat/completions", headers={"X-Blazar-Num-Ctx": "lots"}, json=chat_body())
            assert bad.status_code == 400 and "X-Blazar-Num-Ctx" in bad.json()["error"]["message"]


async def test_native_routes_resolve_their_target(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            cold = await client.post("/tokenize", json={"content": "hi"})
            assert cold.status_code == 400 and "X-Blazar-Model" in cold.json()["error"]["message"]
            completion = await client.post("/completion", headers={"X-Blazar-Model": "smollm2"},
                                           json={"prompt": "The sky is", "n_predict": 4})
            assert completion.status_code == 200 and completion.json()["content"]
            applied = await client.post("/apply-template", params={"model": "smollm2:135m"},
                                        json={"messages": [{"role": "user", "content": "hi"}]})
            assert "hi" in applied.json()["prompt"]
            props = (await client.get("/props")).json()  # the single hot child
            assert props["default_generation_settings"]["n_ctx"] == 4096
            assert (await client.get("/slots")).status_code == 200
            bad = await client.post("/slots/0", params={"action": "explode"})
            assert bad.status_code == 400 and "save, restore or erase" in bad.json()["error"]["message"]
            legacy = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "One, two,",
                                                                 "max_tokens": 3})
            assert legacy.status_code == 200 and legacy.json()["choices"][0]["text"]
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["resident"], m["engine"]) for m in listed] == [
                ("smollm2:135m", "ready", listed[0]["engine"])]


async def test_the_ram_budget_evicts_to_make_room(nursery, lane_home, shared_home):
    add_shared_model(lane_home, shared_home, name="second:1")
    gateway = await gateway_with(nursery, lane_home, ram_budget_mib=150)  # room for one 94 MiB model
    with trio.fail_after(90):
        async with gateway.client() as client:
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            assert (await client.post("/v1/chat/completions", json=chat_body("second:1", max_tokens=1))
                    ).status_code == 200
            assert [r["model"] for r in await ps(client)] == ["second:1"]


async def test_a_model_larger_than_the_ram_budget_is_refused(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home, ram_budget_mib=10)
    with trio.fail_after(30):
        async with gateway.client() as client:
            response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 507 and "ram_budget_mib" in response.json()["error"]["message"]


async def test_think_blocks_from_the_real_engine_are_stripped_unless_asked_for(nursery, lane_home):
    # A GBNF grammar makes the real engine emit a think block, whatever the model would have said.
    forced = {"grammar": 'root ::= "<think>secret plan</think>Hello there"', "max_tokens": 40, "temperature": 0}
    gateway = await gateway_with(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            plain = await client.post("/v1/chat/completions", json=chat_body(**forced))
            assert plain.json()["choices"][0]["message"]["content"] == "Hello there"
            assert plain.headers["x-blazar-structured-output"] == "gbnf"
            pieces = []
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **forced)) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices") or []:
                            pieces.append((choice.get("delta") or {}).get("content") or "")
            assert "".join(pieces) == "Hello there"
            asked = await client.post("/v1/chat/completions", json=chat_body(think=True, **forced))
            assert asked.json()["choices"][0]["message"]["content"] == "<think>secret plan</think>Hello there"


async def test_json_mode_is_passed_to_the_engine_with_a_receipt(nursery, lane_home):
    gateway = await gateway_with(nursery, lane_home)
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    with trio.fail_after(60):
        async with gateway.client() as client:
            response = await client.post("/v1/chat/completions", json=chat_body(
                text="Name a colour as JSON.", max_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}))
    assert response.headers["x-blazar-structured-output"] == "json_schema"
    assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"])["colour"], str)


async def test_the_real_engine_takes_ollama_spawn_options_and_a_reasoning_budget(nursery, lane_home):
    """The flags the llama.cpp lane maps settings to are ones this llama-server really accepts."""
    gateway = await gateway_with(nursery, lane_home, models={"smollm2:135m": ModelSettings(reasoning_budget=0)})
    with trio.fail_after(90):
        async with gateway.client() as client:
            answer = await client.post("/api/chat", json={
                "model": "smollm2:135m", "stream": False, "options": {"num_thread": 1, "num_batch": 64,
                                                                      "num_predict": 4},
                "messages": [{"role": "user", "content": "Say hi."}]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["message"]["content"]
            card = (await client.get("/api/explain/smollm2:135m")).json()
            assert card["resident"]["state"] in ("ready", "busy")
            flags = card["flags"]
            assert flags[flags.index("--reasoning-budget") + 1] == "0"
            # The resident child runs with the asked spawn options (explain plans a request without them).
            [row] = await ps(client)
            assert row["pid"] and pid_alive(row["pid"])
            with open(f"/proc/{row['pid']}/cmdline", "rb") as handle:  # noqa: ASYNC230 - procfs, instant
                argv = handle.read().split(b"\0")
            assert argv[argv.index(b"--threads") + 1] == b"1" and argv[argv.index(b"--batch-size") + 1] == b"64"
