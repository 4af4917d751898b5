"""Ollama-compatible routes: decode, translate to the canonical chat call, render Ollama's shapes."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response

from blazar import __version__
from blazar.config import ConfigError, parse_duration
from blazar.sysinfo import gpu_memory_by_pid
from dialects.chat_core import ChatResult, StreamBroken, ToolCallAccumulator, completion_result
from dialects.current import current_services, required
from dialects.edge import caller, json_body, owner, refuse, viewer
from dialects.roles import Role, require_admin, require_scope, role
from dialects.session import RequestSession, chat_session, flight_key
from dialects.wire import RequestError
from supervisors.actor import ActorError
from supervisors.instance import UpstreamCall
from supervisors.jobs import JobContext, JobFailed
from supervisors.refusal import Refusal
from supervisors.relay import (
    admit_request,
    buffered,
    ensure_model,
    forward,
    require_local,
    residents,
    submit,
    unload_anywhere,
)
from supervisors.services import Services

from . import translate as t

blueprint = Blueprint("ollama", __name__)


log = logging.getLogger("blazar.ollama")


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json", headers=headers)


class _OnceEach:
    """Remembers which (model, name) pairs were already logged, so a client that sends the same unused option
    on every request costs one log line, not one per request. Bounded."""

    LIMIT = 4096

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def first(self, model: str, name: str) -> bool:
        if (model, name) in self.seen or len(self.seen) >= self.LIMIT:
            return False
        self.seen.add((model, name))
        return True


_LOGGED_UNUSED = _OnceEach()


def _read_request(route: str, body: dict[str, Any]) -> tuple[t.OptionsRead, dict[str, str]]:
    """The body's options and fields read the way Ollama treats them, and the headers naming what was served
    but not used (refused instead under `ollama_strict_options`)."""
    strict = current_services().config.ollama_strict_options
    options = t.read_options(body.get("options"), strict=strict, sampling=route in ("chat", "generate"))
    fields = t.ignored_fields(route, body, strict=strict)
    headers = {}
    if options.ignored:
        headers["x-blazar-ignored-options"] = ",".join(options.ignored)
    if fields:
        headers["x-blazar-ignored-fields"] = ",".join(fields)
    model = str(body.get("model") or body.get("name") or "")
    for kind, names in (("option", options.ignored), ("field", fields)):
        for name in names:
            if _LOGGED_UNUSED.first(model, f"{kind}:{name}"):
                known = kind == "option" and (name in t.NO_EFFECT_OPTIONS or name in t.OPTION_FIELDS)
                log.warning("/api/%s for %s: %s %r %s; served without it (reported in x-blazar-ignored-%ss; "
                            "ollama_strict_options = true refuses it)", route, model, kind, name,
                            "has no effect on llama-server" if known else "is not one this gateway knows", kind)
    return options, headers


def _error(status: int, message: str) -> Response:
    return refuse(Refusal(status, message))



def _keep_alive(body: dict[str, Any]) -> float | None:
    if "keep_alive" not in body or body["keep_alive"] is None:
        return None
    try:
        return parse_duration(body["keep_alive"])
    except ConfigError as error:
        raise Refusal(400, f"`keep_alive` {body['keep_alive']!r}: {error.message}", fix="e.g. \"5m\", 300, 0, -1") \
            from None


def _store():
    """For reads inside worker threads only (Store creates folders); changes go through the registry."""
    from blazar.store import Store

    return Store(current_services().paths)


def _details(manifest: Any) -> dict[str, Any]:
    info = manifest.info or {}
    return {"parent_model": manifest.base or "", "format": manifest.format, "family": info.get("architecture", ""),
            "families": [info.get("architecture", "")], "parameter_size": info.get("parameters_human", ""),
            "quantization_level": manifest.quant or info.get("quantization") or ""}


@blueprint.get("/api/version")
@role(Role.KEY)
async def version():
    return _json({"version": __version__})


@blueprint.get("/api/tags")
@role(Role.KEY)
async def tags():
    from blazar.engines import Roster

    def listing() -> list[dict[str, Any]]:
        engine = Roster(current_services().paths).active()
        return [{"name": m.name, "model": m.name, "modified_at": t.rfc3339(m.created_at), "size": m.size,
                 "digest": m.blob, "details": _details(m), "blazar_engine": engine.tag if engine else None}
                for m in _store().all()]

    return _json({"models": await trio.to_thread.run_sync(listing)})


@blueprint.post("/api/show")
@role(Role.KEY)
async def show():
    try:
        body = await json_body()
        name = t.require_model(body)
        require_scope(name)
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
@role(Role.ADMIN)
async def delete():
    try:
        body = await json_body()
        await current_services().registry.delete_model(t.require_model(body))
    except (RequestError, Refusal) as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))
    return Response(b"", status=200)


@blueprint.post("/api/copy")
@role(Role.ADMIN)
async def copy():
    try:
        body = await json_body()
        source, destination = body.get("source"), body.get("destination")
        if not isinstance(source, str) or not isinstance(destination, str):
            raise RequestError("`source` and `destination` are required model names")
        await current_services().registry.copy_model(source, destination)
    except (RequestError, Refusal) as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))
    return Response(b"", status=200)


@blueprint.get("/api/ps")
@role(Role.KEY)
async def ps():
    """Ollama's shape, plus Blazar's own fields (slots, ports, in-flight, keep-alive countdown, engine)."""
    rows = await residents(current_services())
    on_gpu = {row["pid"] for row in rows if row.get("pid") and row.get("gpu_engine")}
    vram = await trio.to_thread.run_sync(gpu_memory_by_pid, on_gpu) if on_gpu else {}
    now = time.time()
    models = []
    for row in rows:
        idle = row.get("idle_expires_in_secs")
        models.append({**row, "name": row["model"], "size": row.get("size_bytes", 0),
                       "size_vram": vram.get(row["pid"], 0) if row.get("pid") else 0,  # a CPU engine: nothing on a GPU
                       "digest": row.get("digest", ""), "context_length": row.get("context"),
                       "expires_at": t.rfc3339(now + idle) if idle is not None else None,
                       "blazar_engine": row.get("engine")})
    services = current_services()
    listing: dict[str, Any] = {"models": models}
    sessions = await services.sessions.list(viewer()) if services.sessions is not None else []
    if sessions:  # open realtime sessions, each under the session supervisor (a scoped key sees its own)
        listing["sessions"] = sessions
    if services.remotes is not None:
        listing["remotes"] = [{"name": peer["name"], "kind": peer.get("kind"), "reach": peer.get("reach"),
                               "breaker": peer.get("breaker"),
                               **({"capacity": peer["capacity"]} if peer.get("capacity") else {})}
                              for peer in await services.remotes.describe_all()]
    return _json(listing)


async def run_pull(services: Services, ctx: JobContext) -> dict[str, Any]:
    """A pull asked over HTTP, as a job: it goes on when the client hangs up, and shows in /v1/jobs."""
    events = await services.registry.pull_model(ctx.request["target"])
    last: dict[str, Any] = {}
    with events:
        async for event in events:
            ctx.progress(**event)
            last = event
    if "error" in last:
        raise JobFailed(last["error"], fix="see the message")
    return {"status": "success", "model": ctx.request["target"]}


@blueprint.post("/api/pull")
@role(Role.ADMIN)
async def pull():
    """A mailbox: the pull runs as a job (the registry actor does the work); this route relays its progress."""
    services = current_services()
    try:
        body = await json_body()
        target = t.require_model(body)
        job_id, progress = await required(services.jobs).create_watched("pull", model=target, key=owner(),
                                                                        request={"target": target})
    except (RequestError, Refusal) as error:
        return refuse(error)

    async def outcome(last: dict[str, Any]) -> dict[str, Any] | None:
        """What the client has not seen of the job's end (a slow reader can miss progress lines)."""
        row = await required(services.jobs).get(job_id)
        if row is None or row["state"] == "completed":
            return None if last.get("status") == "success" else {"status": "success"}
        error = msgspec.json.decode(row["error"]) if row["error"] else {"message": row["state"]}
        return None if "error" in last else {"error": error["message"], "status_code": 500}

    if body.get("stream", True) is False:
        last: dict[str, Any] = {}
        with progress:
            async for event in progress:
                last = event
        final = await outcome(last) or last
        if "error" in final:
            return _error(final.get("status_code") or 500, final["error"])
        return _json({"status": "success"}, headers={"x-blazar-job": job_id})

    async def lines() -> AsyncIterator[bytes]:
        last: dict[str, Any] = {}
        with progress:
            async for event in progress:
                last = event
                yield msgspec.json.encode({k: v for k, v in event.items() if k != "status_code"}) + b"\n"
        final = await outcome(last)
        if final is not None:
            final.pop("status_code", None)
            yield msgspec.json.encode(final) + b"\n"

    response = Response(lines(), content_type="application/x-ndjson", headers={"x-blazar-job": job_id})
    response.timeout = None
    return response


async def _chat_like(kind: str):
    services = current_services()
    started = time.perf_counter()
    try:
        body = await json_body()
        options, unused = _read_request(kind, body)
        num_ctx, spawn = options.num_ctx, options.spawn
        if kind == "chat":
            canonical = t.canonical_chat(body, options)
            if not canonical["messages"]:
                return await _load_or_unload(body, canonical["model"], options, unused)
        else:
            canonical = t.canonical_generate(body, options)
            if not body.get("prompt") and not body.get("images"):
                return await _load_or_unload(body, canonical["model"], options, unused)
        keep_alive = _keep_alive(body)
        if kind == "generate" and body.get("raw") is True:
            flight = flight_key({**canonical, "raw": True}, num_ctx, sorted((spawn or {}).items()))
            session = await RequestSession.open(services, canonical["model"], stream=canonical.get("stream") is True,
                                                flight=flight)
            result = await session.run(lambda: _raw_completion(services, canonical, body["prompt"], keep_alive,
                                                                num_ctx, spawn))
        else:
            result = await chat_session(services, canonical, caller(), keep_alive=keep_alive, num_ctx=num_ctx,
                                        spawn_options=spawn)
    except (RequestError, Refusal) as error:
        return refuse(error)
    model = canonical["model"]
    if result.payload is not None:
        return _json(_render(kind, model, result.payload, started, final=True), 200, {**result.headers, **unused})
    assert result.chunks is not None  # not buffered: a stream of chunk dicts
    return _ndjson(kind, model, result.chunks, started, {**result.headers, **unused})


async def _raw_completion(services: Services, canonical: dict[str, Any], prompt: str, keep_alive: float | None,
                          num_ctx: int | None, spawn: dict[str, Any] | None) -> ChatResult:
    """`raw: true`: the prompt goes to the engine verbatim, no chat template."""
    skip = {"messages", "tools", "think", "chat_template_kwargs", "reasoning_effort"}
    body = {k: v for k, v in canonical.items() if k not in skip} | {"prompt": prompt}
    result = await forward(services, canonical["model"], UpstreamCall(
        method="POST", path="/v1/completions", body=msgspec.json.encode(body), stream=body.get("stream") is True,
        content_type="application/json"),
        caller(), keep_alive=keep_alive, num_ctx=num_ctx, spawn_options=spawn)
    return completion_result(result, strip=False)


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


async def _load_or_unload(body: dict[str, Any], model: str, options: t.OptionsRead,
                          unused: dict[str, str]) -> Response:
    """Ollama's idiom: an empty chat/generate loads the model; with keep_alive 0 it unloads it."""
    keep_alive = _keep_alive(body)
    services = current_services()
    kind = "message" if "messages" in body else "response"
    if keep_alive == 0:
        try:
            require_admin("unloading a model (an empty request with keep_alive 0)")
            await unload_anywhere(services, model)
        except Refusal as error:
            return refuse(error)
        except ActorError as error:
            if error.err.status != 404:
                return _error(error.err.status, error.err.message)
        payload = {"model": model, "created_at": t.now_rfc3339(), "done": True, "done_reason": "unload"}
    else:
        try:
            require_local(services, model, "loading with an empty request")
            who = caller()
            await admit_request(services, model, "tokens", who)  # the key's scope and rate, as for any generation
            handle = await ensure_model(services, model, who, options.num_ctx, options.spawn, fresh=True)
            await submit(services, handle, UpstreamCall(method="GET", path=handle.lane.health_path, body=b"",
                                                        stream=False, content_type="application/json"), who,
                         keep_alive=keep_alive)
        except (RequestError, Refusal) as error:
            return refuse(error)
        payload = {"model": model, "created_at": t.now_rfc3339(), "done": True, "done_reason": "load"}
    payload[kind] = {"role": "assistant", "content": ""} if kind == "message" else ""
    return _json(payload, headers=unused)


@blueprint.post("/api/chat")
@role(Role.KEY)
async def chat():
    return await _chat_like("chat")


@blueprint.post("/api/generate")
@role(Role.KEY)
async def generate():
    return await _chat_like("generate")


async def _embed(legacy: bool):
    services = current_services()
    started = time.perf_counter()
    try:
        body = await json_body()
        model = t.require_model(body)
        inputs = body.get("prompt") if legacy else body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            field = "prompt" if legacy else "input"
            raise RequestError(f"`{field}` must be a string" + ("" if legacy else " or an array of strings"))
        options, unused = _read_request("embeddings" if legacy else "embed", body)
        reply = buffered(await forward(services, model, UpstreamCall(
            method="POST", path="/v1/embeddings", body=msgspec.json.encode({"model": model, "input": inputs}),
            stream=False, content_type="application/json"), caller(), keep_alive=_keep_alive(body),
            num_ctx=options.num_ctx, spawn_options=options.spawn))
    except (RequestError, Refusal) as error:
        return refuse(error)
    if reply.status >= 400:
        return _error(502 if reply.status >= 500 else reply.status, reply.engine_message)
    payload = msgspec.json.decode(reply.body)
    vectors = [row["embedding"] for row in sorted(payload["data"], key=lambda r: r["index"])]
    if legacy:
        return _json({"embedding": vectors[0] if vectors else []}, headers=unused)
    return _json({"model": model, "embeddings": vectors, "total_duration": int((time.perf_counter() - started) * 1e9),
                  "load_duration": 0, "prompt_eval_count": (payload.get("usage") or {}).get("prompt_tokens", 0)},
                 headers=unused)


@blueprint.post("/api/embed")
@role(Role.KEY)
async def embed():
    return await _embed(legacy=False)


@blueprint.post("/api/embeddings")
@role(Role.KEY)
async def embeddings():
    return await _embed(legacy=True)


@blueprint.post("/api/rerank")
@role(Role.KEY)
async def rerank():
    try:
        body = await json_body()
        model = t.require_model(body)
        reply = buffered(await forward(current_services(), model, UpstreamCall(
            method="POST", path="/v1/rerank", body=msgspec.json.encode(body), stream=False,
            content_type="application/json"), caller()))
    except (RequestError, Refusal) as error:
        return refuse(error)
    return Response(reply.body, status=reply.status if reply.status < 500 else 502, content_type="application/json")
