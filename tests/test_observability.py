"""Observability routes on a live gateway with a real llama-server: metrics move with requests,
quantiles are null when empty, explain shows a per-request context override, events stream."""

from __future__ import annotations

import json
import re

import pytest
import trio

from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, register_engine

pytestmark = pytest.mark.engine


@pytest.fixture
async def live(nursery, home: Paths, shared_home: Paths, shared_engine):
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return await start_gateway(nursery, home)


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_quantiles_are_null_on_a_fresh_boot_and_fill_with_requests(live):
    with trio.fail_after(60):
        async with live.client() as client:
            empty = (await client.get("/api/quantiles")).json()
            assert empty["ttft"] == {"count": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None}
            assert empty["prompt_cache"]["hit_rate"] is None
            before = (await client.get("/metrics")).text
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=4, stream=True)) as r:
                async for _ in r.aiter_lines():
                    pass
            after = (await client.get("/metrics")).text
            filled = (await client.get("/api/quantiles")).json()
    assert filled["ttft"]["count"] == 2 and filled["ttft_cold"]["count"] == 1 and filled["ttft_warm"]["count"] == 1
    assert filled["tpot"]["p50_ms"] > 0 and filled["prompt_cache"]["prompt_tokens"] > 0
    model = {"model": "smollm2:135m"}
    assert sample(after, "blazar_ttft_seconds_count", **model, cache="cold") == 1
    assert sample(after, "blazar_ttft_seconds_count", **model, cache="warm") == 1
    assert sample(after, "blazar_requests_total", route="/v1/chat/completions", status="200",
                  model="smollm2:135m") - sample(before, "blazar_requests_total", route="/v1/chat/completions",
                                                 status="200", model="smollm2:135m") == 2
    assert sample(after, "blazar_tokens_total", **model, direction="out") >= 8
    assert sample(after, "blazar_instance_events_total", **model, event="spawn") == 1
    assert sample(after, "blazar_instances", **model, state="ready") == 1
    assert re.search(r"^# TYPE blazar_ttft_seconds histogram$", after, re.MULTILINE)


async def test_explain_reflects_a_per_request_context_override(live):
    with trio.fail_after(60):
        async with live.client() as client:
            plain = (await client.get("/api/explain/smollm2")).json()
            assert plain["model"] == "smollm2:135m" and plain["lane"]["engine"]
            assert (plain["context"]["requested"], plain["context"]["effective"]) == (None, 4096)
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            wider = (await client.get("/api/explain/smollm2", headers={"X-Blazar-Num-Ctx": "8192"})).json()
            assert wider["context"] == {"requested": 8192, "effective": 8192,
                                        "source": "request header X-Blazar-Num-Ctx", "per_slot": True, "total": 16384}
            assert "restarts smollm2:135m once" in wider["warnings"][0]
            missing = await client.get("/api/explain/nope")
            assert missing.status_code == 404 and "blazar pull" in missing.json()["error"]


async def test_events_stream_spawns(live):
    events = []
    with trio.fail_after(60):
        async with live.client() as client, live.client() as listener, trio.open_nursery() as inner, \
                listener.stream("GET", "/api/events") as stream:
            inner.start_soon(lambda: client.post("/v1/chat/completions", json=chat_body(max_tokens=1)))
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
    assert events[0]["type"] == "spawn" and events[0]["model"] == "smollm2:135m"


async def test_capacity_fabric_and_benchmarks_on_a_cpu_host(live):
    await live.services.ledger.execute(
        "INSERT INTO benchmarks (ts, model, engine_tag, pp_tps, tg_tps, detail) VALUES (1, 'smollm2:135m', 'b1-cpu',"
        " 300.0, 100.0, '{\"source\": \"blazar bench\"}')")
    with trio.fail_after(30):
        async with live.client() as client:
            capacity = (await client.get("/api/capacity")).json()
            fabric = (await client.get("/api/fabric")).json()
            benchmarks = (await client.get("/api/benchmarks")).json()["benchmarks"]
    assert capacity["cpu"]["cores"] >= 1 and capacity["cpu"]["ram_available_bytes"] > 0
    if not capacity["gpus"]:
        assert "CPU-only" in capacity["note"]
    assert [e["active"] for e in fabric["engines"]] == [True]
    assert benchmarks == [{"model": "smollm2:135m", "engine": "b1-cpu", "measured_at": 1.0, "pp_tps": 300.0,
                           "tg_tps": 100.0, "source": "blazar bench"}]


async def test_watch_tails_admission_refusals(nursery, home: Paths, shared_home: Paths, shared_engine):
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    gateway = await start_gateway(nursery, home, spawn_mem_floor_mib=10**8)
    seen = []
    with trio.fail_after(60):
        async with gateway.client() as client, gateway.client() as listener, trio.open_nursery() as inner, \
                listener.stream("GET", "/api/watch") as stream:
            inner.start_soon(lambda: client.post("/v1/chat/completions", json=chat_body(max_tokens=1)))
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    break
    assert seen[0]["type"] == "refused" and seen[0]["status"] == 507 and "spawn_mem_floor_mib" in seen[0]["fix"]
