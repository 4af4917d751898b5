"""The official clients against the live gateway (real llama-server on SmolLM2): each SDK parses
every response, and the same question gets the same answer in every dialect."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
import trio

from tests.fakehub import make_gguf, start_fake_hub

pytestmark = pytest.mark.engine

MODEL = "smollm2:135m"
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # this SDK version has no temperature argument: sent as an extra body field
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def run(function):
    return trio.to_thread.run_sync(function)


async def test_openai_sdk(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    with trio.fail_after(120):
        answer = await run(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0))
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0

        def stream() -> str:
            pieces = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=12, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)

        assert await run(stream) == answer.choices[0].message.content

        forced = await run(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}], temperature=0,
            tools=[{"type": "function", "function": WEATHER}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        call = forced.choices[0].message.tool_calls[0]
        assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)

        def streamed_tool() -> tuple[str, str]:
            name, arguments = "", ""
            for chunk in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                    temperature=0, tools=[{"type": "function", "function": WEATHER}], tool_choice="required",
                    stream=True):
                for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    name += delta.function.name or ""
                    arguments += delta.function.arguments or ""
            return name, arguments

        name, arguments = await run(streamed_tool)
        assert name == "get_weather" and json.loads(arguments) == json.loads(call.function.arguments)

        vectors = await run(lambda: client.embeddings.create(model=MODEL, input=["hello", "world"]))
        assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 576
        models = await run(lambda: client.models.list())
        assert MODEL in [m.id for m in models.data]
        with pytest.raises(openai.BadRequestError, match="from 1 to 8"):
            await run(lambda: client.chat.completions.create(model=MODEL, n=9,
                                                             messages=[{"role": "user", "content": "x"}]))


async def test_anthropic_sdk(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    with trio.fail_after(120):
        answer = await run(lambda: client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                                          messages=messages))
        assert answer.type == "message" and answer.content[0].type == "text" and answer.content[0].text
        assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0
        assert answer.stop_reason in ("end_turn", "max_tokens")

        def stream():
            with client.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=messages) as events:
                kinds = [event.type for event in events]
                return kinds, events.get_final_message()

        kinds, final = await run(stream)
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
        assert final.content[0].text == answer.content[0].text
        assert final.usage.output_tokens > 0

        tools = [{"name": WEATHER["name"], "description": WEATHER["description"],
                  "input_schema": WEATHER["parameters"]}]
        ask = [{"role": "user", "content": "What's the weather in Paris?"}]
        forced = await run(lambda: client.messages.create(
            model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"}))
        use = next(block for block in forced.content if block.type == "tool_use")
        assert forced.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)

        def streamed_tool():
            with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=tools,
                                        tool_choice={"type": "any"}) as events:
                return events.get_final_message()

        streamed = await run(streamed_tool)
        streamed_use = next(block for block in streamed.content if block.type == "tool_use")
        assert streamed_use.input == use.input  # the input_json_delta pieces added up exactly

        # A tool result in the next turn is accepted and answered.
        turns = [*ask, {"role": "assistant", "content": forced.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "Sunny, 24 C"}]}]
        followup = await run(lambda: client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, tools=tools,
                                                            messages=turns))
        assert followup.content

        counted = await run(lambda: client.messages.count_tokens(model=MODEL, messages=messages))
        assert counted.input_tokens > 5
        with pytest.raises(anthropic.BadRequestError, match=r"must be greater than `thinking\.budget_tokens`"):
            await run(lambda: client.messages.create(model=MODEL, max_tokens=100, messages=messages,
                                                     thinking={"type": "enabled", "budget_tokens": 1024}))
        with pytest.raises(anthropic.BadRequestError, match=r"tool_choice\.name"):
            await run(lambda: client.messages.create(model=MODEL, max_tokens=10, messages=messages, tools=tools,
                                                     tool_choice={"type": "tool", "name": ""}))


async def test_ollama_client(live, nursery, tmp_path, monkeypatch):
    hub = await start_fake_hub(nursery)
    hub.add("TinyOrg/Tiny-GGUF", make_gguf(tmp_path / "tiny.Q8_0.gguf", payload_mib=0.2))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    client = ollama.Client(host=live.url)
    with trio.fail_after(120):
        answer = await run(lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                               options={"temperature": 0, "num_predict": 12}))
        assert answer.done and answer.message.content and answer.eval_count > 0 and answer.total_duration > 0

        def stream() -> str:
            parts = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], stream=True,
                                options={"temperature": 0, "num_predict": 12})
            return "".join(p.message.content for p in parts)

        assert await run(stream) == answer.message.content
        generated = await run(lambda: client.generate(model=MODEL, prompt=QUESTION,
                                                      options={"temperature": 0, "num_predict": 12}))
        assert generated.response == answer.message.content
        raw = await run(lambda: client.generate(model=MODEL, prompt="One, two, three,", raw=True,
                                                options={"temperature": 0, "num_predict": 6}))
        assert raw.response.strip() and raw.done
        assert MODEL in [m.model for m in (await run(client.list)).models]
        shown = await run(lambda: client.show(MODEL))
        assert shown.capabilities == ["completion"] and shown.details.quantization_level == "Q4_1"
        assert [m.model for m in (await run(client.ps)).models] == [MODEL]
        embedded = await run(lambda: client.embed(model=MODEL, input=["a", "b"]))
        assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 576
        progress = await run(lambda: [p.status for p in client.pull("TinyOrg/Tiny-GGUF:Q8_0", stream=True)])
        assert progress[0] == "pulling manifest" and progress[-1] == "success"
        async with live.client() as http:  # an HTTP pull is a job: it shows in /v1/jobs
            [pulled] = (await http.get("/v1/jobs", params={"kind": "pull"})).json()["data"]
        assert pulled["status"] == "completed" and pulled["model"] == "TinyOrg/Tiny-GGUF:Q8_0"
        await run(lambda: client.copy(MODEL, "mine:copy"))
        await run(lambda: client.delete("mine:copy"))
        assert "mine:copy" not in [m.model for m in (await run(client.list)).models]
        await run(lambda: client.chat(model=MODEL, messages=[], keep_alive=0))
        assert (await run(client.ps)).models == []
        with pytest.raises(ollama.ResponseError, match="not installed"):
            await run(lambda: client.chat(model="nope:1", messages=[{"role": "user", "content": "x"}]))


async def test_the_same_question_gets_the_same_answer_in_every_dialect(live):
    question = [{"role": "user", "content": QUESTION}]
    with trio.fail_after(120):
        async with live.client() as http:
            openai_text = (await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": question, "max_tokens": 12, "temperature": 0})).json()[
                "choices"][0]["message"]["content"]
            anthropic_text = (await http.post("/v1/messages", json={
                "model": MODEL, "messages": question, "max_tokens": 12, "temperature": 0})).json()["content"][0]["text"]
            ollama_text = (await http.post("/api/chat", json={
                "model": MODEL, "messages": question, "stream": False,
                "options": {"num_predict": 12, "temperature": 0}})).json()["message"]["content"]
            tools_openai = (await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": question, "temperature": 0, "tools": [{"type": "function",
                                                                                   "function": WEATHER}],
                "tool_choice": "required"})).json()["choices"][0]["message"]["tool_calls"][0]["function"]
            tools_anthropic = next(b for b in (await http.post("/v1/messages", json={
                "model": MODEL, "messages": question, "max_tokens": 64, "temperature": 0,
                "tools": [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"],
                           "description": WEATHER["description"]}],
                "tool_choice": {"type": "any"}})).json()["content"] if b["type"] == "tool_use")
    assert openai_text == anthropic_text == ollama_text
    assert tools_openai["name"] == tools_anthropic["name"] == "get_weather"
    assert json.loads(tools_openai["arguments"]) == tools_anthropic["input"]

