"""OpenAI's image routes on the sdcpp lane: mailboxes that decode and check (images_translate), build the caller,
make one call into the lane's child (sd-server) and relay its answer in OpenAI's shape.

A model marked as a fixture (random weights, scripts/fixtures) renders noise; its answers carry the header
`x-blazar-fixture` saying so.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec
import trio
from quart import Blueprint, request

from dialects.current import current_services
from dialects.edge import caller, json_body, json_response, refuse
from dialects.roles import Role, role
from dialects.wire import RequestError
from lanes import sdcpp
from supervisors.caller import Caller
from supervisors.instance import UpstreamCall
from supervisors.refusal import Refusal
from supervisors.relay import buffered, engine_failure, forward
from supervisors.services import Services

from . import images_translate as t

blueprint = Blueprint("images", __name__)

LANE = sdcpp.SdCppLane.kind
DEFAULT_STEPS = 20  # sd-server's own default when its capabilities do not say


async def _engine_json(services: Services, model: str, call: UpstreamCall, who: Caller) -> dict[str, Any]:
    reply = buffered(await forward(services, model, call, who, lane_kind=LANE))
    if reply.status >= 400:
        raise engine_failure(reply)
    try:
        payload = msgspec.json.decode(reply.body)
    except msgspec.DecodeError:
        raise Refusal(502, f"sd-server answered {reply.status} with a body that is not JSON") from None
    if not isinstance(payload, dict):
        raise Refusal(502, "sd-server answered with JSON that is not an object")
    return payload


def _default_steps(capabilities: dict[str, Any]) -> int:
    defaults = capabilities.get("defaults") or {}
    steps = (defaults.get("sample_params") or {}).get("sample_steps")
    return steps if isinstance(steps, int) and steps > 0 else DEFAULT_STEPS


def _png_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG's IHDR chunk (the engine rounds sizes up; the answer says what it made)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def _fixture_note(services: Services, model: str) -> dict[str, str]:
    rows = await trio.to_thread.run_sync(services.lane_clients()[LANE].lane.list_models, services.paths)
    note = next((row.get("note") for row in rows if row["id"] == model and row.get("fixture")), None)
    return {"x-blazar-fixture": str(note)} if note else {}


@blueprint.post("/v1/images/generations")
@role(Role.KEY)
async def generations():
    services = current_services()
    try:
        body = await json_body()
        installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths)
        image = t.check_generation(body, installed=installed)
        for mode in ("async", "stream"):
            if body.get(mode) is not None and body.get(mode) is not False:
                raise RequestError(f"`{mode}` image generation is not built yet on this gateway; send the request "
                                   "without it (it is answered when the image is done)", param=mode)
        who = caller()
        steps = image.steps
        if image.quality is not None:  # scaled from the model's own default, asked of its live child
            capabilities = await _engine_json(services, image.model, UpstreamCall(
                method="GET", path="/sdcpp/v1/capabilities", body=b""), who)
            steps = t.scaled_steps(image.quality, _default_steps(capabilities))
        payload = await _engine_json(services, image.model, UpstreamCall(
            path="/v1/images/generations", body=t.engine_body(image, steps)), who)
        images = [item for item in payload.get("data") or [] if isinstance(item, dict) and item.get("b64_json")]
        if len(images) != image.n:
            raise Refusal(502, f"sd-server returned {len(images)} image(s) for n={image.n}")
        answer: dict[str, Any] = {"created": payload.get("created"), "data": [{"b64_json": item["b64_json"]}
                                                                             for item in images],
                                  "output_format": image.output_format}
        if image.output_format == "png":
            made = _png_size(base64.b64decode(images[0]["b64_json"][:64]))
            if made is not None:
                answer["size"] = f"{made[0]}x{made[1]}"
        if image.quality is not None:
            answer["quality"] = image.quality
        headers = await _fixture_note(services, image.model)
    except (RequestError, Refusal) as error:
        return refuse(error)
    return json_response(answer, headers=headers)


@blueprint.get("/v1/images/capabilities")
@role(Role.KEY)
async def capabilities():
    """The live menu of every loaded diffusion child (samplers, schedulers, defaults, limits, formats); a GET
    never loads a model. `?model=` narrows to one; a name that matches no loaded child is a 400 with the menu."""
    services = current_services()
    try:
        wanted = request.args.get("model")
        live = [row["model"] for row in await services.lane_clients()[LANE].ps()
                if row.get("state") in ("ready", "busy")]
        installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths)
        if wanted is not None and wanted not in live:
            raise Refusal(400, f"?model={wanted} matches no loaded diffusion model (loaded: "
                          f"{', '.join(live) or 'none'}; installed: {', '.join(installed) or 'none'}); a GET never "
                          "loads one",
                          fix=f"load it first: generate an image with it (POST /v1/images/generations, model {wanted})")
        who = caller()
        data = []
        for model in [wanted] if wanted is not None else live:
            card = await _engine_json(services, model, UpstreamCall(method="GET", path="/sdcpp/v1/capabilities",
                                                                    body=b""), who)
            data.append({"model": model, **{k: v for k, v in card.items() if k != "model"}})
    except Refusal as error:
        return refuse(error)
    return json_response({"object": "list", "data": data, "installed": installed})
