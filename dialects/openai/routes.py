"""OpenAI-compatible routes: decode, validate, forward, relay."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, current_app, request

from dialects.chat_core import forced_tool, run_chat
from dialects.edge import (
    Refusal,
    admit_request,
    count_input_tokens,
    engine_failure,
    follow_or_lead,
    forward,
    json_reply,
    refuse,
    sse_response,
    tracked,
)
from dialects.wire import (
    ChatStreamRewriter,
    RequestError,
    bridge_reasoning,
    check_choices,
    decode_object,
    require_model,
    strip_think_buffered,
    thinking_requested,
)
from lanes import lane_for
from supervisors.instance import UpstreamCall, UpstreamReply

from .translate import check_chat, check_metadata, structured_output_receipt

blueprint = Blueprint("openai", __name__)


def openai_error_frame(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "engine_error", "code": 502}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\ndata: [DONE]\n\n"


async def _body() -> dict[str, Any]:
    try:
        return decode_object(await request.get_data())
    except RequestError as error:
        raise Refusal(400, error.message) from None


def interrupt_frame(card_id: str) -> bytes:
    chunk = {"id": card_id, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "blazar_interrupted": True}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n"


def cancel_frame(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "request_cancelled", "code": 499}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\ndata: [DONE]\n\n"


@blueprint.post("/v1/chat/completions")
async def chat_completions():
    services = current_app.services
    try:
        body = await _body()
        model = require_model(body)
        check_chat(body)
        choices = check_choices(body)
        metadata = check_metadata(body)
        body.pop("metadata", None)
        strip = not thinking_requested(body)
        body = bridge_reasoning(body)
        headers = {}
        receipt = structured_output_receipt(body)
        if receipt:
            headers["x-blazar-structured-output"] = receipt
        stream = body.get("stream") is True
        encoded = msgspec.json.encode(body)
        if forced_tool(body) is not None:
            return await _enforced_tool_call(body)
        # Admitted before singleflight: a follower served from another request's answer still counts.
        charge = await admit_request(services, model)
    except (RequestError, Refusal) as error:
        return refuse(error)
    flight_key = None if stream else f"{model}\0{request.headers.get('x-blazar-num-ctx', '')}\0{encoded.decode()}"
    owner = request.scope.get("blazar.key") if request.scope.get("blazar.auth") else None
    control = await services.requests.open(trace_id=request.scope.get("blazar.trace_id", ""), model=model,
                                           route=request.path, stream=stream, flight_key=flight_key,
                                           key=owner.name if owner is not None else None)
    started = trio.current_time()
    upstream = UpstreamCall(path="/v1/chat/completions", body=encoded, stream=stream)
    if not stream:
        state = "failed"
        outcome: Any = None  # what followers of this flight receive if this request led it
        led = control.follow is None
        closing: dict[str, Any] = {}
        try:
            async def ask() -> UpstreamReply:
                return await forward(services, model, upstream, request.headers, choices=choices)

            result, led = await tracked(services, control, lambda: follow_or_lead(control, ask))
            outcome = result
            if result.status >= 400:
                raise engine_failure(result)
            payload = msgspec.json.decode(result.body)  # parsed once: stripped, recorded, re-encoded
            if not led and charge is not None:
                usage = payload.get("usage") or {}
                charge(int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0))
            if strip:
                payload = strip_think_buffered(payload)
            response = Response(msgspec.json.encode(payload), status=result.status, headers=headers,
                                content_type="application/json")
            state = "done"
            usage = payload.get("usage") or {}
            closing = {"partial": _message_text(payload), "tokens": usage.get("completion_tokens"),
                       "queue_ms": round(result.queued_secs * 1000, 1)}
            if metadata is not None and payload.get("id"):
                services.requests.save_completion({"id": payload["id"], "object": "chat.completion",
                                                   "created": payload.get("created"), "model": payload.get("model"),
                                                   "metadata": metadata})
            return response
        except (RequestError, Refusal) as error:
            state = "cancelled" if isinstance(error, Refusal) and error.status == 499 else "failed"
            if isinstance(error, Refusal) and error.status != 499:
                outcome = error
            return refuse(error)
        except BaseException:
            state = "disconnected"
            raise
        finally:
            elapsed_ms = round((trio.current_time() - started) * 1000, 1)
            await services.requests.close(control.id, state, compute_ms=elapsed_ms,
                                          flight_key=flight_key if led else None, result=outcome, **closing)
    try:
        result = await tracked(services, control, lambda: forward(services, model, upstream, request.headers,
                                                                         choices=choices))
    except (RequestError, Refusal) as error:
        await services.requests.close(control.id, "failed")
        return refuse(error)
    if isinstance(result, UpstreamReply):
        await services.requests.close(control.id, "failed" if result.status >= 400 else "done")
        try:
            return json_reply(result, strip_think_buffered if strip else None, headers)
        except Refusal as error:
            return refuse(error)
    rewriter = ChatStreamRewriter(strip_think=strip)
    services.requests.update(control.id, state="running", queue_ms=round(result.queued_secs * 1000, 1))
    reported = 0

    def rewrite(chunk: bytes) -> bytes:
        nonlocal reported
        out = rewriter.feed(chunk)
        if len(rewriter.text) - reported >= 8:
            services.requests.update(control.id, partial="".join(rewriter.text[reported:]))
            reported = len(rewriter.text)
        return out

    async def finish(state: str) -> None:
        services.requests.update(control.id, partial="".join(rewriter.text[reported:]))
        await services.requests.close(control.id, state, tokens=len(rewriter.text),
                                      compute_ms=round((trio.current_time() - started) * 1000, 1))

    return sse_response(result, rewrite, openai_error_frame, headers, control=control,
                        interrupt_frame=lambda: interrupt_frame(control.id), cancel_frame=cancel_frame, finish=finish)


async def _enforced_tool_call(body: dict[str, Any]) -> Response:
    """A forced tool call (tool_choice required or named): grammar-enforced, as a real tool call."""
    result = await run_chat(current_app.services, body, request.headers)
    if result.payload is not None:
        return Response(msgspec.json.encode(result.payload), content_type="application/json", headers=result.headers)

    async def frames():
        async for chunk in result.chunks:
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    response = Response(frames(), content_type="text/event-stream", headers={"cache-control": "no-cache",
                                                                             **result.headers})
    response.timeout = None
    return response


def _message_text(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or [{}]
    return str((choices[0].get("message") or {}).get("content") or "")


@blueprint.post("/v1/chat/completions/<completion_id>")
async def update_completion(completion_id: str):
    try:
        body = await _body()
        metadata = check_metadata(body, required=True)
    except (RequestError, Refusal) as error:
        return refuse(error)
    from supervisors.actor import ActorError

    try:
        card = await current_app.services.requests.update_completion(completion_id, metadata)
    except ActorError as error:
        return Refusal.from_err(error.err).response(request.path)
    return Response(msgspec.json.encode(card), content_type="application/json")


async def _passthrough(path: str, *, stream_ok: bool = True):
    try:
        body = await _body()
        model = require_model(body)
        choices = check_choices(body) if "n" in body else 1
        stream = stream_ok and body.get("stream") is True
        result = await forward(current_app.services, model, UpstreamCall(
            path=path, body=msgspec.json.encode(body), stream=stream), request.headers, choices=choices)
        if isinstance(result, UpstreamReply):
            return json_reply(result)
        rewriter = ChatStreamRewriter(strip_think=False)
        return sse_response(result, rewriter.feed, openai_error_frame)
    except (RequestError, Refusal) as error:
        return refuse(error)


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
        return refuse(error)


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
        return refuse(error)


async def _count_tokens(model: str, template_body: dict[str, Any]) -> Response:
    count = await count_input_tokens(current_app.services, model, template_body, request.headers)
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
            lane = lane_for(manifest)
            rows.append({"id": manifest.name, "object": "model", "created": int(manifest.created_at),
                         "owned_by": "blazar", "engine": engine.tag if engine else None,
                         "lane": lane.kind, "capabilities": lane.capabilities(manifest), "size": manifest.size,
                         "quantization": manifest.quant, "context_length": manifest.info.get("context_length")})
        return rows

    rows = await trio.to_thread.run_sync(listing)
    resident = {row["model"]: row["state"] for row in await services.lane.ps()}
    for row in rows:
        row["resident"] = resident.get(row["id"])
    return Response(msgspec.json.encode({"object": "list", "data": rows}), content_type="application/json")
