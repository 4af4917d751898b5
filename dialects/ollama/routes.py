"""Ollama-compatible routes: decode, translate to the canonical chat call, render Ollama's shapes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, current_app, request

from blazar import __version__
from blazar.config import ConfigError, parse_duration
from blazar.sysinfo import gpu_memory_by_pid
from dialects.chat_core import StreamBroken, ToolCallAccumulator, run_chat
from dialects.edge import Refusal, ensure_model, forward, refuse, submit
from dialects.wire import RequestError, decode_object
from supervisors.actor import ActorError
from supervisors.instance import UpstreamCall

from . import translate as t

blueprint = Blueprint("ollama", __name__)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json")


def _error(status: int, message: str) -> Response:
    return refuse(Refusal(status, message))


async def _body() -> dict[str, Any]:
    raw = await request.get_data()
    try:
        return decode_object(raw)
    except RequestError as error:
        raise Refusal(400, error.message) from None


def _keep_alive(body: dict[str, Any]) -> float | None:
    if "keep_alive" not in body or body["keep_alive"] is None:
        return None
    try:
        return parse_duration(body["keep_alive"])
    except ConfigError as error:
        raise Refusal(400, f"`keep_alive` {body['keep_alive']!r}: {error.message}", hint="e.g. \"5m\", 300, 0, -1") \
            from None


def _store():
    """For reads inside worker threads only (Store creates folders); changes go through the registry."""
    from blazar.store import Store

    return Store(current_app.services.paths)


def _details(manifest: Any) -> dict[str, Any]:
    info = manifest.info or {}
    return {"parent_model": manifest.base or "", "format": manifest.format, "family": info.get("architecture", ""),
            "families": [info.get("architecture", "")], "parameter_size": info.get("parameters_human", ""),
            "quantization_level": manifest.quant or info.get("quantization") or ""}


@blueprint.get("/api/version")
async def version():
    return _json({"version": __version__})


@blueprint.get("/api/tags")
async def tags():
    from blazar.engines import Roster

    def listing() -> list[dict[str, Any]]:
        engine = Roster(current_app.services.paths).active()
        return [{"name": m.name, "model": m.name, "modified_at": t.rfc3339(m.created_at), "size": m.size,
                 "digest": m.blob, "details": _details(m), "blazar_engine": engine.tag if engine else None}
                for m in _store().all()]

    return _json({"models": await trio.to_thread.run_sync(listing)})


@blueprint.post("/api/show")
async def show():
    try:
        body = await _body()
        name = t.require_model(body)
    except (RequestError, Refusal) as error:
        return refuse(error)
    from blazar.store import StoreError

    try:
        manifest = await trio.to_thread.run_sync(lambda: _store().resolved(name))
    except StoreError as error:
        return refuse(error)
    info = manifest.info or {}
    capabilities = ["completion"] + (["vision"] if manifest.mmproj else [])
    parameters = "\n".join(f"{k} {v}" for k, v in manifest.overlay.items())
    modelfile = f"FROM {manifest.base or manifest.name}\n" + "".join(
        f"PARAMETER {k} {v}\n" for k, v in manifest.overlay.items()) + (
        f'SYSTEM """{manifest.system}"""\n' if manifest.system else "")
    model_info = {"general.architecture": info.get("architecture"), "general.parameter_count": info.get("parameters"),
                  f"{info.get('architecture')}.context_length": info.get("context_length"),
                  f"{info.get('architecture')}.embedding_length": info.get("embedding_length"),
                  f"{info.get('architecture')}.block_count": info.get("block_count")}
    return _json({"modelfile": modelfile, "parameters": parameters, "template": manifest.template or "",
                  "details": _details(manifest), "model_info": model_info, "capabilities": capabilities,
                  "modified_at": t.rfc3339(manifest.created_at), "system": manifest.system or ""})


@blueprint.delete("/api/delete")
@blueprint.post("/api/delete")
async def delete():
    try:
        body = await _body()
        await current_app.services.registry.delete_model(t.require_model(body))
    except (RequestError, Refusal) as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))
    return Response(b"", status=200)


@blueprint.post("/api/copy")
async def copy():
    try:
        body = await _body()
        source, destination = body.get("source"), body.get("destination")
        if not isinstance(source, str) or not isinstance(destination, str):
            raise RequestError("`source` and `destination` are required model names")
        await current_app.services.registry.copy_model(source, destination)
    except (RequestError, Refusal) as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))
    return Response(b"", status=200)


@blueprint.get("/api/ps")
async def ps():
    """Ollama's shape, plus Blazar's own fields (slots, ports, in-flight, keep-alive countdown, engine)."""
    rows = await current_app.services.lane.ps()
    on_gpu = {row["pid"] for row in rows if row.get("pid") and row.get("gpu_engine")}
    vram = await trio.to_thread.run_sync(gpu_memory_by_pid, on_gpu) if on_gpu else {}
    now = time.time()
    models = []
    for row in rows:
        idle = row.get("idle_expires_in_secs")
        models.append({**row, "name": row["model"], "size": row.get("size_bytes", 0),
                       "size_vram": vram.get(row.get("pid"), 0),  # a CPU engine holds nothing on a GPU
                       "digest": row.get("digest", ""), "context_length": row.get("context"),
                       "expires_at": t.rfc3339(now + idle) if idle is not None else None,
                       "blazar_engine": row.get("engine")})
    return _json({"models": models})


@blueprint.post("/api/pull")
async def pull():
    """A mailbox: the registry actor runs the pull; this route relays its progress."""
    try:
        body = await _body()
        events = await current_app.services.registry.pull_model(t.require_model(body))
    except (RequestError, Refusal) as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))

    if body.get("stream", True) is False:
        last: dict[str, Any] = {}
        with events:
            async for event in events:
                last = event
        if "error" in last:
            return _error(last["status_code"], last["error"])
        return _json({"status": "success"})

    async def lines() -> AsyncIterator[bytes]:
        with events:
            async for event in events:
                event.pop("status_code", None)
                yield msgspec.json.encode(event) + b"\n"

    response = Response(lines(), content_type="application/x-ndjson")
    response.timeout = None
    return response


async def _chat_like(kind: str):
    services = current_app.services
    started = time.perf_counter()
    try:
        body = await _body()
        if kind == "chat":
            canonical, num_ctx = t.canonical_chat(body)
            if not canonical["messages"]:
                return await _load_or_unload(body, canonical["model"])
        else:
            canonical, num_ctx = t.canonical_generate(body)
            if not body.get("prompt") and not body.get("images"):
                return await _load_or_unload(body, canonical["model"])
        keep_alive = _keep_alive(body)
        spawn = t.spawn_options(body.get("options"))
        if kind == "generate" and body.get("raw") is True:
            result = await _raw_completion(services, canonical, body["prompt"], keep_alive, num_ctx, spawn)
        else:
            result = await run_chat(services, canonical, request.headers, keep_alive=keep_alive, num_ctx=num_ctx,
                                    spawn_options=spawn)
    except (RequestError, Refusal) as error:
        return refuse(error)
    model = canonical["model"]
    if result.payload is not None:
        return _json(_render(kind, model, result.payload, started, final=True), 200)
    return _ndjson(kind, model, result.chunks, started, result.headers)


async def _raw_completion(services: Any, canonical: dict[str, Any], prompt: str, keep_alive: float | None,
                          num_ctx: int | None, spawn: dict[str, Any] | None) -> Any:
    """`raw: true`: the prompt goes to the engine verbatim, no chat template."""
    from dialects.chat_core import ChatResult, _chunks
    from supervisors.instance import UpstreamReply

    skip = {"messages", "tools", "think", "chat_template_kwargs", "reasoning_effort"}
    body = {k: v for k, v in canonical.items() if k not in skip} | {"prompt": prompt}
    result = await forward(services, canonical["model"], UpstreamCall(
        path="/v1/completions", body=msgspec.json.encode(body), stream=body.get("stream") is True),
        request.headers, keep_alive=keep_alive, num_ctx=num_ctx, spawn_options=spawn)
    if isinstance(result, UpstreamReply):
        if result.status >= 400:
            from dialects.edge import engine_failure

            raise engine_failure(result)
        return ChatResult(payload=msgspec.json.decode(result.body))
    return ChatResult(chunks=_chunks(result, strip=False))


def _render(kind: str, model: str, payload: dict[str, Any], started: float, *, final: bool) -> dict[str, Any]:
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    out: dict[str, Any] = {"model": model, "created_at": t.now_rfc3339()}
    text = message.get("content") or choice.get("text") or ""
    if kind == "chat":
        rendered: dict[str, Any] = {"role": "assistant", "content": text}
        if message.get("reasoning_content"):
            rendered["thinking"] = message["reasoning_content"]
        if message.get("tool_calls"):
            rendered["tool_calls"] = t.ollama_tool_calls(message["tool_calls"])
        out["message"] = rendered
    else:
        out["response"] = text
        if message.get("reasoning_content"):
            out["thinking"] = message["reasoning_content"]
    if choice.get("logprobs"):
        out["logprobs"] = choice["logprobs"].get("content")
    out.update(done=True, done_reason=t.done_reason(choice.get("finish_reason")),
               **t.timing_fields(payload, started, 0.0))
    return out


def _ndjson(kind: str, model: str, chunks: AsyncIterator[dict[str, Any]], started: float,
            headers: dict[str, str]) -> Response:
    async def lines() -> AsyncIterator[bytes]:
        tools = ToolCallAccumulator()
        last: dict[str, Any] = {}
        finish = None
        try:
            async for chunk in chunks:
                last = chunk if chunk.get("usage") or chunk.get("timings") else last
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    finish = choice.get("finish_reason") or finish
                    if delta.get("tool_calls"):
                        tools.feed(delta["tool_calls"])
                    piece = delta.get("content") or choice.get("text") or ""
                    thinking = delta.get("reasoning_content") or ""
                    if not piece and not thinking:
                        continue
                    frame: dict[str, Any] = {"model": model, "created_at": t.now_rfc3339(), "done": False}
                    if kind == "chat":
                        frame["message"] = {"role": "assistant", "content": piece,
                                            **({"thinking": thinking} if thinking else {})}
                    else:
                        frame["response"] = piece
                        if thinking:
                            frame["thinking"] = thinking
                    yield msgspec.json.encode(frame) + b"\n"
        except StreamBroken as error:
            yield msgspec.json.encode({"error": str(error)}) + b"\n"
            return
        calls = tools.finished()
        if calls and kind == "chat":
            frame = {"model": model, "created_at": t.now_rfc3339(), "done": False,
                     "message": {"role": "assistant", "content": "", "tool_calls": t.ollama_tool_calls(
                         [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls])}}
            yield msgspec.json.encode(frame) + b"\n"
        final = {"model": model, "created_at": t.now_rfc3339(), "done": True, "done_reason": t.done_reason(finish),
                 **t.timing_fields(last, started, 0.0)}
        if kind == "chat":
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        yield msgspec.json.encode(final) + b"\n"

    response = Response(lines(), content_type="application/x-ndjson", headers=headers)
    response.timeout = None
    return response


async def _load_or_unload(body: dict[str, Any], model: str) -> Response:
    """Ollama's idiom: an empty chat/generate loads the model; with keep_alive 0 it unloads it."""
    keep_alive = _keep_alive(body)
    services = current_app.services
    kind = "message" if "messages" in body else "response"
    if keep_alive == 0:
        try:
            await services.lane.unload(model)
        except ActorError as error:
            if error.err.status != 404:
                return _error(error.err.status, error.err.message)
        payload = {"model": model, "created_at": t.now_rfc3339(), "done": True, "done_reason": "unload"}
    else:
        try:
            _, num_ctx = t.options_to_fields(body.get("options"))
            handle = await ensure_model(services, model, request.headers, num_ctx, t.spawn_options(body.get("options")))
            await submit(services, handle, UpstreamCall(method="GET", path=handle.lane.health_path), request.headers,
                         keep_alive=keep_alive)
        except (RequestError, Refusal) as error:
            return refuse(error)
        payload = {"model": model, "created_at": t.now_rfc3339(), "done": True, "done_reason": "load"}
    payload[kind] = {"role": "assistant", "content": ""} if kind == "message" else ""
    return _json(payload)


@blueprint.post("/api/chat")
async def chat():
    return await _chat_like("chat")


@blueprint.post("/api/generate")
async def generate():
    return await _chat_like("generate")


async def _embed(legacy: bool):
    services = current_app.services
    started = time.perf_counter()
    try:
        body = await _body()
        model = t.require_model(body)
        inputs = body.get("prompt") if legacy else body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            field = "prompt" if legacy else "input"
            raise RequestError(f"`{field}` must be a string" + ("" if legacy else " or an array of strings"))
        _, num_ctx = t.options_to_fields(body.get("options"))
        reply = await forward(services, model, UpstreamCall(path="/v1/embeddings", body=msgspec.json.encode(
            {"model": model, "input": inputs})), request.headers, keep_alive=_keep_alive(body), num_ctx=num_ctx,
            spawn_options=t.spawn_options(body.get("options")))
    except (RequestError, Refusal) as error:
        return refuse(error)
    if reply.status >= 400:
        return _error(502 if reply.status >= 500 else reply.status, reply.engine_message)
    payload = msgspec.json.decode(reply.body)
    vectors = [row["embedding"] for row in sorted(payload["data"], key=lambda r: r["index"])]
    if legacy:
        return _json({"embedding": vectors[0] if vectors else []})
    return _json({"model": model, "embeddings": vectors, "total_duration": int((time.perf_counter() - started) * 1e9),
                  "load_duration": 0, "prompt_eval_count": (payload.get("usage") or {}).get("prompt_tokens", 0)})


@blueprint.post("/api/embed")
async def embed():
    return await _embed(legacy=False)


@blueprint.post("/api/embeddings")
async def embeddings():
    return await _embed(legacy=True)


@blueprint.post("/api/rerank")
async def rerank():
    try:
        body = await _body()
        model = t.require_model(body)
        reply = await forward(current_app.services, model, UpstreamCall(
            path="/v1/rerank", body=msgspec.json.encode(body)), request.headers)
    except (RequestError, Refusal) as error:
        return refuse(error)
    return Response(reply.body, status=reply.status if reply.status < 500 else 502, content_type="application/json")
