"""llama-server's own routes, resolved to a child: X-Blazar-Model > ?model= > the single hot child.

Their bodies carry no model field upstream, so Blazar picks the target; with several models
resident and no selector the request is refused with the list to choose from.
"""

from __future__ import annotations

import msgspec
from quart import Blueprint, Response, request

from dialects.current import current_services, required
from dialects.edge import caller, json_reply, respond, sse_response
from dialects.openai.routes import openai_error_frame
from dialects.roles import Role, role
from dialects.wire import ChatStreamRewriter
from supervisors.instance import UpstreamCall, UpstreamReply
from supervisors.refusal import Refusal
from supervisors.relay import forward, unload_anywhere

blueprint = Blueprint("native_engine", __name__)


async def target_model(*, resident_only: bool = False) -> str:
    """The model a llama.cpp-native request is for. `resident_only` (the GET routes): a model that is
    already loaded, never one to spawn: a browser sends a cross-site GET from an <img> tag without asking,
    so a GET must not start engines."""
    chosen = request.headers.get("x-blazar-model") or request.args.get("model")
    if chosen and not resident_only:
        return chosen
    live = [row for row in await required(current_services().lane).ps() if row.get("state") in ("ready", "busy")]
    if chosen:
        if any(row["model"] == chosen for row in live):
            return chosen
        names = ", ".join(sorted(row["model"] for row in live)) or "none"
        raise Refusal(409, f"GET {request.path} answers only for a loaded model, and {chosen} is not loaded "
                      f"(loaded: {names}); a GET never loads one",
                      fix=f'load it first: POST /api/warm {{"model": "{chosen}"}}, or any request to it')
    if len(live) == 1:
        return live[0]["model"]
    if not live:
        raise Refusal(400, f"{request.path} needs a model: no model is loaded",
                      fix="send X-Blazar-Model: <model> or ?model=<model>")
    names = ", ".join(sorted(row["model"] for row in live))
    raise Refusal(400, f"{request.path} needs a model: several are loaded ({names})",
                  fix="send X-Blazar-Model: <model> or ?model=<model>")


async def _native(path: str, method: str = "POST", *, stream_ok: bool = False):
    try:
        model = await target_model(resident_only=method == "GET")
        raw = await request.get_data(cache=True, as_text=False, parse_form_data=False) if method == "POST" else b""
        stream = False
        if stream_ok and raw:
            try:
                stream = msgspec.json.decode(raw).get("stream") is True
            except (msgspec.DecodeError, AttributeError):
                raise Refusal(400, "the request body must be a JSON object") from None
        result = await forward(current_services(), model,
                               UpstreamCall(method=method, path=path, body=raw, stream=stream,
                                            content_type="application/json"), caller())
        if isinstance(result, UpstreamReply):
            return json_reply(result)
        return sse_response(result, ChatStreamRewriter(strip_think=False).feed, openai_error_frame)
    except Refusal as error:
        return respond(error, request.path)


@blueprint.post("/tokenize")
@role(Role.KEY)
async def tokenize():
    return await _native("/tokenize")


@blueprint.post("/detokenize")
@role(Role.KEY)
async def detokenize():
    return await _native("/detokenize")


@blueprint.post("/apply-template")
@role(Role.KEY)
async def apply_template():
    return await _native("/apply-template")


@blueprint.post("/infill")
@role(Role.KEY)
async def infill():
    return await _native("/infill", stream_ok=True)


@blueprint.post("/completion")
@role(Role.KEY)
async def completion():
    return await _native("/completion", stream_ok=True)


@blueprint.post("/embeddings")
@role(Role.KEY)
async def native_embeddings():
    return await _native("/embeddings")


@blueprint.post("/rerank")
@blueprint.post("/reranking")
@role(Role.KEY)
async def native_rerank():
    return await _native("/rerank")


@blueprint.get("/props")
@role(Role.KEY)
async def props():
    return await _native("/props", "GET")


@blueprint.get("/slots")
@role(Role.ADMIN)
async def slots():
    return await _native("/slots", "GET")


@blueprint.post("/slots/<int:slot_id>")
@role(Role.ADMIN)
async def slot_action(slot_id: int):
    action = request.args.get("action")
    if action not in ("save", "restore", "erase"):
        return respond(Refusal(400, f"?action= must be save, restore or erase, got {action!r}"), request.path)
    return await _native(f"/slots/{slot_id}?action={action}")


@blueprint.post("/api/ps/reset")
@role(Role.ADMIN)
async def ps_reset():
    services = current_services()
    cleared = []
    for lane in services.lane_clients().values():
        cleared += await lane.reset(request.args.get("model"))
    return Response(msgspec.json.encode({"cleared": cleared}), content_type="application/json")


@blueprint.post("/api/evict")
@role(Role.ADMIN)
async def evict():
    raw = await request.get_data()
    try:
        model = msgspec.json.decode(raw).get("model") if raw else request.args.get("model")
    except (msgspec.DecodeError, AttributeError):
        model = None
    if not isinstance(model, str) or not model:
        return Response(msgspec.json.encode({"error": "`model` is required: {\"model\": \"smollm2:135m\"}"}),
                        status=400, content_type="application/json")
    from supervisors.actor import ActorError

    try:
        result = await unload_anywhere(current_services(), model)
    except ActorError as error:
        return Response(msgspec.json.encode({"error": error.err.message}), status=error.err.status,
                        content_type="application/json")
    return Response(msgspec.json.encode({"status": "evicted", "model": result.get("model")}),
                    content_type="application/json")
