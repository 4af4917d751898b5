"""The HTTP spine on a real hypercorn (port 0): health, trace ids, manifest, teaching 404/405,
the body cap on chunked and declared bodies, CORS."""

from __future__ import annotations

import re

import pytest
import trio

from dialects.census import route_census
from tests.conftest import start_gateway


async def test_health_routes_answer_plain_ok(gateway):
    with trio.fail_after(10):
        async with gateway.client() as client:
            for path in ("/healthz", "/health"):
                response = await client.get(path)
                assert response.status_code == 200
                assert response.text == "ok"
                assert response.headers["content-type"].startswith("text/plain")


async def test_every_response_carries_a_trace_id_and_an_incoming_one_is_echoed(gateway):
    with trio.fail_after(10):
        async with gateway.client() as client:
            first = (await client.get("/healthz")).headers["x-blazar-trace-id"]
            second = (await client.get("/nowhere")).headers["x-blazar-trace-id"]
            assert re.fullmatch(r"plm-[0-9a-f]{8}-\d+", first)
            boot, seq = first.rsplit("-", 1)
            assert second == f"{boot}-{int(seq) + 1}"
            echoed = await client.get("/healthz", headers={"x-blazar-trace-id": "my-agent-42"})
            assert echoed.headers["x-blazar-trace-id"] == "my-agent-42"
            junk = await client.get("/healthz", headers={"x-blazar-trace-id": "bad id with spaces"})
            assert junk.headers["x-blazar-trace-id"].startswith(boot)


async def test_manifest_lists_exactly_the_routes_the_router_serves(gateway, nursery):
    with trio.fail_after(10):
        async with gateway.client() as client:
            manifest = (await client.get("/.well-known/blazar")).json()
        from dialects.app import create_app

        live = set(route_census(create_app(gateway.services)))
        listed = {(e["method"], e["path"]) for e in manifest["endpoints"]}
        assert listed == live
        assert manifest["endpoint_count"] == len(live)
        assert manifest["name"] == "blazar" and manifest["version"]
        assert sum(api["routes"] for api in manifest["apis"].values()) == len(live)
        assert "x-blazar-trace-id" in manifest["headers"]["response"]
        assert manifest["features"]["keys"] is False
        async with gateway.client() as client:
            for method, path in listed:
                if "{" not in path and method == "GET":
                    # Streams (/api/events, /api/watch) never end: the status line is the answer.
                    async with client.stream("GET", path) as response:
                        assert response.status_code != 404, path


@pytest.mark.parametrize(("method", "path", "shape"), [
    ("POST", "/v1/chat/completion", "openai"),
    ("GET", "/api/tag", "ollama"),
    ("POST", "/v1/messages/count", "anthropic"),
    ("GET", "/healthy", "openai"),
])
async def test_unknown_routes_get_a_teaching_404_in_the_dialects_shape(gateway, method, path, shape):
    with trio.fail_after(10):
        async with gateway.client() as client:
            response = await client.request(method, path)
    assert response.status_code == 404
    body = response.json()
    if shape == "ollama":
        message = body["error"]
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        message = body["error"]["message"]
    else:
        assert body["error"]["code"] == 404
        message = body["error"]["message"]
    assert f"no route {method} {path}" in message
    assert "/.well-known/blazar" in message


async def test_unknown_route_names_the_closest_existing_ones(gateway):
    with trio.fail_after(10):
        async with gateway.client() as client:
            body = (await client.get("/healthy")).json()
    assert "GET /healthz" in body["error"]["closest"]
    assert "GET /healthz" in body["error"]["message"]


async def test_wrong_method_is_a_405_naming_the_allowed_ones(gateway):
    with trio.fail_after(10):
        async with gateway.client() as client:
            response = await client.post("/healthz")
    assert response.status_code == 405
    assert "use GET" in response.json()["error"]["message"]


async def _chunks(total: int, size: int = 64 * 1024):
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


@pytest.fixture
async def small_cap_gateway(nursery, home, monkeypatch):
    monkeypatch.setenv("BLAZAR_TEST_HOOKS", "1")
    return await start_gateway(nursery, home, body_limit_mib=1)


async def test_chunked_body_over_the_cap_is_refused_with_a_teaching_413(small_cap_gateway):
    with trio.fail_after(20):
        async with small_cap_gateway.client() as client:
            response = await client.post("/__test__/slow?ms=0", content=_chunks(3 * 1024 * 1024))
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert "1 MiB" in message and "body_limit_mib" in message


async def test_declared_length_over_the_cap_is_refused_before_reading(small_cap_gateway):
    with trio.fail_after(20):
        async with small_cap_gateway.client() as client:
            response = await client.post("/api/anything", content=b"x" * (1024 * 1024 + 1))
    assert response.status_code == 413
    assert "body_limit_mib" in response.json()["error"]  # Ollama's shape on /api


async def test_chunked_body_under_the_cap_reaches_the_route_intact(small_cap_gateway):
    with trio.fail_after(20):
        async with small_cap_gateway.client() as client:
            response = await client.post("/__test__/slow?ms=0", content=_chunks(1024 * 1024, size=1000))
    assert response.status_code == 200
    assert response.json()["body_bytes"] == 1024 * 1024


async def test_serve_start_is_recorded_in_the_ledger(gateway):
    with trio.fail_after(10):
        # The start event was queued in the ledger's mailbox before this query: FIFO makes it visible.
        events = await gateway.services.ledger.recent_events(kind="serve_started")
    assert '"version"' in events[0]["detail"]



async def test_an_actor_that_does_not_answer_is_a_teaching_503_in_the_dialects_shape(gateway):
    """A route whose actor is gone answers 503 with Retry-After in its own dialect's shape, never a raw 500."""
    closed_send, closed_receive = trio.open_memory_channel(0)
    closed_receive.close()
    gateway.services.requests.mailbox = closed_send  # the request registry has stopped
    chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(10):
        async with gateway.client() as client:
            openai = await client.post("/v1/chat/completions", json=chat)
            ollama = await client.post("/api/chat", json={**chat, "stream": False})
            anthropic = await client.post("/v1/messages", json={**chat, "max_tokens": 8})
            cards = await client.get("/v1/requests")
    for response in (openai, ollama, anthropic, cards):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
    assert "retry in a moment" in openai.json()["error"]["message"]
    assert openai.json()["error"]["type"] == "all_slots_busy"
    assert "retry in a moment" in ollama.json()["error"]
    assert anthropic.json()["error"]["type"] == "overloaded_error"
