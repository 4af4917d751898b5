"""Anthropic Messages routes: `/v1/messages` (buffered and SSE) and `/v1/messages/count_tokens`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from quart import Blueprint, Response

from dialects.chat_core import StreamBroken
from dialects.current import current_services
from dialects.edge import caller, json_body, refuse
from dialects.roles import Role, role
from dialects.session import chat_session
from dialects.wire import RequestError
from supervisors.refusal import Refusal
from supervisors.relay import count_input_tokens

from . import translate as t

blueprint = Blueprint("anthropic", __name__)



@blueprint.post("/v1/messages")
@role(Role.KEY)
async def messages():
    try:
        body = await json_body()
        canonical = t.to_openai(body)
        result = await chat_session(current_services(), canonical, caller())
    except (RequestError, Refusal) as error:
        return refuse(error)
    model = canonical["model"]
    if result.payload is not None:
        return Response(msgspec.json.encode(t.from_openai(result.payload, model, body.get("stop_sequences"))),
                        content_type="application/json", headers=result.headers)
    assert result.chunks is not None  # not buffered and not raw_stream: a stream of chunk dicts
    response = Response(_events(model, result.chunks), content_type="text/event-stream",
                        headers={"cache-control": "no-cache", **result.headers})
    response.timeout = None
    return response


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **payload}) + b"\n\n"


async def _events(model: str, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """OpenAI chunks -> Anthropic's exact event sequence, blocks opened and closed in order."""
    import secrets

    yield _sse("message_start", {"message": {
        "id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0}}})
    yield _sse("ping", {})
    index = -1
    open_kind: str | None = None
    tool_slots: dict[int, int] = {}  # OpenAI tool-call index -> Anthropic block index
    finish = None
    final: dict[str, Any] = {}

    def close() -> bytes:
        nonlocal open_kind
        frame = _sse("content_block_stop", {"index": index}) if open_kind else b""
        open_kind = None
        return frame

    try:
        async for chunk in chunks:
            if chunk.get("usage") or chunk.get("timings"):
                final = chunk
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                delta = choice.get("delta") or {}
                thinking = delta.get("reasoning_content")
                if thinking:
                    if open_kind != "thinking":
                        yield close()
                        index += 1
                        open_kind = "thinking"
                        yield _sse("content_block_start", {"index": index, "content_block": {
                            "type": "thinking", "thinking": "", "signature": ""}})
                    yield _sse("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                 "thinking": thinking}})
                text = delta.get("content")
                if text:
                    if open_kind != "text":
                        yield close()
                        index += 1
                        open_kind = "text"
                        yield _sse("content_block_start", {"index": index, "content_block": {"type": "text",
                                                                                             "text": ""}})
                    yield _sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})
                for call in delta.get("tool_calls") or []:
                    slot = call.get("index", 0)
                    if slot not in tool_slots:
                        yield close()
                        index += 1
                        tool_slots[slot] = index
                        open_kind = "tool_use"
                        yield _sse("content_block_start", {"index": index, "content_block": {
                            "type": "tool_use", "id": t._tool_id(call.get("id")),
                            "name": (call.get("function") or {}).get("name") or "", "input": {}}})
                    pieces = (call.get("function") or {}).get("arguments")
                    if pieces:
                        yield _sse("content_block_delta", {"index": tool_slots[slot], "delta": {
                            "type": "input_json_delta", "partial_json": pieces}})
    except StreamBroken as error:
        yield close()
        yield _sse("error", {"error": {"type": "api_error", "message": str(error)}})
        return
    yield close()
    usage = t.usage_of(final)
    yield _sse("message_delta", {"delta": {"stop_reason": t.STOP_REASONS.get(finish, "end_turn"),
                                           "stop_sequence": None}, "usage": usage})
    yield _sse("message_stop", {})


@blueprint.post("/v1/messages/count_tokens")
@role(Role.KEY)
async def count_tokens():
    try:
        body = await json_body()
        canonical = t.to_openai({**body, "max_tokens": body.get("max_tokens") or 1})
        template = {"messages": canonical["messages"], **({"tools": canonical["tools"]} if "tools" in canonical
                                                          else {})}
        count = await count_input_tokens(current_services(), canonical["model"], template, caller())
    except (RequestError, Refusal) as error:
        return refuse(error)
    return Response(msgspec.json.encode({"input_tokens": count}), content_type="application/json")
