"""OpenAI's image routes on the sdcpp lane: mailboxes that decode and check (images_translate), build the caller,
make one call into the lane's child (sd-server) and relay its answer in OpenAI's shape.

A model marked as a fixture (random weights, scripts/fixtures) renders noise; its answers carry the header
`x-blazar-fixture` saying so.
"""

from __future__ import annotations

import base64
import contextlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, request

from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, refuse, viewer
from dialects.roles import Role, role
from dialects.wire import RequestError
from lanes import sdcpp
from supervisors.caller import Caller
from supervisors.jobs import JobContext, JobFailed, job_view, new_job_id
from supervisors.refusal import Refusal
from supervisors.relay import acting_for, admit_request, admit_work, ensure_model
from supervisors.services import Services

from . import images_translate as t
from .sdcpp_calls import LANE, engine_json, live_menu

blueprint = Blueprint("images", __name__)

DEFAULT_STEPS = 20  # sd-server's own default when its capabilities do not say
KEEPALIVE_SECS = 15.0


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


async def _renders_images(services: Services, model: str, image_models: list[str]) -> None:
    """A diffusion model that renders video only is refused here, before its child loads."""
    if model not in image_models and model in await trio.to_thread.run_sync(sdcpp.installed, services.paths):
        raise Refusal(400, f"{model} renders video, not images; image models: {', '.join(image_models) or 'none'}",
                      fix=f"POST /v1/videos with model {model}, or name an image model")


async def _fixture_note(services: Services, model: str) -> dict[str, str]:
    rows = await trio.to_thread.run_sync(services.lane_clients()[LANE].lane.list_models, services.paths)
    note = next((row.get("note") for row in rows if row["id"] == model and row.get("fixture")), None)
    return {"x-blazar-fixture": str(note)} if note else {}


async def _render(services: Services, image: t.ImageRequest, who: Caller) -> dict[str, Any]:
    """One image request through the model's child, answered in OpenAI's shape."""
    steps = image.steps
    if image.quality is not None:  # scaled from the model's own default, asked of its live child
        capabilities = await engine_json(services, image.model, who, "GET", "/sdcpp/v1/capabilities")
        steps = t.scaled_steps(image.quality, _default_steps(capabilities))
    payload = await engine_json(services, image.model, who, "POST", "/v1/images/generations",
                                t.engine_body(image, steps))
    images = [item for item in payload.get("data") or [] if isinstance(item, dict) and item.get("b64_json")]
    if len(images) != image.n:
        raise Refusal(502, f"sd-server returned {len(images)} image(s) for n={image.n}")
    answer: dict[str, Any] = {"created": payload.get("created"),
                              "data": [{"b64_json": item["b64_json"]} for item in images],
                              "output_format": image.output_format}
    if image.output_format == "png":
        made = _png_size(base64.b64decode(images[0]["b64_json"][:64]))
        if made is not None:
            answer["size"] = f"{made[0]}x{made[1]}"
    if image.quality is not None:
        answer["quality"] = image.quality
    return answer


@blueprint.post("/v1/images/generations")
@role(Role.KEY)
async def generations():
    """Answered when the images are done; `"async": true` answers a job handle at once (the job runs on the
    durable job plane: it survives a gateway restart as a record); `"stream": true` answers SSE: keep-alive
    comments while the engine renders, then one `image_generation.completed` event per image."""
    services = current_services()
    try:
        body = await json_body()
        installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths, "img_gen")
        image = t.check_generation(body, installed=installed)
        await _renders_images(services, image.model, installed)
        run_async, stream = t.check_modes(body)
        who = caller()
        if run_async:
            return await _submit_async(services, image, installed, who)
        return await _answer(services, image, who, stream=stream)
    except (RequestError, Refusal) as error:
        return refuse(error)


async def _answer(services: Services, image: t.ImageRequest, who: Caller, *, stream: bool) -> Response:
    """The images as SSE or as one JSON answer (raises Refusal before the first byte of either)."""
    if stream:
        return await _streamed(services, image, who)
    answer = await _render(services, image, who)
    return json_response(answer, headers=await _fixture_note(services, image.model))


async def _edit_like(*, variation: bool) -> Response:
    services = current_services()
    try:
        form = await request.form
        uploads = await request.files
        fields = {name: form.getlist(name) for name in form}
        files = {name: [part.read() for part in uploads.getlist(name)] for name in uploads}
        if not files:
            raise RequestError("send multipart/form-data with the picture in an `image` file part", param="image")
        installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths, "img_gen")
        image, stream = t.check_edit(fields, files, installed=installed, variation=variation)
        await _renders_images(services, image.model, installed)
        return await _answer(services, image, caller(), stream=stream)
    except (RequestError, Refusal) as error:
        return refuse(error)


@blueprint.post("/v1/images/edits")
@role(Role.KEY)
async def edits():
    """An image redrawn from a prompt (multipart: `image`, optional `mask` for the region to repaint, `prompt`):
    the image is sd-server's init image (`strength`: how much is redrawn), the mask its inpainting mask."""
    return await _edit_like(variation=False)


@blueprint.post("/v1/images/variations")
@role(Role.KEY)
async def variations():
    """Variations of one image (multipart `image`; `prompt` optional): img2img with a random seed unless `seed`."""
    return await _edit_like(variation=True)


@blueprint.post("/v1/images/upscale")
@role(Role.KEY)
async def upscale():
    """Garbage is a 400 like on every route; a well-formed request is a 501 that says why."""
    try:
        body = await json_body()
        if not isinstance(body.get("image"), str) or not body["image"]:
            raise RequestError("`image` (the picture as base64 or a data URL) is required", param="image")
    except (RequestError, Refusal) as error:
        return refuse(error)
    return refuse(Refusal(501, "a standalone upscale needs sd-server's /sdcpp/v1/upscale, which the engine built here "
                          "(stable-diffusion.cpp master-596) does not have; its ESRGAN models run only as the hires "
                          "fix of a generation", fix="render at the size you want with POST /v1/images/generations "
                          "(size up to 2048x2048)"))


# ----- async: a job of kind "image"


async def _submit_async(services: Services, image: t.ImageRequest, installed: list[str], who: Caller) -> Response:
    if image.model not in installed:  # refused now, not as a failed job later
        raise Refusal(404, f"diffusion model {image.model!r} is not installed; installed: "
                      f"{', '.join(installed) or 'none'}", fix="./scripts/fixtures installs the random-weight sd-noise")
    await admit_work(services, who, image.model)
    job_id = new_job_id("image")
    await required(services.jobs).create("image", model=image.model, key=who.key, job_id=job_id,
                                         request={"image": msgspec.to_builtins(image)})
    return json_response({"id": job_id, "object": "image.job", "status": "queued", "model": image.model,
                          "poll_url": f"/v1/images/jobs/{job_id}", "cancel_url": f"/v1/images/jobs/{job_id}/cancel"},
                         status=202, headers=await _fixture_note(services, image.model))


async def run_image_job(services: Services, ctx: JobContext) -> dict[str, Any]:
    image = msgspec.convert(ctx.request["image"], t.ImageRequest)
    try:
        async with acting_for(services, ctx.key, trace_id=ctx.id) as who:
            return await _render(services, image, who)
    except Refusal as refusal:
        raise JobFailed(refusal.message, fix=refusal.fix or "submit it again") from None


def _image_job_view(row: dict[str, Any]) -> dict[str, Any]:
    view = job_view(row, artifact_url=f"/v1/jobs/{row['id']}/artifact")
    view["object"] = "image.job"
    return view


async def _own_image_job(services: Services, job_id: str) -> dict[str, Any]:
    row = await required(services.jobs).get(job_id, viewer())
    if row is None or row["kind"] != "image":
        raise Refusal(404, f"no image job {job_id}", fix="GET /v1/jobs?kind=image lists yours")
    return row


@blueprint.get("/v1/images/jobs/<job_id>")
@role(Role.KEY)
async def image_job(job_id: str):
    try:
        row = await _own_image_job(current_services(), job_id)
    except Refusal as error:
        return refuse(error)
    return json_response(_image_job_view(row))


@blueprint.post("/v1/images/jobs/<job_id>/cancel")
@role(Role.KEY)
async def cancel_image_job(job_id: str):
    """Queued: cancelled at once. Rendering: the job stops waiting for the engine at once (sd-server finishes the
    image it is on, it cannot be interrupted mid-render, and its answer is dropped)."""
    services = current_services()
    try:
        await _own_image_job(services, job_id)
    except Refusal as error:
        return refuse(error)
    state, row = await required(services.jobs).cancel_and_read(job_id, viewer())
    view = _image_job_view(row)
    if state == "cancelling":
        view["status"] = "cancelling"
    return json_response(view)


# ----- stream: SSE


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + msgspec.json.encode(payload) + b"\n\n"


async def _streamed(services: Services, image: t.ImageRequest, who: Caller) -> Response:
    """The render runs as a task under the session supervisor (it outlives this handler); the body relays a
    keep-alive comment every 15 s while it renders, then the images, or an error event. What can be refused is
    refused here, with its own status, before the 200: the key's admission (held until the body has drained) and
    the model's child (loaded now). A client that leaves cancels the render task, which withdraws its place in the
    child's queue."""
    await admit_request(services, image.model, "requests", who)
    await ensure_model(services, image.model, who, lane=services.lane_clients()[LANE])
    send, receive = trio.open_memory_channel[dict[str, Any] | Refusal](1)

    async def render() -> None:
        async with send:
            try:
                outcome: dict[str, Any] | Refusal = await _render(services, image, who)
            except Refusal as refusal:
                outcome = refusal
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await send.send(outcome)  # the client may have left

    headers = await _fixture_note(services, image.model)
    ticket = await required(services.sessions).run_task("image", who.key, render, lambda: {"model": image.model})

    async def events() -> AsyncIterator[bytes]:
        try:
            with receive:
                outcome: dict[str, Any] | Refusal | None = None
                while outcome is None:
                    with trio.move_on_after(KEEPALIVE_SECS):
                        outcome = await receive.receive()
                    if outcome is None:
                        yield b": keep-alive\n\n"
        finally:
            ticket.scope.cancel()  # the client left (or the answer is in): the render task ends now
        if isinstance(outcome, Refusal):
            yield _sse("error", {"type": "error", "error": {"message": outcome.message, "code": outcome.code,
                                                             "hint": outcome.fix}})
            return
        for index, item in enumerate(outcome["data"]):
            yield _sse("image_generation.completed", {
                "type": "image_generation.completed", "index": index, "b64_json": item["b64_json"],
                "created_at": outcome["created"], "size": outcome.get("size"), "quality": outcome.get("quality"),
                "output_format": outcome["output_format"]})

    response = Response(events(), content_type="text/event-stream",
                        headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
    response.timeout = None
    return response


@blueprint.get("/v1/images/capabilities")
@role(Role.KEY)
async def capabilities():
    """The live menu of every loaded diffusion child (samplers, schedulers, defaults, limits, formats); a GET
    never loads a model. `?model=` narrows to one; a name that matches no loaded child is a 400 with the menu."""
    services = current_services()
    try:
        menu = await live_menu(services, caller(), "img_gen", request.args.get("model"), what="image model",
                               fix="load it first: generate an image with it (POST /v1/images/generations)")
    except Refusal as error:
        return refuse(error)
    return json_response(menu)
