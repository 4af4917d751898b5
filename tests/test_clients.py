"""Third-party clients people already point at Ollama- and OpenAI-compatible servers, unmodified, against the
live gateway (real llama-server on SmolLM2), through each dialect they speak. Each check asserts what a user
of that library sees: text, vector length, a parsed object, tool arguments. Versions are pinned in the test
extras and recorded in docs/clients.md."""

from __future__ import annotations

import logging

import pytest
import trio
from pydantic import BaseModel, Field

pytestmark = pytest.mark.engine

MODEL = "smollm2:135m"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=24)


def run(function):
    return trio.to_thread.run_sync(function)


async def assert_forced_weather_call(chat) -> None:
    message = await run(lambda: chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke(
        "What's the weather in Paris?"))
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str) and call["args"]["city"]


async def test_langchain_ollama_embeddings_with_the_options_langchain_sends(live, caplog):
    """The reported failure: OllamaEmbeddings sends tfs_z; Ollama serves it, and so does Blazar now."""
    from langchain_ollama import OllamaEmbeddings

    embeddings = OllamaEmbeddings(model=MODEL, base_url=live.url, tfs_z=1.0, temperature=0.1, num_ctx=2048)
    with trio.fail_after(120), caplog.at_level(logging.WARNING, logger="blazar.ollama"):
        vector = await run(lambda: embeddings.embed_query("The sea is blue."))
        documents = await run(lambda: embeddings.embed_documents(["red", "green", "blue"]))
        again = await run(lambda: embeddings.embed_query("The sea is blue."))
    assert len(vector) == 576 and all(isinstance(x, float) for x in vector)
    assert len(documents) == 3 and all(len(d) == 576 for d in documents)
    assert again == pytest.approx(vector)
    unused = [r.getMessage() for r in caplog.records if "served without it" in r.getMessage()]
    assert sorted(w.split("'")[1] for w in unused) == ["temperature", "tfs_z"]  # once each, not per call


async def test_langchain_chat_ollama(live):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama

    chat = ChatOllama(model=MODEL, base_url=live.url, temperature=0, num_predict=24, tfs_z=1.0)
    with trio.fail_after(180):
        answer = await run(lambda: chat.invoke("What is the capital of France?"))
        assert isinstance(answer.content, str) and answer.content.strip()
        assert 0 < answer.usage_metadata["output_tokens"] <= 24  # num_predict acts

        streamed = await run(lambda: [c.content for c in chat.stream("What is the capital of France?")])
        assert len(streamed) > 2 and "".join(streamed) == answer.content

        structured = ChatOllama(model=MODEL, base_url=live.url, temperature=0, num_predict=64)
        city = await run(lambda: structured.with_structured_output(City, method="json_schema").invoke(
            "Name a city in Italy."))
        assert isinstance(city, City) and city.name.strip()

        # Ollama's API has no tool_choice (ChatOllama ignores it), so a tool round trip is checked instead:
        # the call and its result in the history reach the model, and it answers from them.
        history = [HumanMessage("What's the weather in Paris?"),
                   AIMessage("", tool_calls=[{"name": "GetWeather", "args": {"city": "Paris"}, "id": "call_1"}]),
                   ToolMessage("Sunny, 24 degrees.", tool_call_id="call_1")]
        after_tool = await run(lambda: chat.bind_tools([GetWeather]).invoke(history))
        assert isinstance(after_tool.content, str) and after_tool.content.strip()


async def test_langchain_chat_openai(live):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{live.url}/v1", api_key="unused", temperature=0, max_tokens=24,
                      max_retries=0)
    with trio.fail_after(180):
        answer = await run(lambda: chat.invoke("What is the capital of France?"))
        assert isinstance(answer.content, str) and answer.content.strip()
        streamed = await run(lambda: [c.content for c in chat.stream("What is the capital of France?")])
        assert "".join(streamed) == answer.content

        bigger = ChatOpenAI(model=MODEL, base_url=f"{live.url}/v1", api_key="unused", temperature=0, max_tokens=64,
                            max_retries=0)
        city = await run(lambda: bigger.with_structured_output(City).invoke("Name a city in Italy."))  # json_schema
        assert isinstance(city, City) and city.name.strip()

        await assert_forced_weather_call(bigger)

        # A forced call that cannot fit the token limit is a teaching error, not a broken tool call.
        import openai

        with pytest.raises(openai.BadRequestError) as refused:
            await run(lambda: chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke(
                "What's the weather in Paris?"))
        assert "cut off by the request's token limit" in refused.value.body["message"]
        assert refused.value.body["hint"].startswith("raise max_tokens")


async def test_langchain_chat_anthropic(live):
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(model=MODEL, base_url=live.url, api_key="unused", temperature=0, max_tokens=24,
                         max_retries=0)
    with trio.fail_after(180):
        answer = await run(lambda: chat.invoke("What is the capital of France?"))
        assert isinstance(answer.content, str) and answer.content.strip()
        streamed = await run(lambda: [c.text for c in chat.stream("What is the capital of France?")])
        assert "".join(streamed) == answer.content

        bigger = ChatAnthropic(model=MODEL, base_url=live.url, api_key="unused", temperature=0, max_tokens=64,
                               max_retries=0)
        city = await run(lambda: bigger.with_structured_output(City).invoke("Name a city in Italy."))
        assert isinstance(city, City) and city.name.strip()

        await assert_forced_weather_call(bigger)


async def test_instructor_over_the_openai_dialect(live):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    with trio.fail_after(120):
        city = await run(lambda: client.chat.completions.create(
            model=MODEL, response_model=City, max_tokens=64, temperature=0, max_retries=0,
            messages=[{"role": "user", "content": "Name a city in Italy."}]))
    assert isinstance(city, City) and city.name.strip()


async def test_pydantic_ai_agent_over_the_openai_dialect(live):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{live.url}/v1", api_key="unused"))
    text_agent = Agent(model, model_settings={"max_tokens": 24, "temperature": 0})
    city_agent = Agent(model, output_type=City, model_settings={"max_tokens": 64, "temperature": 0}, retries=0)
    with trio.fail_after(120):
        text = await run(lambda: text_agent.run_sync("What is the capital of France?").output)
        city = await run(lambda: city_agent.run_sync("Name a city in Italy.").output)
    assert isinstance(text, str) and text.strip()
    assert isinstance(city, City) and city.name.strip()
