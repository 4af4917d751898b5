"""Table-driven tests of the Ollama and Anthropic translation functions (pure, no I/O)."""

from __future__ import annotations

import pytest

from dialects.anthropic import translate as anthropic
from dialects.chat_core import ToolCallAccumulator, enforce_tools, forced_tool, tool_call_payload
from dialects.ollama import translate as ollama
from dialects.wire import RequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(("options", "fields", "num_ctx", "spawn", "ignored"), [
    (None, {}, None, None, []),
    ({"temperature": 0.2, "num_predict": 5, "stop": ["x"], "seed": 7}, {"temperature": 0.2, "max_tokens": 5,
                                                                        "stop": ["x"], "seed": 7}, None, None, []),
    ({"num_ctx": 2048, "top_k": 3}, {"top_k": 3}, 2048, None, []),
    ({"repeat_penalty": 1.1, "num_thread": 2}, {"repeat_penalty": 1.1}, None, {"num_thread": 2}, []),
    # what LangChain's ChatOllama/OllamaEmbeddings send: tfs_z is served and reported, not refused
    ({"temperature": 0.5, "tfs_z": 1.0, "penalize_newline": True, "mirostat": 0}, {"temperature": 0.5, "mirostat": 0},
     None, None, ["tfs_z", "penalize_newline"]),
    ({"temprature": 1, "top_k": 40.0}, {"top_k": 40}, None, None, ["temprature"]),  # a typo is served, and named
    ({"seed": None, "stop": "END", "tfs_z": None}, {"stop": "END"}, None, None, []),  # null means unset
])
def test_ollama_options(options, fields, num_ctx, spawn, ignored):
    read = ollama.read_options(options)
    assert (read.fields, read.num_ctx, read.spawn, read.ignored) == (fields, num_ctx, spawn, ignored)


def test_ollama_embeddings_report_sampling_options_as_unused():
    read = ollama.read_options({"temperature": 0.1, "tfs_z": 1, "num_ctx": 1024}, sampling=False)
    assert read.fields == {} and read.num_ctx == 1024 and read.ignored == ["temperature", "tfs_z"]


@pytest.mark.parametrize(("options", "strict", "message"), [
    ([1], False, "must be an object"),
    ({"num_ctx": 5}, False, "≥ 128"),
    ({"temperature": "hot"}, False, "options.temperature must be a number, got 'hot'"),
    ({"top_k": 2.5}, False, "options.top_k must be a whole number"),
    ({"seed": True}, False, "options.seed must be a whole number"),
    ({"stop": [1]}, False, "options.stop must be a string or an array of strings"),
    ({"temprature": 1}, True, "unknown option 'temprature'.*ollama_strict_options = true.*Accepted: .*temperature"),
    ({"tfs_z": 1}, True, "option 'tfs_z' \\(no effect on llama-server\\).*ollama_strict_options"),
])
def test_ollama_bad_options_teach(options, strict, message):
    with pytest.raises(RequestError, match=message):
        ollama.read_options(options, strict=strict)


def test_unknown_top_level_fields_are_reported_or_refused_when_strict():
    body = {"model": "m", "prompt": "p", "suffix": "s", "context": [1, 2]}
    assert ollama.ignored_fields("generate", body) == ["suffix", "context"]
    assert ollama.ignored_fields("chat", {"model": "m", "messages": [], "stream": False}) == []
    with pytest.raises(RequestError, match="unknown fields 'suffix', 'context' on /api/generate; accepted: "):
        ollama.ignored_fields("generate", body, strict=True)


@pytest.mark.parametrize(("fmt", "expected"), [
    (None, None), ("json", {"type": "json_object"}),
    ({"type": "object"}, {"type": "json_schema", "json_schema": {"name": "format", "schema": {"type": "object"}}}),
])
def test_ollama_format(fmt, expected):
    assert ollama.format_to_response_format(fmt) == expected


def test_ollama_messages_images_tools_and_tool_name():
    converted = ollama.chat_messages([
        {"role": "user", "content": "look", "images": ["aGVsbG8="]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_name": "f"},
        {"role": "tool", "content": "43", "tool_name": "f", "name": "explicit"},
    ])
    assert converted[0]["content"] == [{"type": "text", "text": "look"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]
    assert converted[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert converted[2]["name"] == "f" and converted[3]["name"] == "explicit"


@pytest.mark.parametrize(("think", "fields"), [
    (None, {}), (True, {"think": True, "chat_template_kwargs": {"enable_thinking": True}}),
    (False, {"think": False, "chat_template_kwargs": {"enable_thinking": False}}),
    ("high", {"reasoning_effort": "high", "think": True}),
])
def test_ollama_think(think, fields):
    assert ollama.thinking_fields(think) == fields


def test_ollama_generate_builds_system_and_user_messages():
    body = {"model": "m", "prompt": "p", "system": "s", "stream": False, "options": {"num_ctx": 512, "top_k": 4}}
    request = ollama.canonical_generate(body, ollama.read_options(body["options"]))
    assert request["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    assert request["stream"] is False and request["top_k"] == 4


def test_ollama_tool_calls_from_openai():
    assert ollama.ollama_tool_calls([{"function": {"name": "f", "arguments": '{"a": 1}'}}]) == [
        {"function": {"name": "f", "arguments": {"a": 1}}}]


def test_anthropic_request_translation():
    request = anthropic.to_openai({
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "be brief"}], "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {
                "type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}})
    assert request["messages"][0] == {"role": "system", "content": "be brief"}
    assert request["messages"][1]["content"][1]["image_url"]["url"] == "data:image/jpeg;base64,AAAA"
    assert request["messages"][2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":1}'}
    assert request["messages"][2]["reasoning_content"] == "hmm"
    assert request["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "done"}
    assert request["tool_choice"] == "required" and request["stop"] == ["END"]


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_anthropic_tool_choice(choice, expected):
    assert anthropic.tool_choice_to_openai(choice) == expected


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "non-empty"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "user"),
    ({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 10}}, "must be greater than"),
    ({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f"}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_anthropic_bad_requests_teach(body, message):
    with pytest.raises(RequestError, match=message.replace(".", r"\.")):
        anthropic.to_openai(body)


def test_anthropic_response_translation():
    message = anthropic.from_openai({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "ok", "reasoning_content": "because", "tool_calls": [
            {"id": "call_abc", "function": {"name": "f", "arguments": '{"x": 2}'}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}},
        "m", None)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2] == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"x": 2}}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 9, "output_tokens": 4, "cache_read_input_tokens": 6,
                                "cache_creation_input_tokens": 0}


def test_tool_enforcement_plan_and_grammar():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    plan = forced_tool(body)
    rewritten = enforce_tools(body, plan)
    schema = rewritten["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert "tools" not in rewritten and rewritten["messages"][0]["role"] == "system"
    assert forced_tool({**body, "tool_choice": "auto"}) is None
    answer = '{"name": "get_weather", "arguments": {"city": "P"}}'
    call = tool_call_payload({"choices": [{"message": {"content": answer}}]})
    assert call["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                          "arguments": '{"city":"P"}'}


def test_streamed_tool_call_arguments_accumulate_exactly():
    accumulator = ToolCallAccumulator()
    accumulator.feed([{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}])
    for piece in ['{"ci', 'ty": "Pa', 'ris"}']:
        accumulator.feed([{"index": 0, "function": {"arguments": piece}}])
    accumulator.feed([{"index": 1, "id": "call_2", "function": {"name": "g", "arguments": "{}"}}])
    assert accumulator.finished() == [{"id": "call_1", "name": "f", "arguments": '{"city": "Paris"}'},
                                      {"id": "call_2", "name": "g", "arguments": "{}"}]
