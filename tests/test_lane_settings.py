"""Settings that are accepted act, or are refused with a teaching error: Modelfile SYSTEM / TEMPLATE /
ADAPTER, `models.<name>.reasoning_budget`, and Ollama spawn options. The labelled FakeLlamaServer
double reports the messages it received and its own command line, which is what Blazar controls;
tests/test_text_lane.py spawns the real engine with the same flags."""

from __future__ import annotations

import msgspec
import pytest
import trio

from blazar.config import ModelSettings
from blazar.paths import Paths
from blazar.store import Store
from lanes import LANES
from tests.conftest import start_gateway
from tests.fakehub import make_gguf
from tests.lane_fixtures import FAKE_ENGINE, chat_body, ps, register_engine


@pytest.fixture
def fake_home(home: Paths, tmp_path, monkeypatch) -> Paths:
    register_engine(home, FAKE_ENGINE, "fake-9999-cpu")
    store = Store(home)
    store.import_file(make_gguf(tmp_path / "fake.gguf", payload_mib=0.01), name="fake:1")
    adapter_digest, _ = store.adopt_blob(make_gguf(tmp_path / "lora.gguf", payload_mib=0.01), link=True)
    base = store.get("fake:1")
    store.put(msgspec.structs.replace(base, name="persona:1", system="You are a lighthouse keeper.",
                                      template="{% for m in messages %}{{ m.content }}{% endfor %}",
                                      adapters=[adapter_digest], base="fake:1"))
    store.put(msgspec.structs.replace(base, name="gotemplate:1", template="{{ .System }} {{ .Prompt }}",
                                      base="fake:1"))
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    return home


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


async def test_modelfile_system_template_and_adapter_act(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            answer = (await client.post("/v1/chat/completions", json=chat_body("persona:1"))).json()
            assert answer["fake_received"][0] == {"role": "system", "content": "You are a lighthouse keeper."}
            own = chat_body("persona:1", messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "hi"}])
            assert (await client.post("/v1/chat/completions", json=own)).json()["fake_received"][0]["content"] \
                == "Be brief."  # the request's own system message wins
            argv = answer["fake_argv"]
            template = flag(argv, "--chat-template-file")
            assert template and (await trio.Path(template).read_text()).startswith("{% for m in messages %}")
            assert flag(argv, "--lora").startswith(str(fake_home.models))
            card = (await client.get("/api/explain/persona:1")).json()
            assert card["system_default"] == "You are a lighthouse keeper." and card["adapters"]


async def test_an_ollama_go_template_is_refused_with_the_fix(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            refused = await client.post("/v1/chat/completions", json=chat_body("gotemplate:1"))
            assert refused.status_code == 409
            message = refused.json()["error"]["message"]
            assert "Go template" in message and "Jinja" in message and "recreate gotemplate:1" in message
            assert await ps(client) == []


async def test_reasoning_budget_reaches_the_engine(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home, models={"fake:1": ModelSettings(reasoning_budget=0)})
    with trio.fail_after(30):
        async with gateway.client() as client:
            argv = (await client.post("/v1/chat/completions", json=chat_body("fake:1"))).json()["fake_argv"]
            assert flag(argv, "--reasoning-budget") == "0"
            assert (await client.get("/api/explain/fake:1")).json()["reasoning_budget"] == 0


async def test_ollama_spawn_options_map_to_flags_or_teach(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            async def chat(**options):
                return await client.post("/api/chat", json={"model": "fake:1", "stream": False, "options": options,
                                                            "messages": [{"role": "user", "content": "hi"}]})

            for options, needle in (({"num_gpu": 20}, "CPU build"), ({"low_vram": True}, "no low-VRAM mode"),
                                    ({"num_batch": 0}, "≥ 1"), ({"use_mlock": "yes"}, "true or false")):
                refused = await chat(**options)
                assert refused.status_code == 400, options
                assert needle in refused.json()["error"], options
            assert await ps(client) == []  # nothing was spawned for a refused option
            assert (await chat(num_thread=1, num_batch=64, use_mlock=True, numa=True)).status_code == 200
            [row] = await ps(client)
            argv_answer = await client.post("/v1/chat/completions", json=chat_body("fake:1"))
            argv = argv_answer.json()["fake_argv"]
            assert (flag(argv, "--threads"), flag(argv, "--batch-size")) == ("1", "64")
            assert (flag(argv, "--load-mode"), flag(argv, "--numa")) == ("mmap+mlock", "distribute")
            # Asking for a default (mmap on, GPU 0) or for what the child already has never restarts it.
            assert (await chat(use_mmap=True, main_gpu=0)).status_code == 200
            assert (await chat(num_thread=1)).status_code == 200
            assert [r["pid"] for r in await ps(client)] == [row["pid"]]
            # A different value does: the old child drains, a new one starts with it.
            restarted = await client.post("/api/chat", json={"model": "fake:1", "stream": False, "options": {
                "num_thread": 2}, "messages": [{"role": "user", "content": "hi"}]})
            assert restarted.status_code == 200
            live = [r for r in await ps(client) if r["state"] in ("ready", "busy")]
            assert len(live) == 1 and live[0]["pid"] != row["pid"]


def test_a_rank_head_model_does_not_claim_embeddings():
    lane = LANES["llamacpp"]

    class Manifest:
        mmproj = None
        info = {"rank_head": True}

    assert lane.capabilities(Manifest()) == ["completion", "rerank"]
    Manifest.info = {}
    assert lane.capabilities(Manifest()) == ["completion", "embedding"]


async def test_ps_reports_the_blob_digest_and_no_vram_on_a_cpu_engine(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            assert (await client.post("/v1/chat/completions", json=chat_body("fake:1"))).status_code == 200
            [row] = (await client.get("/api/ps")).json()["models"]
    assert row["digest"] == Store(fake_home).get("fake:1").blob and len(row["digest"]) == 64
    assert row["size_vram"] == 0 and row["gpu_engine"] is False


async def test_ollama_options_without_effect_are_served_named_and_logged_once(nursery, fake_home, caplog):
    """Like Ollama, an option it once knew (tfs_z, f16_kv) or one no version knows is served; unlike Ollama, the
    answer says so in a header, and the log says it once per model and option, not once per request."""
    gateway = await start_gateway(nursery, fake_home)
    body = {"model": "fake:1", "stream": False, "suffix": "never read", "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0.2, "tfs_z": 1.0, "f16_kv": True, "brand_new_knob": 3}}
    with trio.fail_after(60):
        async with gateway.client() as client:
            answers = [await client.post("/api/chat", json=body) for _ in range(3)]
            async with client.stream("POST", "/api/chat", json={**body, "stream": True}) as streamed:
                lines = [line async for line in streamed.aiter_lines() if line]
            loaded = await client.post("/api/generate", json={"model": "fake:1", "options": {"tfs_z": 1}})
    for response in [*answers, streamed, loaded]:
        assert response.status_code == 200
    for response in [*answers, streamed]:
        assert response.headers["x-blazar-ignored-options"] == "tfs_z,f16_kv,brand_new_knob"
        assert response.headers["x-blazar-ignored-fields"] == "suffix"
    assert answers[0].json()["message"]["content"] and json_lines_end_done(lines)
    assert loaded.headers["x-blazar-ignored-options"] == "tfs_z" and loaded.json()["done_reason"] == "load"
    warnings = [r.getMessage() for r in caplog.records if "served without it" in r.getMessage()]
    assert len(warnings) == 4, warnings  # tfs_z, f16_kv, brand_new_knob, suffix: once each for fake:1
    assert any("'tfs_z' has no effect on llama-server" in w for w in warnings)
    assert any("'brand_new_knob' is not one this gateway knows" in w for w in warnings)


def json_lines_end_done(lines: list[str]) -> bool:
    return msgspec.json.decode(lines[-1])["done"] is True and len(lines) > 2


async def test_strict_ollama_options_refuse_what_has_no_effect(nursery, fake_home):
    gateway = await start_gateway(nursery, fake_home, ollama_strict_options=True)
    chat = {"model": "fake:1", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(60):
        async with gateway.client() as client:
            no_effect = await client.post("/api/chat", json={**chat, "options": {"tfs_z": 1.0}})
            unknown = await client.post("/api/chat", json={**chat, "options": {"brand_new_knob": 1}})
            field = await client.post("/api/chat", json={**chat, "suffix": "x"})
            assert await ps(client) == []  # nothing loaded for a refused request
            acting = await client.post("/api/chat", json={**chat, "options": {"temperature": 0.1, "num_ctx": 2048}})
    assert no_effect.status_code == unknown.status_code == field.status_code == 400
    assert "'tfs_z' (no effect on llama-server)" in no_effect.json()["error"]
    assert "unknown option 'brand_new_knob'" in unknown.json()["error"]
    assert "ollama_strict_options false" in unknown.json()["error"]
    assert "unknown field 'suffix' on /api/chat" in field.json()["error"]
    assert acting.status_code == 200 and "x-blazar-ignored-options" not in acting.headers
