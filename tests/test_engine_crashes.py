"""A real llama-server, killed from outside (its pid read from /api/ps, as an operator or the OOM killer would):
mid-stream, mid-answer and between requests. What the client sees: OpenAI's error frame naming the crash, a
502 naming it, a new child on the next request, and after three crashes the breaker, which heals after its
cool-down on the real engine or is cleared with `blazar ps --reset`. Also a model file cut short (the engine
fails while loading, in its own words) and an engine stopped with SIGSTOP (it cannot act on SIGTERM: killed
after the grace). tests/test_lane_faults.py drives the same paths with a labelled fake, and the one fault a real
engine cannot be made to show on demand: one that never becomes healthy."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import trio

from blazar.paths import Paths
from tests.conftest import ServeProcess, arun_cli, start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, pid_alive, ps, register_engine

pytestmark = pytest.mark.engine

MODEL = "smollm2:135m"
LONG = {"text": "Write a very long story about the sea.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def lane_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


async def serving_pid(client: httpx.AsyncClient) -> int:
    """The pid of the model's live child, once it is up and ready for requests."""
    while True:
        rows = [r for r in await ps(client) if r["model"] == MODEL and r["state"] in ("ready", "busy")]
        if rows and rows[0].get("pid"):
            return rows[0]["pid"]
        await trio.sleep(0.02)


async def until_noticed(client: httpx.AsyncClient, pid: int) -> None:
    """Until the gateway has seen that child die: no live row names that pid any more."""
    while any(r.get("pid") == pid and r["state"] in ("ready", "busy") for r in await ps(client)):  # noqa: ASYNC110
        await trio.sleep(0.02)


async def engine_is_decoding(client: httpx.AsyncClient) -> bool:
    """The engine's own slot table (`GET /slots`, relayed by the gateway) says a request is being processed."""
    reply = await client.get("/slots", params={"model": MODEL})
    assert reply.status_code == 200, reply.text
    return any(slot.get("is_processing") for slot in reply.json())


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def until_probe_allowed(client: httpx.AsyncClient) -> None:
    while True:
        rows = [r for r in await ps(client) if r["model"] == MODEL]
        breaker = rows[0].get("breaker") if rows else None
        if breaker and breaker["state"] == "open" and breaker["next_probe_in_secs"] == 0:
            return
        await trio.sleep(0.05)


async def test_a_real_engine_killed_mid_stream_mid_answer_and_idle_then_the_breaker_heals(nursery, lane_home):
    gateway = await start_gateway(nursery, lane_home, breaker_cooldown_secs=1)
    with trio.fail_after(240):
        async with gateway.client(timeout=60) as client, gateway.client(timeout=60) as operator:
            # 1. Killed mid-stream: the tokens already relayed stay, then OpenAI's error frame names the crash.
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            first = await serving_pid(operator)
            frames: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    frames.append(line[6:])
                    if len(frames) == 3:
                        kill(first)
            assert frames[-1] == "[DONE]"
            error = json.loads(frames[-2])["error"]
            assert error["code"] == 502 and f"{MODEL}'s engine" in error["message"], error
            assert "was killed by SIGKILL (signal 9)" in error["message"] or "broke the connection" in error["message"]
            text = [json.loads(f)["choices"][0]["delta"].get("content") for f in frames[:-2]]
            assert len(text) < 1000 and any(text)  # cut short: the story had 1500 tokens to go
            await until_noticed(operator, first)

            # 2. The next request is served by a new child.
            after = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            assert after.status_code == 200, after.text
            second = await serving_pid(operator)
            assert second != first and not pid_alive(first)

            # 3. Killed between requests: the gateway notices, and the next request again gets a new child.
            kill(second)
            await until_noticed(operator, second)
            crashes = await gateway.services.ledger.recent_events(kind="crash")
            assert len(crashes) == 2 and "was killed by SIGKILL (signal 9)" in crashes[0]["detail"]
            again = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            assert again.status_code == 200, again.text
            third = await serving_pid(operator)
            assert third not in (first, second)

            # 4. A third crash in five minutes opens the breaker: the next request is refused with the crash named,
            # and no child is started for it.
            kill(third)
            await until_noticed(operator, third)
            refused = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            assert refused.status_code == 502, refused.text
            message = refused.json()["error"]["message"]
            assert "failed 3 times" in message and "was killed by SIGKILL (signal 9)" in message
            assert "blazar ps --reset" in message
            [row] = await ps(operator)
            assert row["state"] == "broken" and row["breaker"]["state"] == "open"

            # 5. After the cool-down the next request is the probe; the real engine answers it and the breaker closes.
            await until_probe_allowed(operator)
            healed = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
            assert healed.status_code == 200, healed.text
            rows = await ps(operator)
            assert [r["state"] for r in rows] == ["ready"] and "breaker" not in rows[0]
            assert rows[0]["pid"] not in (first, second, third) and pid_alive(rows[0]["pid"])


async def test_a_buffered_answer_cut_by_a_kill_is_a_502_naming_the_crash(nursery, lane_home):
    gateway = await start_gateway(nursery, lane_home)
    outcome: dict[str, httpx.Response] = {}
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client, gateway.client(timeout=60) as operator:
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            pid = await serving_pid(operator)

            async def buffered():
                outcome["reply"] = await client.post("/v1/chat/completions", json=chat_body(**LONG))

            async with trio.open_nursery() as inner:
                inner.start_soon(buffered)
                # Wait until the engine itself is decoding this request: the gateway's in_flight count rises
                # before the request reaches the child, and a request that never reached a killed child is
                # rightly placed again on a fresh one (that would be a 200 here, not the cut this test is about).
                while not await engine_is_decoding(operator):  # noqa: ASYNC110 - polling the engine's slots
                    await trio.sleep(0.02)
                kill(pid)
            reply = outcome["reply"]
            assert reply.status_code == 502, reply.text
            message = reply.json()["error"]["message"]
            assert f"{MODEL}'s engine" in message and "during the request" in message, message
            assert "was killed by SIGKILL (signal 9)" in message or "broke the connection" in message


async def test_blazar_ps_reset_clears_an_open_breaker_of_a_real_engine(lane_home: Paths, tmp_path):
    """The breaker stays open for its whole cool-down (an hour here); `blazar ps --reset`, the command the
    refusal names, clears it at once and the next request starts the engine again."""
    lane_home.config.write_text("breaker_cooldown_secs = 3600\n")
    server = ServeProcess(lane_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    env = {**os.environ, "BLAZAR_HOME": str(lane_home.home)}
    try:
        with trio.fail_after(180):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as client:
                for _ in range(3):
                    served = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
                    assert served.status_code == 200, served.text
                    pid = await serving_pid(client)
                    kill(pid)
                    await until_noticed(client, pid)
                refused = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
                assert refused.status_code == 502 and "blazar ps --reset" in refused.json()["error"]["message"]
                shown = await arun_cli("ps", "--json", env=env)
                [row] = [json.loads(line) for line in shown.stdout.splitlines() if MODEL in line]
                assert row["state"] == "broken" and row["breaker"]["state"] == "open"

                reset = await arun_cli("ps", "--reset", env=env)
                assert reset.returncode == 0, reset.stderr
                assert f"breakers cleared: {MODEL}" in reset.stderr and "no models loaded" in reset.stderr
                assert await ps(client) == []  # the broken row is gone with its breaker
                healed = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
                assert healed.status_code == 200, healed.text
            server.signal(signal.SIGTERM)
            assert await server.wait() == 0
    finally:
        server.kill()


async def test_a_real_engine_that_cannot_load_its_model_is_a_502_in_its_own_words(nursery, lane_home, shared_smollm2,
                                                                                  tmp_path):
    """A GGUF cut short (a download that stopped, a full disk): llama-server itself fails while loading, and the
    client reads why in the engine's own log lines."""
    from blazar.store import Store

    truncated = tmp_path / "broken.gguf"
    with shared_smollm2.open("rb") as source:
        truncated.write_bytes(source.read(20_000_000))
    Store(lane_home).import_file(truncated, name="broken:1")
    gateway = await start_gateway(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client(timeout=30) as client:
            refused = await client.post("/v1/chat/completions", json=chat_body("broken:1", max_tokens=2))
            assert refused.status_code == 502, refused.text
            message = refused.json()["error"]["message"]
            assert "while loading" in message and "failed to load model" in message, message
            while await ps(client):  # noqa: ASYNC110 - the failed child is being reaped
                await trio.sleep(0.05)
    assert not list((lane_home.run / "children").glob("*.json"))


async def test_a_real_engine_that_does_not_stop_on_sigterm_is_killed_after_the_grace(nursery, lane_home):
    """llama-server stopped with SIGSTOP cannot act on SIGTERM (a hung engine): unloading it waits the 5 s grace,
    then SIGKILLs it, and the unload answers only once it is gone."""
    gateway = await start_gateway(nursery, lane_home)
    with trio.fail_after(60):
        async with gateway.client(timeout=30) as client:
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            pid = await serving_pid(client)
            os.kill(pid, signal.SIGSTOP)
            started = trio.current_time()
            unloaded = await client.post("/api/evict", json={"model": MODEL})
            waited = trio.current_time() - started
            assert unloaded.status_code == 200, unloaded.text
            assert not pid_alive(pid) and await ps(client) == []
    assert 4.5 < waited < 15  # the grace, then SIGKILL, then reaped
