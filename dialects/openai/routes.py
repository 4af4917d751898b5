"""OpenAI-compatible routes: decode, validate, forward, relay."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response

from dialects.chat_core import ChatResult, StreamBroken, completion_result, run_chat
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_reply, owner, refuse
from dialects.roles import Role, role
from dialects.session import RequestSession, flight_key
from dialects.wire import ChatStreamRewriter, RequestError, check_choices, require_model
from lanes import LANES
from supervisors.instance import UpstreamCall
from supervisors.refusal import Refusal
from supervisors.relay import buffered, count_input_tokens, forward, residents

from .translate import check_chat, check_metadata, structured_output_receipt

blueprint = Blueprint("openai", __name__)


def openai_error_frame(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "engine_error", "code": 502}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\ndata: [DONE]\n\n"



def interrupt_frame(card_id: str) -> bytes:
    chunk = {"id": card_id, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "blazar_interrupted": True}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n"


def cancel_frame(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "request_cancelled", "code": 499}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\ndata: [DONE]\n\n"


@blueprint.post("/v1/chat/completions")
@role(Role.KEY)
async def chat_completions():
    """A mailbox: validate, then the canonical chat call inside a request session; relay its answer."""
    services = current_services()
    try:
        body = await json_body()
        model = require_model(body)
        check_chat(body)
        choices = check_choices(body)
        metadata = check_metadata(body)
        body.pop("metadata", None)
        receipt = structured_output_receipt(body)
        session = await RequestSession.open(services, model, stream=body.get("stream") is True,
                                            flight=flight_key(body))
        result = await session.run(lambda: run_chat(services, body, caller(), choices=choices,
                                                    raw_stream=True))
    except (RequestError, Refusal) as error:
        return refuse(error)
    headers = {"x-blazar-structured-output": receipt} if receipt else {}
    headers.update(result.headers)
    if result.payload is not None:
        payload = result.payload
        if metadata is not None and payload.get("id"):
            required(services.requests).save_completion({
                "id": payload["id"], "object": "chat.completion", "created": payload.get("created"),
                "model": payload.get("model"), "metadata": metadata, "key": owner()})
        return Response(msgspec.json.encode(payload), headers=headers, content_type="application/json")
    if result.chunks is not None:  # a forced tool call, replayed as chunks
        return _chunk_frames(result.chunks, headers)
    rewriter = ChatStreamRewriter(strip_think=result.strip, on_text=session.saw)
    return session.sse(result, rewriter.feed, openai_error_frame, headers=headers,
                       interrupt_frame=lambda: interrupt_frame(session.id), cancel_frame=cancel_frame)


def _chunk_frames(chunks: AsyncIterator[dict[str, Any]], headers: dict[str, str]) -> Response:
    async def frames() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        except StreamBroken as error:
            yield cancel_frame(str(error))
            return
        yield b"data: [DONE]\n\n"

    response = Response(frames(), content_type="text/event-stream", headers={"cache-control": "no-cache", **headers})
    response.timeout = None
    return response


@blueprint.post("/v1/chat/completions/<completion_id>")
@role(Role.KEY)
async def update_completion(completion_id: str):
    try:
        body = await json_body()
        metadata = check_metadata(body, required=True)
    except (RequestError, Refusal) as error:
        return refuse(error)
    assert metadata is not None  # required=True: a body without it was refused
    requests = required(current_services().requests)
    card = await requests.update_completion(completion_id, metadata, owner())  # refusals: app.py
    return Response(msgspec.json.encode(card), content_type="application/json")


async def _passthrough(path: str):
    """Embeddings and rerank: one engine answer, relayed as it is (not a generation, so no card)."""
    try:
        body = await json_body()
        model = require_model(body)
        result = await forward(current_services(), model, UpstreamCall(
            method="POST", path=path, body=msgspec.json.encode(body), stream=False, content_type="application/json"),
            caller())
        return json_reply(buffered(result))
    except (RequestError, Refusal) as error:
        return refuse(error)


@blueprint.post("/v1/completions")
@role(Role.KEY)
async def completions():
    """Text completion inside a request session, relayed as the engine's bytes when streamed."""
    services = current_services()
    try:
        body = await json_body()
        model = require_model(body)
        choices = check_choices(body) if "n" in body else 1
        stream = body.get("stream") is True
        session = await RequestSession.open(services, model, stream=stream, flight=flight_key(body))

        async def ask() -> ChatResult:
            return completion_result(await forward(services, model, UpstreamCall(
                method="POST", path="/v1/completions", body=msgspec.json.encode(body), stream=stream,
                content_type="application/json"), caller(),
                choices=choices), strip=False, raw_stream=True)

        result = await session.run(ask)
    except (RequestError, Refusal) as error:
        return refuse(error)
    if result.payload is not None:
        return Response(msgspec.json.encode(result.payload), content_type="application/json")
    rewriter = ChatStreamRewriter(strip_think=False, on_text=session.saw)
    return session.sse(result, rewriter.feed, openai_error_frame, cancel_frame=cancel_frame,
                       interrupt_frame=lambda: interrupt_frame(session.id))


@blueprint.post("/v1/embeddings")
@role(Role.KEY)
async def embeddings():
    return await _passthrough("/v1/embeddings")


@blueprint.post("/v1/rerank")
@blueprint.post("/v1/reranking")
@role(Role.KEY)
async def rerank():
    return await _passthrough("/v1/rerank")


@blueprint.post("/v1/chat/completions/input_tokens")
@role(Role.KEY)
async def chat_input_tokens():
    try:
        body = await json_body()
        model = require_model(body)
        check_chat(body)
        return await _count_tokens(model, {"messages": body["messages"], **(
            {"tools": body["tools"]} if "tools" in body else {})})
    except (RequestError, Refusal) as error:
        return refuse(error)


@blueprint.post("/v1/responses/input_tokens")
@blueprint.post("/responses/input_tokens")
@role(Role.KEY)
async def responses_input_tokens():
    try:
        body = await json_body()
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
        return refuse(error)


async def _count_tokens(model: str, template_body: dict[str, Any]) -> Response:
    count = await count_input_tokens(current_services(), model, template_body, caller())
    return Response(msgspec.json.encode({"object": "response.input_tokens", "input_tokens": count}),
                    content_type="application/json")


@blueprint.get("/v1/models")
@role(Role.KEY)
async def models():
    services = current_services()

    def listing() -> list[dict[str, Any]]:
        """Every lane's installed models, as each lane module lists them (a worker thread: store reads)."""
        return [row for lane in LANES.values() for row in lane.list_models(services.paths)]

    rows = await trio.to_thread.run_sync(listing)
    resident = {row["model"]: row["state"] for row in await residents(services)}
    for row in rows:
        row["resident"] = resident.get(row["id"])
    return Response(msgspec.json.encode({"object": "list", "data": rows}), content_type="application/json")
