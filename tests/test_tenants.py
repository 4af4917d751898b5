"""A scoped API key is a tenant: it never changes what another key sees, is charged for all it is served, and
cannot make the gateway do unbounded work. Each test is an attack from the tenant-review issue, tried against a
real gateway (hypercorn on port 0) with two keys, and shown refused or bounded."""

from __future__ import annotations

import re

import httpx
import msgspec
import pytest
import trio
import trio_websocket

from blazar.config import ConfigFile
from blazar.paths import Paths
from blazar.store import Store
from dialects.app import create_app
from dialects.roles import census
from supervisors.fair_slots import FairSlots
from tests.conftest import Clock, issued, start_gateway
from tests.lane_fixtures import add_shared_model, chat_body, register_engine

OWNER = "plm_" + "7c" * 16
TENANT = "plm_" + "8d" * 16
OTHER = "plm_" + "9e" * 16
MODEL = "smollm2:135m"

# What every key would see change: only an admin may do these (the census below fails if one drifts).
ADMIN_ROUTES = {
    ("DELETE", "/api/delete"), ("POST", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/pull"),
    ("GET", "/slots"), ("POST", "/slots/<int:slot_id>"), ("POST", "/api/ps/reset"), ("POST", "/api/evict"),
    ("POST", "/api/replicate"), ("POST", "/api/failover/<chain>/pin"), ("POST", "/api/failover/<chain>/unpin"),
    ("GET", "/api/keys"), ("POST", "/api/keys"), ("DELETE", "/api/keys"), ("POST", "/api/keys/rotate"),
}
OPEN_ROUTES = {("GET", "/healthz"), ("GET", "/health")}


def two_keys(home: Paths, **tenant_fields) -> list:
    """An unscoped owner, a tenant scoped to SmolLM2 (with `tenant_fields`), and another scoped key."""
    extra = "".join(f"{name} = {msgspec.json.encode(value).decode()}\n" for name, value in tenant_fields.items())
    home.config.write_text(
        f'[[keys]]\nname = "owner"\nsecret = "{issued(OWNER)}"\n\n'
        f'[[keys]]\nname = "tenant"\nsecret = "{issued(TENANT)}"\nmodels = ["{MODEL}"]\n{extra}\n'
        f'[[keys]]\nname = "other"\nsecret = "{issued(OTHER)}"\nmodels = ["{MODEL}"]\n')
    return ConfigFile(home.config).load({}).keys


def auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
def engine_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


# ---------------------------------------------------------------- one rule for shared state


async def test_every_route_declares_its_role_and_shared_state_is_admin_only(nursery, home: Paths):
    gateway = await start_gateway(nursery, home)
    rows = census(create_app(gateway.services))
    assert len(rows) > 90
    undeclared = [f"{method} {path}" for method, path, role in rows if not role]
    assert undeclared == [], f"routes without a role (dialects/roles.py): {undeclared}"
    admin = {(method, path) for method, path, role in rows if role == "admin"}
    assert admin == ADMIN_ROUTES
    assert {(method, path) for method, path, role in rows if role == "open"} == OPEN_ROUTES
    assert ("WEBSOCKET", "/v1/realtime", "key") in rows
    async with gateway.client() as client:  # the manifest tells a client each route's role
        endpoints = (await client.get("/.well-known/blazar")).json()["endpoints"]
    assert {"method": "POST", "path": "/api/copy", "api": "ollama", "role": "admin"} in endpoints
    assert {(e["method"], e["path"]) for e in endpoints if e["role"] == "open"} == OPEN_ROUTES
    assert {"method": "GET", "path": "/v1/realtime", "api": "openai", "role": "key"} in endpoints


async def test_a_scoped_key_changes_nothing_shared_and_an_admin_key_may(nursery, engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home, keys=two_keys(engine_home))
    with trio.fail_after(60):
        async with gateway.client() as client:
            for method, rule in sorted(ADMIN_ROUTES):
                path = re.sub(r"<(?:[^:>]+:)?[^>]+>", "0", rule)
                refused = await client.request(method, path, headers=auth(TENANT), json={"model": MODEL})
                assert refused.status_code == 403, (method, path, refused.text)
                assert "needs an admin key" in refused.text and "tenant" in refused.text, refused.text
                allowed = await client.request(method, path, headers=auth(OWNER), json={"model": MODEL})
                assert "needs an admin key" not in allowed.text, (method, path, allowed.text)
            # The attacks, one by one, with what the tenant meant to do: nothing of the store moved.
            assert (await client.post("/api/copy", headers=auth(TENANT),
                                      json={"source": "other:model", "destination": MODEL})).status_code == 403
            names = [m["name"] for m in (await client.get("/api/tags", headers=auth(OWNER))).json()["models"]]
            assert names == [MODEL]
            # The Ollama unload idiom is residency for everyone: refused to the tenant.
            unload = await client.post("/api/generate", headers=auth(TENANT), json={"model": MODEL, "keep_alive": 0})
            assert unload.status_code == 403 and "keep_alive 0" in unload.json()["error"]
            # The load idiom is a generation-side load: inside the scope only.
            outside = await client.post("/api/generate", headers=auth(TENANT), json={"model": "qwen:0.5b"})
            assert outside.status_code == 403 and "outside its scope" in outside.json()["error"]
            # Show and explain answer only inside the scope (system prompts and engine arguments stay private).
            Store(engine_home).copy(MODEL, "private:1")
            shown = await client.post("/api/show", headers=auth(TENANT), json={"model": "private:1"})
            assert shown.status_code == 403 and "outside its scope" in shown.json()["error"]
            explained = await client.get("/api/explain/private:1", headers=auth(TENANT))
            assert explained.status_code == 403
            assert (await client.post("/api/show", headers=auth(OWNER), json={"model": "private:1"})).status_code == 200
            # Nothing was loaded by any of it.
            assert (await client.get("/api/ps", headers=auth(OWNER))).json()["models"] == []


async def test_a_cross_site_get_of_an_engine_route_never_spawns_a_model(nursery, engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            props = await client.get(f"/props?model={MODEL}")
            assert props.status_code == 409
            assert "a GET never loads one" in props.text and "POST /api/warm" in props.text
            assert (await client.get("/api/ps")).json()["models"] == []


async def test_metrics_show_a_scoped_key_no_other_keys_usage(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=two_keys(home))
    with trio.fail_after(30):
        async with gateway.client() as client:
            await client.get("/v1/models", headers=auth(OTHER))
            admin_view = (await client.get("/metrics", headers=auth(OWNER))).text
            assert 'blazar_key_requests_total' in admin_view or 'blazar_key_in_flight' in admin_view
            tenant_view = (await client.get("/metrics", headers=auth(TENANT))).text
            assert "blazar_key_" not in tenant_view
            assert "blazar_requests_total" in tenant_view  # the gateway's own series stay


# ---------------------------------------------------------------- spawn options reshape shared engines


async def test_spawn_options_are_for_admins_and_opted_in_keys_and_bounded_by_the_machine(nursery, engine_home: Paths):
    import os

    gateway = await start_gateway(nursery, engine_home, keys=two_keys(engine_home, spawn_options=True))
    too_many = (os.cpu_count() or 1) + 1
    with trio.fail_after(60):
        async with gateway.client() as client:
            body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_thread": 1, "num_predict": 1}}
            refused = await client.post("/api/generate", headers=auth(OTHER), json=body)
            assert refused.status_code == 403
            assert "options.num_thread" in refused.json()["error"] and "spawn_options = true" in refused.json()["error"]
            over = await client.post("/api/generate", headers=auth(OWNER),
                                     json={**body, "options": {"num_thread": too_many}})
            assert over.status_code == 400 and f"{too_many - 1} CPU cores" in over.json()["error"]
            batch = await client.post("/api/generate", headers=auth(TENANT),
                                      json={**body, "options": {"num_batch": 10**6}})
            assert batch.status_code == 400 and "larger than" in batch.json()["error"]
            assert (await client.get("/api/ps", headers=auth(OWNER))).json()["models"] == []


# ---------------------------------------------------------------- charge what was served

async def until(read, *, at_least: int | None = None, done=None, every: float = 0.05):
    """Poll a state the gateway reaches by itself (a charge landing, a job ending) until it holds; the caller's
    fail_after bounds the wait."""
    while True:
        value = await read()
        if (at_least is not None and value >= at_least) or (done is not None and done(value)):
            return value
        await trio.sleep(every)


async def tokens_used(client: httpx.AsyncClient, key: str) -> int:
    keys = (await client.get("/api/keys", headers=auth(OWNER))).json()["keys"]
    return next(k for k in keys if k["name"] == key)["live"]["tokens_last_60s"]


@pytest.mark.engine
async def test_streams_cut_early_are_charged_and_tpm_then_refuses(nursery, engine_home: Paths):
    clock = Clock(1_800_000_000.0)
    gateway = await start_gateway(nursery, engine_home, keys=two_keys(engine_home, tpm=150), clock=clock)
    # ignore_eos (llama-server's own field, passed through): a sampled early end-of-text must not end the stream
    # before the client's fifth chunk, which is where this test hangs up.
    body = chat_body(text="Count from one to one hundred, one number per line.", max_tokens=200, stream=True,
                     ignore_eos=True)
    cut = 0
    with trio.fail_after(180):
        async with gateway.client(timeout=60) as client:
            for _ in range(8):
                async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(TENANT)) as response:
                    if response.status_code == 429:
                        break
                    assert response.status_code == 200
                    events: list[dict] = []
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            events.append(msgspec.json.decode(line[5:]))
                        if len(events) == 5:
                            break  # the client hangs up after five chunks, the stream unfinished
                    cut += 1
                    # What makes the charge exact: the engine's running count rides in every event of a keyed stream.
                    assert all(event["timings"]["prompt_n"] + event["timings"].get("cache_n", 0) > 0
                               for event in events[1:]), events
                # The charge lands once the relay notices the hang-up: wait for that state, boundedly.
                with trio.fail_after(15):
                    await until(lambda: tokens_used(client, "tenant"), at_least=cut * 5)
            refused = await client.post("/v1/chat/completions", json={**body, "stream": False}, headers=auth(TENANT))
            assert refused.status_code == 429 and "tpm limit is 150" in refused.json()["error"]["message"]
            assert 1 <= cut < 8  # the minute's tokens ran out on cut streams alone
            other = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=auth(OTHER))
            assert other.status_code == 200  # another tenant is not held back


@pytest.mark.engine
async def test_a_stored_completions_metadata_belongs_to_its_key(nursery, engine_home: Paths):
    gateway = await start_gateway(nursery, engine_home, keys=two_keys(engine_home))
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            created = (await client.post("/v1/chat/completions", headers=auth(TENANT), json=chat_body(
                max_tokens=2, metadata={"ticket": "T-1"}))).json()
            hijack = await client.post(f"/v1/chat/completions/{created['id']}", headers=auth(OTHER),
                                       json={"metadata": {"ticket": "owned"}})
            assert hijack.status_code == 404
            hijack = await client.post(f"/v1/chat/completions/{created['id']}", headers=auth(OWNER),
                                       json={"metadata": {"ticket": "owned"}})
            assert hijack.status_code == 404
            mine = await client.post(f"/v1/chat/completions/{created['id']}", headers=auth(TENANT),
                                     json={"metadata": {"ticket": "T-2"}})
            assert mine.status_code == 200 and mine.json()["metadata"] == {"ticket": "T-2"}


# ---------------------------------------------------------------- work that outlives its request


async def upload(client: httpx.AsyncClient, secret: str, data: bytes = b'{"x": 1}\n') -> httpx.Response:
    return await client.post("/v1/files", headers=auth(secret), data={"purpose": "batch"},
                             files={"file": ("in.jsonl", data, "application/jsonl")})


async def test_uploads_pass_admission_and_per_key_file_quotas(nursery, home: Paths):
    clock = Clock(1_800_000_000.0)
    gateway = await start_gateway(nursery, home, keys=two_keys(home, rpm=3), clock=clock, files_per_key=2,
                                  file_storage_per_key_mib=1)
    with trio.fail_after(60):
        async with gateway.client() as client:
            first, second = await upload(client, TENANT), await upload(client, TENANT)
            assert first.status_code == second.status_code == 200
            third = await upload(client, TENANT)
            assert third.status_code == 429 and "files_per_key allows 2" in third.json()["error"]["message"]
            limited = await upload(client, TENANT)
            assert limited.status_code == 429 and "rpm limit is 3" in limited.json()["error"]["message"]
            clock.now += 61
            # Another key cannot delete the tenant's file; the tenant can, and it leaves the disk.
            file_id = first.json()["id"]
            assert (await client.delete(f"/v1/files/{file_id}", headers=auth(OTHER))).status_code == 404
            stored = home.home / "files" / file_id
            assert stored.exists()
            deleted = await client.delete(f"/v1/files/{file_id}", headers=auth(TENANT))
            assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
            assert not stored.exists()
            assert (await client.get(f"/v1/files/{file_id}", headers=auth(TENANT))).status_code == 404
            assert (await upload(client, TENANT)).status_code == 200  # room again
            big = await upload(client, OTHER, b"x" * (1024 * 1024 + 1))
            assert big.status_code == 429 and "file_storage_per_key_mib allows 1 MiB" in big.text
            assert (await upload(client, OTHER)).status_code == 200  # its own count, not the tenant's


async def test_a_failed_async_transcription_leaves_no_input_on_disk(nursery, home: Paths):
    gateway = await start_gateway(nursery, home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            queued = await client.post("/v1/audio/transcriptions", data={"model": "tiny.en", "async": "true"},
                                       files={"file": ("a.wav", b"RIFF" + b"\0" * 64, "audio/wav")})
            assert queued.status_code == 202, queued.text
            job_id = queued.json()["id"]
            async def status() -> str:
                return (await client.get(f"/v1/audio/jobs/{job_id}")).json()["status"]

            assert await until(status, done=lambda s: s not in ("queued", "running")) == "failed"
            assert not (home.home / "jobs" / "inputs" / job_id).exists()


async def test_job_slots_are_shared_fairly_between_keys(autojump_clock):
    """Key a queues four long jobs before key b asks for one: a runs two side by side but never takes the last
    slot, so b's job starts at once instead of after all of a's."""
    slots = FairSlots(3)
    started: list[str] = []

    async def job(key: str, name: str, seconds: float) -> None:
        async with slots.hold(key):
            started.append(name)
            assert slots.running.get("a", 0) <= 2
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        for index in range(4):
            nursery.start_soon(job, "a", f"a{index}", 100)
            await trio.lowlevel.checkpoint()
        await trio.sleep(1)
        assert started == ["a0", "a1"]  # the third slot stays free
        nursery.start_soon(job, "b", "b0", 1)
        await trio.sleep(0.5)
        assert started == ["a0", "a1", "b0"]  # b did not wait for a's hundred seconds
    assert started[:3] == ["a0", "a1", "b0"] and sorted(started[3:]) == ["a2", "a3"]


async def test_weight_decides_who_gets_a_freed_slot(autojump_clock):
    weights = {"heavy": 3, "light": 1, "brief": 1}
    slots = FairSlots(3, weights.__getitem__)
    started: list[str] = []

    async def job(key: str, seconds: float) -> None:
        async with slots.hold(key):
            started.append(key)
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        for key, seconds in (("light", 10), ("heavy", 10), ("brief", 2)):
            nursery.start_soon(job, key, seconds)
        await trio.sleep(1)
        assert sorted(started) == ["brief", "heavy", "light"]  # every slot taken
        nursery.start_soon(job, "light", 1)
        nursery.start_soon(job, "heavy", 1)
        await trio.sleep(0.5)
        assert len(started) == 3  # both wait
        await trio.sleep(1)
        # `brief` ended and freed one slot: light (1 running / weight 1) loses it to heavy (1 running / weight 3).
        assert started[3:] == ["heavy"]


# ---------------------------------------------------------------- sessions and names


async def test_realtime_sessions_are_capped_per_key(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=two_keys(home), realtime_sessions_per_key=1)
    url = gateway.url.replace("http://", "ws://") + "/v1/realtime"
    with trio.fail_after(30):
        async with trio_websocket.open_websocket_url(
                url, extra_headers=[(b"authorization", f"Bearer {TENANT}".encode())]) as first:
            await first.get_message()  # session.created: the first session is open
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with trio_websocket.open_websocket_url(
                        url, extra_headers=[(b"authorization", f"Bearer {TENANT}".encode())]):
                    pass
            assert rejected.value.status_code == 429
            assert b"realtime_sessions_per_key allows 1" in (rejected.value.body or b"")
            async with trio_websocket.open_websocket_url(
                    url, extra_headers=[(b"authorization", f"Bearer {OTHER}".encode())]) as other:
                await other.get_message()  # another key's own count
        # The first session closed: the tenant may open one again.
        async with trio_websocket.open_websocket_url(
                url, extra_headers=[(b"authorization", f"Bearer {TENANT}".encode())]) as again:
            await again.get_message()


async def test_voice_and_whisper_names_come_only_from_the_installed_lists(nursery, home: Paths):
    gateway = await start_gateway(nursery, home)
    (home.home / "secret.onnx").write_bytes(b"x")
    (home.home / "secret.onnx.json").write_text("{}")
    with trio.fail_after(30):
        async with gateway.client() as client:
            speech = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi",
                                                                 "voice": "../../secret"})
            assert speech.status_code in (400, 404), speech.text
            assert "not installed" in speech.text or "voice" in speech.text
            heard = await client.post("/v1/audio/transcriptions", data={"model": "../../../secret"},
                                      files={"file": ("a.wav", b"RIFF" + b"\0" * 64, "audio/wav")})
            assert heard.status_code in (400, 404) and "not installed" in heard.text


def test_a_cut_stream_is_charged_the_engines_running_count_else_an_estimate():
    from supervisors.instance import StreamSeen, cut_stream_tokens

    seen = StreamSeen(tail=b"", events=7)
    assert cut_stream_tokens(42, seen, b"x" * 400) == 42  # the engine's own count wins
    assert cut_stream_tokens(0, seen, b"x" * 400) == 7 + 100  # none reported: events plus the prompt's bytes / 4
