"""OpenAI-compatible routes: decode, validate, forward, relay."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, current_app, request

from blazar.relay import Refusal, forward, json_reply, sse_response
from supervisors.instance import UpstreamCall, UpstreamReply

from .translate import (
    ChatStreamRewriter,
    RequestError,
    bridge_reasoning,
    check_chat,
    check_choices,
    decode_object,
    require_model,
    strip_think_buffered,
    structured_output_receipt,
    thinking_requested,
)

blueprint = Blueprint("openai", __name__)


def openai_error_frame(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "engine_error", "code": 502}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\ndata: [DONE]\n\n"


async def _body() -> dict[str, Any]:
    try:
        return decode_object(await request.get_data())
    except RequestError as error:
        raise Refusal(400, error.message) from None


def _refuse(error: RequestError | Refusal) -> Response:
    if isinstance(error, RequestError):
        error = Refusal(error.status, error.message)
    return error.response(request.path)


@blueprint.post("/v1/chat/completions")
async def chat_completions():
    try:
        body = await _body()
        model = require_model(body)
        check_chat(body)
        check_choices(body)
        strip = not thinking_requested(body)
        body = bridge_reasoning(body)
        headers = {}
        receipt = structured_output_receipt(body)
        if receipt:
            headers["x-blazar-structured-output"] = receipt
        stream = body.get("stream") is True
        result = await forward(current_app.services, model, UpstreamCall(
            path="/v1/chat/completions", body=msgspec.json.encode(body), stream=stream), request.headers)
        if isinstance(result, UpstreamReply):
            return json_reply(result, strip_think_buffered if strip else None, headers)
        rewriter = ChatStreamRewriter(strip_think=strip)
        return sse_response(result, rewriter.feed, openai_error_frame, headers)
    except (RequestError, Refusal) as error:
        return _refuse(error)


async def _passthrough(path: str, *, needs_model: bool = True, stream_ok: bool = True):
    try:
        body = await _body()
        model = require_model(body)
        if "n" in body:
            check_choices(body)
        stream = stream_ok and body.get("stream") is True
        result = await forward(current_app.services, model, UpstreamCall(
            path=path, body=msgspec.json.encode(body), stream=stream), request.headers)
        if isinstance(result, UpstreamReply):
            return json_reply(result)
        rewriter = ChatStreamRewriter(strip_think=False)
        return sse_response(result, rewriter.feed, openai_error_frame)
    except (RequestError, Refusal) as error:
        return _refuse(error)


@blueprint.post("/v1/completions")
async def completions():
    return await _passthrough("/v1/completions")


@blueprint.post("/v1/embeddings")
async def embeddings():
    return await _passthrough("/v1/embeddings", stream_ok=False)


@blueprint.post("/v1/rerank")
@blueprint.post("/v1/reranking")
async def rerank():
    return await _passthrough("/v1/rerank", stream_ok=False)


@blueprint.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens():
    try:
        body = await _body()
        model = require_model(body)
        check_chat(body)
        return await _count_tokens(model, {"messages": body["messages"], **(
            {"tools": body["tools"]} if "tools" in body else {})})
    except (RequestError, Refusal) as error:
        return _refuse(error)


@blueprint.post("/v1/responses/input_tokens")
@blueprint.post("/responses/input_tokens")
async def responses_input_tokens():
    try:
        body = await _body()
        model = require_model(body)
        items = body.get("input")
        if isinstance(items, str):
            messages = [{"role": "user", "content": items}]
        elif isinstance(items, list) and items:
            messages = [{"role": i.get("role", "user"), "content": i.get("content", "")} for i in items
                        if isinstance(i, dict)]
        else:
            raise RequestError("`input` must be a string or a non-empty array of messages", param="input")
        if isinstance(body.get("instructions"), str):
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        return await _count_tokens(model, {"messages": messages})
    except (RequestError, Refusal) as error:
        return _refuse(error)


async def _count_tokens(model: str, template_body: dict[str, Any]) -> Response:
    services = current_app.services
    applied = await forward(services, model, UpstreamCall(path="/apply-template",
                                                          body=msgspec.json.encode(template_body)), request.headers)
    if applied.status >= 400:
        return json_reply(applied)
    prompt = msgspec.json.decode(applied.body).get("prompt", "")
    tokens = await forward(services, model, UpstreamCall(path="/tokenize", body=msgspec.json.encode(
        {"content": prompt, "add_special": True, "parse_special": True})), request.headers)
    if tokens.status >= 400:
        return json_reply(tokens)
    count = len(msgspec.json.decode(tokens.body).get("tokens", []))
    return Response(msgspec.json.encode({"object": "response.input_tokens", "input_tokens": count}),
                    content_type="application/json")


@blueprint.get("/v1/models")
async def models():
    services = current_app.services
    from blazar.store import Store

    def listing() -> list[dict[str, Any]]:
        from blazar.engines import Roster

        engine = Roster(services.paths).active()
        rows = []
        for manifest in Store(services.paths).all():
            capabilities = ["completion"]
            if manifest.mmproj:
                capabilities.append("vision")
            if manifest.info.get("rank_head"):
                capabilities.append("rerank")
            capabilities.append("embedding")
            rows.append({"id": manifest.name, "object": "model", "created": int(manifest.created_at),
                         "owned_by": "blazar", "engine": engine.tag if engine else None,
                         "lane": "llamacpp", "capabilities": capabilities, "size": manifest.size,
                         "quantization": manifest.quant, "context_length": manifest.info.get("context_length")})
        return rows

    rows = await trio.to_thread.run_sync(listing)
    resident = {row["model"]: row["state"] for row in await services.lane.ps()}
    for row in rows:
        row["resident"] = resident.get(row["id"])
    return Response(msgspec.json.encode({"object": "list", "data": rows}), content_type="application/json")
