"""Modelfile TEMPLATE and SYSTEM through the real llama-server: models made with `blazar create` from a
Modelfile, asked at temperature 0 beside the plain model. A Jinja TEMPLATE reaches the engine as
`--chat-template-file` and changes the prompt it builds (its token count and the answer); a SYSTEM reaches
the engine as the system message of a request that has none: the engine's prompt and answer are the same as
the plain model's given that system message. (ADAPTER is proven only on the labelled fake, in
tests/test_lane_settings.py: there is no LoRA fixture for SmolLM2 yet.)"""

from __future__ import annotations

import pytest
import trio

from blazar.paths import Paths
from tests.conftest import arun_cli, start_gateway
from tests.lane_fixtures import add_shared_model, register_engine

pytestmark = pytest.mark.engine

# No chat markup at all: the engine's prompt is the messages' text, one after another.
RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
COUNTING = "1, 2, 3, 4, 5, 6,"
PERSONA = "You are a lighthouse keeper named Ada. You answer every question in one short sentence."


@pytest.fixture
def created_home(home: Paths, tmp_path, shared_home, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


async def create(tmp_path, name: str, modelfile: str) -> None:
    path = tmp_path / f"{name}.Modelfile"
    path.write_text(modelfile)
    made = await arun_cli("create", name, "-f", str(path))
    assert made.returncode == 0, made.stderr


async def ask(client, model: str, messages: list[dict], max_tokens: int = 12) -> dict:
    reply = await client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                            "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_a_jinja_template_is_the_prompt_the_engine_builds(nursery, created_home, tmp_path):
    await create(tmp_path, "raw:1", f'FROM smollm2:135m\nTEMPLATE """{RAW_TEMPLATE}"""\n')
    gateway = await start_gateway(nursery, created_home)
    user = [{"role": "user", "content": COUNTING}]
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            raw = await ask(client, "raw:1", user)
            plain = await ask(client, "smollm2:135m", user)
            tokens = (await client.post("/tokenize", json={"content": COUNTING},
                                        headers={"x-blazar-model": "raw:1"})).json()["tokens"]
            card = (await client.get("/api/explain/raw:1")).json()
    # The template's prompt is the message's text and nothing else: exactly its tokens.
    assert raw["usage"]["prompt_tokens"] == len(tokens)
    # The GGUF's own template wraps it in chat markup and a default system prompt.
    assert plain["usage"]["prompt_tokens"] > len(tokens) + 10
    # With no markup the model just continues the count; as a chat assistant it does not.
    continued = raw["choices"][0]["message"]["content"]
    assert continued.lstrip().startswith("7"), continued
    assert continued != plain["choices"][0]["message"]["content"]
    assert card["chat_template"].endswith(".jinja")


async def test_a_modelfile_system_is_the_system_message_the_engine_receives(nursery, created_home, tmp_path):
    await create(tmp_path, "ada:1", f'FROM smollm2:135m\nSYSTEM """{PERSONA}"""\n')
    gateway = await start_gateway(nursery, created_home)
    question = [{"role": "user", "content": "What is your name?"}]
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            persona = await ask(client, "ada:1", question, max_tokens=24)
            told = await ask(client, "smollm2:135m", [{"role": "system", "content": PERSONA}, *question],
                             max_tokens=24)
            plain = await ask(client, "smollm2:135m", question, max_tokens=24)
            own = await ask(client, "ada:1", [{"role": "system", "content": "You are a pirate."}, *question],
                            max_tokens=24)
            pirate = await ask(client, "smollm2:135m", [{"role": "system", "content": "You are a pirate."},
                                                        *question], max_tokens=24)
    # The engine received the same prompt as the plain model given that system message, word for word.
    assert persona["usage"]["prompt_tokens"] == told["usage"]["prompt_tokens"]
    assert persona["choices"][0]["message"]["content"] == told["choices"][0]["message"]["content"]
    assert persona["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"]  # it is not the GGUF's default
    # A request's own system message wins over the Modelfile's.
    assert own["usage"]["prompt_tokens"] == pirate["usage"]["prompt_tokens"]
    assert own["choices"][0]["message"]["content"] == pirate["choices"][0]["message"]["content"]
