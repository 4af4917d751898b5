"""Fault injection with the labelled FakeLlamaServer test double: never healthy, crash on start,
crash mid-stream, SIGTERM ignored, the restart budget and `ps --reset`, and think stripping."""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

from blazar.paths import Paths
from blazar.store import Store
from tests.conftest import start_gateway
from tests.fakehub import make_gguf
from tests.lane_fixtures import FAKE_ENGINE, chat_body, pid_alive, ps, register_engine


@pytest.fixture
def fake_home(home: Paths, tmp_path, monkeypatch) -> Paths:
    register_engine(home, FAKE_ENGINE, "fake-9999")
    Store(home).import_file(make_gguf(tmp_path / "fake.gguf", payload_mib=0.01), name="fake:1")
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    return home


def body(**extra):
    return chat_body("fake:1", **extra)


async def test_an_engine_that_never_gets_healthy_gives_502_with_its_output(nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "never_healthy")
    gateway = await start_gateway(nursery, fake_home, spawn_timeout_secs=1.5)
    with trio.fail_after(30):
        async with gateway.client() as client:
            response = await client.post("/v1/chat/completions", json=body())
            assert response.status_code == 502
            message = response.json()["error"]["message"]
            assert "did not become healthy within 1.5s" in message
            assert "fake llama-server: mode=never_healthy" in message
            while await ps(client):  # noqa: ASYNC110 - the failed child is being reaped
                await trio.sleep(0.05)
    assert not list((fake_home.run / "children").glob("*.json"))


async def test_a_crash_while_loading_surfaces_the_engines_own_words(nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash_on_start")
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            response = await client.post("/v1/chat/completions", json=body())
    assert response.status_code == 502
    assert "exited with code 1 while loading" in response.json()["error"]["message"]
    assert "fake corruption at tensor 7" in response.json()["error"]["message"]


async def test_a_crash_mid_stream_ends_with_an_error_frame_and_the_next_request_respawns(
        nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash_mid_stream")
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            frames = []
            async with client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
            assert frames[-1] == "[DONE]"
            error = json.loads(frames[-2])["error"]
            assert error["code"] == 502 and "exited with code 3" in error["message"]
            assert len(frames) == 5  # three tokens, the error frame, [DONE]
            while await ps(client):  # noqa: ASYNC110 - the crashed child is being reaped
                await trio.sleep(0.02)
            # The lane recorded the crash while dropping the child: the ledger (FIFO) has it by now.
            crashes = await gateway.services.ledger.recent_events(kind="crash")
            assert crashes and "exited with code 3" in crashes[0]["detail"]
            monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
            again = await client.post("/v1/chat/completions", json=body())
            assert again.status_code == 200
            assert again.json()["choices"][0]["message"]["content"] == "Hello from the fake engine."


async def test_a_request_after_an_unload_or_a_kill_reaches_a_new_child(nursery, fake_home):
    """Requests to a resident model go straight to its instance (the lane's answer is cached). Once that
    child is unloaded, or seen dead after a kill from outside, the next request is placed on a new child,
    never refused."""
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            assert (await client.post("/v1/chat/completions", json=body())).status_code == 200
            [first] = await ps(client)
            assert (await client.post("/api/evict", json={"model": "fake:1"})).status_code == 200
            assert await ps(client) == []
            after_unload = await client.post("/v1/chat/completions", json=body())
            assert after_unload.status_code == 200, after_unload.text
            [second] = await ps(client)
            assert second["pid"] != first["pid"]
            os.kill(second["pid"], signal.SIGKILL)
            while any(row["state"] == "ready" for row in await ps(client)):  # noqa: ASYNC110 - until it notices
                await trio.sleep(0.02)
            after_kill = await client.post("/v1/chat/completions", json=body())
            assert after_kill.status_code == 200, after_kill.text
            live = [row for row in await ps(client) if row["state"] in ("ready", "busy")]
            assert [row["pid"] for row in live] not in ([first["pid"]], [second["pid"]]) and len(live) == 1


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ignore_sigterm")
    gateway = await start_gateway(nursery, fake_home, keep_alive="0.3s")
    with trio.fail_after(30):
        async with gateway.client() as client:
            assert (await client.post("/v1/chat/completions", json=body())).status_code == 200
            (row,) = await ps(client)
            started = trio.current_time()
            while pid_alive(row["pid"]):  # noqa: ASYNC110 - another process
                await trio.sleep(0.1)
            waited = trio.current_time() - started
    assert 4.5 < waited < 9  # the 5 s grace, then SIGKILL


async def test_restart_budget_opens_a_breaker_until_ps_reset(nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash_on_start")
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", json=body())).status_code == 502
            refused = await client.post("/v1/chat/completions", json=body())
            assert refused.status_code == 502
            message = refused.json()["error"]["message"]
            assert "failed 3 times" in message and "blazar ps --reset" in message
            assert [r["state"] for r in await ps(client)] == ["broken"]
            monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
            assert (await client.post("/api/ps/reset")).json() == {"cleared": ["fake:1"]}
            assert (await client.post("/v1/chat/completions", json=body())).status_code == 200


async def _until_probe_allowed(client) -> dict:
    while True:
        rows = await ps(client)
        breaker = rows[0].get("breaker") if rows else None
        if breaker and breaker["state"] == "open" and breaker["next_probe_in_secs"] == 0:
            return breaker
        await trio.sleep(0.05)


async def test_an_open_breaker_heals_by_itself_after_its_cool_down(nursery, fake_home, monkeypatch):
    """A server left alone recovers: after the cool-down the next request is the probe, and a clean answer
    closes the breaker; a probe that fails again doubles the cool-down."""
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash_on_start")
    gateway = await start_gateway(nursery, fake_home, breaker_cooldown_secs=0.5)
    with trio.fail_after(60):
        async with gateway.client() as client:
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", json=body())).status_code == 502
            refused = await client.post("/v1/chat/completions", json=body())
            assert refused.status_code == 502 and refused.headers["retry-after"] == "1"
            assert "the next request after" in refused.json()["error"]["message"]
            [row] = await ps(client)
            assert row["state"] == "broken" and row["breaker"]["state"] == "open"
            assert row["breaker"]["cool_down_secs"] == 0.5

            await _until_probe_allowed(client)  # the probe's child crashes too: open again, twice as long
            probe = await client.post("/v1/chat/completions", json=body())
            assert probe.status_code == 502 and "exited with code 1 while loading" in probe.json()["error"]["message"]
            [row] = await ps(client)
            assert row["breaker"]["state"] == "open" and row["breaker"]["cool_down_secs"] == 1.0, row
            explained = (await client.get("/api/explain/fake:1")).json()
            assert explained["breaker"]["state"] == "open"

            monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
            await _until_probe_allowed(client)
            healed = await client.post("/v1/chat/completions", json=body())
            assert healed.status_code == 200
            rows = await ps(client)
            assert [r["state"] for r in rows] == ["ready"] and "breaker" not in rows[0]
            events = await gateway.services.ledger.recent_events(kind="breaker")
            assert '"closed"' in events[0]["detail"]  # newest first


async def test_think_blocks_are_stripped_unless_thinking_was_asked_for(nursery, fake_home, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "think")
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            plain = (await client.post("/v1/chat/completions", json=body())).json()
            assert plain["choices"][0]["message"]["content"] == "Hello from the fake engine."
            pieces = []
            async with client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
            assert "".join(pieces) == "Hello from the fake engine."
            asked = (await client.post("/v1/chat/completions", json=body(reasoning_effort="high"))).json()
            assert asked["choices"][0]["message"]["content"].startswith("<think>let me think</think>")
            kwargs = body(chat_template_kwargs={"enable_thinking": True})
            assert "<think>" in (await client.post("/v1/chat/completions", json=kwargs)).json()[
                "choices"][0]["message"]["content"]


async def test_rerank_answers_on_all_five_spellings(nursery, fake_home):
    """Rerank needs a model with a rank head, and none ships on PyPI: the labelled fake answers."""
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            for path in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking", "/api/rerank"):
                response = await client.post(path, json={"model": "fake:1", "query": "sea",
                                                         "documents": ["ocean", "desert", "river"]},
                                             headers={"X-Blazar-Model": "fake:1"})
                assert response.status_code == 200, (path, response.text)
                assert [r["index"] for r in response.json()["results"]] == [0, 1, 2]
            missing = await client.post("/v1/rerank", json={"query": "sea", "documents": []})
            assert missing.status_code == 400 and "`model` is required" in missing.json()["error"]["message"]


def test_a_crash_report_names_its_cause_first_then_the_last_lines():
    from lanes.child import crash_lines, exit_cause

    assert exit_cause(-9) == "was killed by SIGKILL (signal 9)" and exit_cause(3) == "exited with code 3"
    output = "\n".join(["loading model", "error: unable to allocate 4096 MiB for the KV cache",
                        *[f"warning: routine line {n}" for n in range(30)]])
    report = crash_lines(output, limit=6).splitlines()
    assert report[0] == "error: unable to allocate 4096 MiB for the KV cache"  # the cause, not the last warnings
    assert report[1] == "(last lines)" and report[-1] == "warning: routine line 29" and len(report) == 7
    assert crash_lines("just\nsome\nlines", limit=2) == "some\nlines"  # no cause named: the last lines
