"""Request cards: list, read, cancel and interrupt live generations from another connection."""

from __future__ import annotations

import msgspec
from quart import Blueprint, Response, request

from dialects.current import current_services, required
from dialects.edge import respond, viewer
from dialects.roles import Role, role
from supervisors.actor import ActorError
from supervisors.refusal import Refusal

blueprint = Blueprint("requests", __name__)


def _json(payload) -> Response:
    return Response(msgspec.json.encode(payload), content_type="application/json")


@blueprint.get("/v1/requests")
@role(Role.KEY)
async def list_requests():
    state = request.args.get("state")
    if state is not None and state not in ("queued", "running", "done", "cancelled", "interrupted", "disconnected",
                                           "failed"):
        return respond(Refusal(400, f"?state= must be one of queued, running, done, cancelled, interrupted, "
                               f"disconnected, failed; got {state!r}"), request.path)
    rows = await required(current_services().requests).list(request.args.get("model"), state, viewer())
    return _json({"object": "list", "data": rows})


@blueprint.get("/v1/requests/<card_id>")
@role(Role.KEY)
async def get_request(card_id: str):
    try:
        return _json(await required(current_services().requests).get(card_id, viewer()))
    except ActorError as error:
        return respond(Refusal.from_err(error.err), request.path)


@blueprint.post("/v1/requests/<card_id>/cancel")
@role(Role.KEY)
async def cancel_request(card_id: str):
    return await _signal(card_id, "cancel")


@blueprint.post("/v1/requests/<card_id>/interrupt")
@role(Role.KEY)
async def interrupt_request(card_id: str):
    return await _signal(card_id, "interrupt")


async def _signal(card_id: str, kind: str) -> Response:
    try:
        card = await required(current_services().requests).signal(card_id, kind, viewer())
    except ActorError as error:
        return respond(Refusal.from_err(error.err), request.path)
    return _json({**card, "signal": kind})
