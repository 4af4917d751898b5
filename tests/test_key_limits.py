"""Per-key limits on real requests to a real llama-server (SmolLM2): rpm, tpm from the engine's own
token counts, daily tokens across a UTC midnight and a restart, max_concurrent held until a stream
drains, model scopes in every dialect, per-key request cards and metrics, and the official clients
authenticating with their own key options."""

from __future__ import annotations

import calendar

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from blazar.config import ConfigFile
from blazar.paths import Paths
from tests.conftest import Clock, issued, start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, register_engine

pytestmark = pytest.mark.engine

OWNER = "plm_" + "0a" * 16
LIMITED = "plm_" + "1b" * 16
MODEL = "smollm2:135m"


def configure(home: Paths, **limits) -> list:
    fields = "".join(f"{name} = {value!r}\n".replace("'", '"') for name, value in limits.items())
    home.config.write_text(f'[[keys]]\nname = "owner"\nsecret = "{issued(OWNER)}"\n\n'
                           f'[[keys]]\nname = "limited"\nsecret = "{issued(LIMITED)}"\n{fields}')
    return ConfigFile(home.config).load({}).keys


@pytest.fixture
def engine_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


def auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


async def chat(client: httpx.AsyncClient, secret: str = LIMITED, **extra) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=chat_body(max_tokens=2, **extra), headers=auth(secret))


async def test_rpm_refuses_with_retry_after_and_the_window_slides(nursery, engine_home: Paths):
    clock = Clock(1_800_000_000.0)
    gateway = await start_gateway(nursery, engine_home, keys=configure(engine_home, rpm=2), clock=clock)
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            assert (await chat(client)).status_code == 200
            clock.now += 10
            assert (await chat(client)).status_code == 200
            refused = await chat(client)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "50"
            message = refused.json()["error"]["message"]
            assert "rpm limit is 2" in message and "2 requests in the last 60 s" in message
            assert (await chat(client, OWNER)).status_code == 200  # another key is not held back
            clock.now += 51
            assert (await chat(client)).status_code == 200


async def test_tpm_counts_the_engines_own_prompt_and_completion_tokens(nursery, engine_home: Paths):
    clock = Clock(1_800_000_000.0)
    gateway = await start_gateway(nursery, engine_home, keys=configure(engine_home, tpm=5), clock=clock)
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            first = await chat(client)
            assert first.status_code == 200
            usage = first.json()["usage"]
            spent = usage["prompt_tokens"] + usage["completion_tokens"]
            assert spent > 5
            refused = await chat(client)
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) == 60
            assert f"used {spent} tokens in the last 60 s; its tpm limit is 5" in refused.json()["error"]["message"]
            # A stream is charged from its final event too.
            clock.now += 61
            async with client.stream("POST", "/v1/chat/completions", headers=auth(LIMITED),
                                     json=chat_body(max_tokens=3, stream=True)) as stream:
                assert stream.status_code == 200
                async for _ in stream.aiter_bytes():
                    pass
            usage = (await client.get("/api/quantiles", headers=auth(OWNER))).json()["keys"]
            # Two admitted (the refused one is not counted); the stream's tokens were charged.
            assert usage["limited"]["tokens_last_60s"] > 0 and usage["limited"]["requests_today"] == 2
            metrics = (await client.get("/metrics", headers=auth(OWNER))).text
            assert 'blazar_key_tokens_total{key="limited"}' in metrics
            assert 'blazar_key_requests_total{key="limited",outcome="rate_limited"} 1.0' in metrics
            assert LIMITED not in metrics and OWNER not in metrics


async def test_daily_tokens_survive_a_restart_and_renew_at_utc_midnight(nursery, engine_home: Paths):
    clock = Clock(calendar.timegm((2026, 12, 2, 23, 59, 30)))
    keys = configure(engine_home, daily_tokens=5)
    with trio.fail_after(180):
        async with trio.open_nursery() as first_boot:
            gateway = await start_gateway(first_boot, engine_home, keys=keys, clock=clock)
            async with gateway.client(timeout=60) as client:
                assert (await chat(client)).status_code == 200
                refused = await chat(client)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "30"
                assert "2026-12-02 UTC" in refused.json()["error"]["message"]
            gateway.shutdown.set()
        gateway = await start_gateway(nursery, engine_home, keys=keys, clock=clock)
        async with gateway.client(timeout=60) as client:
            again = await chat(client)
            assert again.status_code == 429, "a restart must not reset the day's usage"
            listing = (await client.get("/api/keys", headers=auth(OWNER))).json()["keys"]
            today = next(k for k in listing if k["name"] == "limited")["usage"][0]
            assert today["day"] == "2026-12-02" and today["tokens"] > 5 and today["requests"] == 1
            clock.now += 31  # 00:00:01 UTC
            assert (await chat(client)).status_code == 200


async def test_max_concurrent_is_held_until_a_stream_has_drained(nursery, engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home, keys=configure(engine_home, max_concurrent=1))
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client, gateway.client(timeout=60) as other:
            async with client.stream("POST", "/v1/chat/completions", headers=auth(LIMITED),
                                     json=chat_body(max_tokens=24, stream=True)) as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_bytes()
                await chunks.__anext__()
                refused = await chat(other)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert "max_concurrent limit is 1" in refused.json()["error"]["message"]
                async for _ in chunks:
                    pass
            # The lease went back when the body drained: wait on that state, not on time.
            for _ in range(400):
                if not (await other.get("/api/quantiles", headers=auth(OWNER))).json()["keys"]["limited"]["in_flight"]:
                    break
                await trio.sleep(0.05)
            assert (await chat(other)).status_code == 200


async def test_a_scoped_key_is_refused_other_models_in_every_dialect_and_sees_only_its_cards(nursery,
                                                                                            engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home, keys=configure(engine_home, models=["tinyllama:1b"]))
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            openai_shape = await chat(client)
            assert openai_shape.status_code == 403
            assert "may use only these models: tinyllama:1b" in openai_shape.json()["error"]["message"]
            ollama_shape = await client.post("/api/chat", headers=auth(LIMITED), json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False})
            assert ollama_shape.status_code == 403 and "tinyllama:1b" in ollama_shape.json()["error"]
            anthropic_shape = await client.post("/v1/messages", headers={"x-api-key": LIMITED}, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert anthropic_shape.status_code == 403
            assert anthropic_shape.json()["error"]["type"] == "permission_error"
            assert (await client.get("/api/ps", headers=auth(OWNER))).json()["models"] == []  # nothing was loaded
            assert (await chat(client, OWNER)).status_code == 200
            assert (await client.get("/v1/requests", headers=auth(LIMITED))).json()["data"] == []
            mine = (await client.get("/api/quantiles", headers=auth(LIMITED))).json()["keys"]
            assert list(mine) == ["limited"]  # a scoped key sees only its own usage row
            cards = (await client.get("/v1/requests", headers=auth(OWNER))).json()["data"]
            assert cards and cards[0]["key"] == "owner"
            hidden = await client.get(f"/v1/requests/{cards[0]['id']}", headers=auth(LIMITED))
            assert hidden.status_code == 404


async def test_the_official_clients_authenticate_with_their_own_key_options(nursery, engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home, keys=configure(engine_home))

    def run(function):
        return trio.to_thread.run_sync(function)

    with trio.fail_after(180):
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=LIMITED, max_retries=0)
        answer = await run(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2))
        assert answer.usage.completion_tokens > 0
        wrong = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="plm_nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await run(lambda: wrong.models.list())

        claude = anthropic.Anthropic(base_url=gateway.url, api_key=LIMITED, max_retries=0)
        message = await run(lambda: claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]))
        assert message.usage.output_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            await run(lambda: anthropic.Anthropic(base_url=gateway.url, api_key="plm_nope", max_retries=0)
                      .messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]))

        local = ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {LIMITED}"})
        reply = await run(lambda: local.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             options={"num_predict": 2}))
        assert reply.message.content is not None
        with pytest.raises(ollama.ResponseError) as refused:
            await run(lambda: ollama.Client(host=gateway.url).list())
        assert refused.value.status_code == 401
