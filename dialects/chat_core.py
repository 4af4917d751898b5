"""The canonical chat call every dialect shares: an OpenAI-shaped request in, OpenAI-shaped
payloads out (one dict, or an async iterator of chunk dicts), with think stripping and tool-call
enforcement applied once for all dialects.

Tool enforcement: llama-server honours only string `tool_choice` values, and a chat template without
tool support never produces a tool call. When a request forces a call (`tool_choice` "required" or a
named function), Blazar describes the tools in the prompt, constrains the output with a JSON-schema
grammar over `{name, arguments}`, and returns the result as a real tool call: buffered, or streamed
as tool-call deltas.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dialects.wire import SSEParser, ThinkFilter, bridge_reasoning, data_of, strip_think_buffered, thinking_requested
from supervisors.caller import Caller
from supervisors.instance import StreamFailure, UpstreamCall, UpstreamReply, UpstreamStream
from supervisors.refusal import Refusal
from supervisors.relay import buffered, engine_failure, forward
from supervisors.services import Services


class StreamBroken(Exception):
    """The engine broke mid-stream; the message is for the client's error frame."""


@dataclass
class ChatResult:
    """One of: a buffered OpenAI payload, a stream of OpenAI chunk dicts, or (asked for with `raw_stream`)
    the engine's own SSE byte stream with `strip` saying whether think blocks must still be removed."""

    payload: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    stream: UpstreamStream | None = None
    strip: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    queued_secs: float = 0.0


def forced_tool(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool enforcement plan, or None when the engine may answer freely."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return {"tools": tools, "name": None}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if not name:
            raise Refusal(400, "`tool_choice.function.name` is required when tool_choice names a function")
        if name not in {t["function"]["name"] for t in tools}:
            raise Refusal(400, f"`tool_choice` names {name!r}, which is not in `tools` "
                          f"({', '.join(t['function']['name'] for t in tools)})")
        return {"tools": tools, "name": name}
    raise Refusal(400, f"`tool_choice` must be \"auto\", \"none\", \"required\" or "
                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")


def enforce_tools(body: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a request so that the engine must answer with one {name, arguments} object."""
    tools = plan["tools"] if plan["name"] is None else [t for t in plan["tools"]
                                                         if t["function"]["name"] == plan["name"]]
    described = "\n".join(
        f"- {t['function']['name']}: {t['function'].get('description', '')} "
        f"arguments JSON schema: {msgspec.json.encode(t['function'].get('parameters') or {}).decode()}"
        for t in tools)
    instruction = ("You must call exactly one of these functions. Reply with only a JSON object "
                   "{\"name\": <function name>, \"arguments\": <arguments object>}.\nFunctions:\n" + described)
    if len(tools) == 1:
        name_schema: dict[str, Any] = {"const": tools[0]["function"]["name"]}
        arguments_schema = tools[0]["function"].get("parameters") or {"type": "object"}
    else:
        name_schema = {"enum": [t["function"]["name"] for t in tools]}
        arguments_schema = {"type": "object"}
    schema = {"type": "object", "properties": {"name": name_schema, "arguments": arguments_schema},
              "required": ["name", "arguments"]}
    messages = [{"role": "system", "content": instruction}, *_plain_messages(body["messages"])]
    rewritten = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
    rewritten.update(messages=messages, stream=False,
                     response_format={"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}})
    return rewritten


def _plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier tool calls and results as plain text, for templates that know nothing of tools."""
    out = []
    for message in messages:
        if message.get("role") == "tool":
            out.append({"role": "user", "content": f"Result of {message.get('name') or 'the function'}: "
                        f"{message.get('content')}"})
        elif message.get("tool_calls"):
            calls = "; ".join(f"{c['function']['name']}({c['function'].get('arguments')})"
                              for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (message.get("content") or "") + f"[called {calls}]"})
        else:
            out.append(message)
    return out


def tool_call_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """The engine's constrained JSON answer -> an OpenAI tool call."""
    choice = (payload.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    if choice.get("finish_reason") == "length":
        spent = (payload.get("usage") or {}).get("completion_tokens")
        raise Refusal(400, f"the forced tool call was cut off by the request's token limit after {spent} tokens, "
                      f"in the middle of its arguments: {text[-120:]!r}",
                      fix="raise max_tokens (or max_completion_tokens) so the whole call fits; a call with a "
                           "few short arguments needs about 64", code="tool_call_truncated")
    try:
        decided = msgspec.json.decode(text)
        name, arguments = decided["name"], decided["arguments"]
    except (msgspec.DecodeError, KeyError, TypeError):
        raise Refusal(502, f"the engine did not produce a valid tool call under the grammar: {text[:300]!r}") from None
    call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": msgspec.json.encode(arguments).decode()}}
    choice = {"index": 0, "finish_reason": "tool_calls",
              "message": {"role": "assistant", "content": None, "tool_calls": [call]}}
    return {**payload, "choices": [choice]}


async def tool_call_chunks(payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A buffered tool call replayed as OpenAI stream chunks (arguments in pieces)."""
    base = {"id": payload.get("id", f"chatcmpl-{secrets.token_hex(8)}"), "object": "chat.completion.chunk",
            "created": payload.get("created", int(time.time())), "model": payload.get("model")}
    call = payload["choices"][0]["message"]["tool_calls"][0]
    arguments = call["function"]["arguments"]
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
    yield {**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
        {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                          "arguments": ""}}]}}]}
    for start in range(0, len(arguments), 16):
        yield {**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": arguments[start:start + 16]}}]}}]}
    yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
           "usage": payload.get("usage"), "timings": payload.get("timings")}


async def run_chat(services: Services, body: dict[str, Any], who: Caller, *, keep_alive: float | None = None,
                   num_ctx: int | None = None, spawn_options: dict[str, Any] | None = None, choices: int = 1,
                   raw_stream: bool = False) -> ChatResult:
    """`body` is an OpenAI chat request with `model` and `messages` already validated. With `raw_stream`
    a stream comes back as the engine's bytes (the OpenAI route relays them without parsing twice)."""
    model = body["model"]
    strip = not thinking_requested(body)
    body = bridge_reasoning(body)
    plan = forced_tool(body)
    stream = body.get("stream") is True
    if plan is not None:
        rewritten = enforce_tools(body, plan)
        reply = buffered(await forward(services, model, UpstreamCall(method="POST", path="/v1/chat/completions",
                                                                     body=msgspec.json.encode(rewritten), stream=False,
                                                                     content_type="application/json"), who,
                                       keep_alive=keep_alive, num_ctx=num_ctx, spawn_options=spawn_options))
        if reply.status >= 400:
            raise engine_failure(reply)
        payload = tool_call_payload(msgspec.json.decode(reply.body))
        result_headers = {"x-blazar-structured-output": "json_schema", "x-blazar-tool-enforcement": "grammar"}
        if stream:
            return ChatResult(chunks=tool_call_chunks(payload), headers=result_headers, queued_secs=reply.queued_secs)
        return ChatResult(payload=payload, headers=result_headers, queued_secs=reply.queued_secs)
    if stream and not raw_stream:
        body = {**body, "stream_options": {"include_usage": True, **(body.get("stream_options") or {})}}
    result = await forward(services, model, UpstreamCall(method="POST", path="/v1/chat/completions",
                                                        body=msgspec.json.encode(body), stream=stream,
                                                        content_type="application/json"), who, keep_alive=keep_alive,
                           num_ctx=num_ctx, spawn_options=spawn_options, choices=choices)
    return completion_result(result, strip=strip, raw_stream=raw_stream)


def completion_result(result: UpstreamReply | UpstreamStream, *, strip: bool, raw_stream: bool = False) -> ChatResult:
    """An engine's chat or completion answer as a ChatResult (an engine error raises its Refusal)."""
    if isinstance(result, UpstreamReply):
        if result.status >= 400:
            raise engine_failure(result)
        payload = msgspec.json.decode(result.body)
        return ChatResult(payload=strip_think_buffered(payload) if strip else payload, queued_secs=result.queued_secs)
    if raw_stream:
        return ChatResult(stream=result, strip=strip, queued_secs=result.queued_secs)
    return ChatResult(chunks=_chunks(result, strip), queued_secs=result.queued_secs)


async def _chunks(stream: Any, strip: bool) -> AsyncIterator[dict[str, Any]]:
    parser = SSEParser()
    filters: dict[int, ThinkFilter] = {}
    with stream.chunks:
        async for item in stream.chunks:
            if isinstance(item, StreamFailure):
                raise StreamBroken(item.message)
            for event in parser.feed(item.data):
                data = data_of(event)
                if data is None or data == b"[DONE]":
                    continue
                chunk = msgspec.json.decode(data)
                if strip:
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if isinstance(delta.get("content"), str):
                            delta["content"] = filters.setdefault(choice.get("index", 0), ThinkFilter()).feed(
                                delta["content"])
                yield chunk


class ToolCallAccumulator:
    """Joins streamed OpenAI tool-call deltas into whole calls, by index, exactly."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            call = self.calls.setdefault(delta.get("index", 0), {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id") or call["id"]
            function = delta.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""

    def finished(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]
