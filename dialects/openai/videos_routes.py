"""OpenAI's video (Sora) routes on the sdcpp lane. A video is a job of kind `video` on the durable job plane: its
runner asks the model's sd-server child to render (`POST /sdcpp/v1/vid_gen`), polls the child's job, and keeps the
finished container on the job row (spilled to an artifact past 1 MiB). The routes are mailboxes over that plane:
create, retrieve, list, content, delete, the job view and its cancel, and the live capabilities menu.
"""

from __future__ import annotations

import base64
import contextlib
import json
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, request

from dialects.current import current_services, required
from dialects.edge import caller, json_response, limit_arg, refuse, viewer
from dialects.roles import Role, role
from dialects.wire import RequestError, decode_object
from lanes import sdcpp
from supervisors.caller import Caller
from supervisors.jobs import JobContext, JobFailed, job_view, new_job_id
from supervisors.refusal import Refusal
from supervisors.relay import acting_for, admit_work
from supervisors.services import Services

from . import videos_translate as t
from .sdcpp_calls import engine_json, live_menu

blueprint = Blueprint("videos", __name__)

DEFAULT_FPS = 16  # sd-server's vid_gen default when its capabilities do not say
POLL_SECS = 0.5
STATUS = {"queued": "queued", "running": "in_progress", "completed": "completed", "failed": "failed",
          "cancelled": "cancelled"}


# ----- create


async def _body() -> dict[str, Any]:
    """JSON, or the multipart form the official SDK sends (text fields; a file part is an input reference)."""
    if (request.mimetype or "").startswith("multipart/"):
        form = await request.form
        files = await request.files
        body: dict[str, Any] = {name: form.get(name) for name in form}
        for name in files:
            body[name] = "(file)"
        return body
    return decode_object(await request.get_data(cache=True, as_text=False, parse_form_data=False))


@blueprint.post("/v1/videos")
@blueprint.post("/v1/videos/generations")
@role(Role.KEY)
async def create_video():
    services = current_services()
    try:
        body = await _body()
        installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths, "vid_gen")
        video = t.check_video(body, installed=installed)
        who = caller()
        await admit_work(services, who, video.model)
        job_id = new_job_id("video").replace("job_video_", "video_")
        await required(services.jobs).create("video", model=video.model, key=who.key, job_id=job_id,
                                             request={"video": msgspec.to_builtins(video)})
        row = await required(services.jobs).get(job_id)
    except (RequestError, Refusal) as error:
        return refuse(error)
    assert row is not None  # just created
    return json_response(video_object(row))


async def run_video_job(services: Services, ctx: JobContext) -> dict[str, Any]:
    video = msgspec.convert(ctx.request["video"], t.VideoRequest)
    try:
        async with acting_for(services, ctx.key, trace_id=ctx.id) as who:
            return await _render(services, ctx, video, who)
    except Refusal as refusal:
        raise JobFailed(refusal.message, fix=refusal.fix or "submit it again") from None


async def _render(services: Services, ctx: JobContext, video: t.VideoRequest, who: Caller) -> dict[str, Any]:
    capabilities = await engine_json(services, video.model, who, "GET", "/sdcpp/v1/capabilities")
    defaults = (capabilities.get("defaults_by_mode") or {}).get("vid_gen") or capabilities.get("defaults") or {}
    fps: int = defaults["fps"] if isinstance(defaults.get("fps"), int) else DEFAULT_FPS
    submitted = await engine_json(services, video.model, who, "POST", "/sdcpp/v1/vid_gen",
                             t.engine_body(video, default_fps=fps))
    child_job = str(submitted.get("id") or "")
    if not child_job:
        raise Refusal(502, f"sd-server accepted the video without a job id: {submitted}")
    ctx.event("engine_job", id=child_job)
    try:
        while True:
            state = await engine_json(services, video.model, who, "GET", f"/sdcpp/v1/jobs/{child_job}")
            if state.get("status") in ("completed", "failed", "cancelled"):
                break
            await trio.sleep(POLL_SECS)
    except trio.Cancelled:
        # Cancelled (DELETE, cancel, shutdown): a queued engine job is dropped; a running one cannot be interrupted.
        with trio.CancelScope(shield=True), trio.move_on_after(5), contextlib.suppress(Refusal):
            await engine_json(services, video.model, who, "POST", f"/sdcpp/v1/jobs/{child_job}/cancel")
        raise
    if state.get("status") != "completed":
        error = state.get("error") or {}
        raise Refusal(502, f"sd-server's video job {state.get('status')}: {error.get('message') or error}")
    result = state.get("result") or {}
    if not result.get("b64_json"):
        raise Refusal(502, "sd-server finished the video without its bytes")
    return {"output_format": result.get("output_format"), "mime_type": result.get("mime_type"),
            "fps": result.get("fps"), "frame_count": result.get("frame_count"), "b64_json": result["b64_json"]}


# ----- read


def _result(row: dict[str, Any]) -> dict[str, Any] | None:
    if row.get("result"):
        return json.loads(row["result"])
    return None


def video_object(row: dict[str, Any], result: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job row as OpenAI's video object (`progress` 0 while queued, 100 when done, omitted in between: the
    engine reports no fraction mid-render)."""
    spec = json.loads(row["request"])["video"]
    status = STATUS.get(row["state"], row["state"])
    view: dict[str, Any] = {"id": row["id"], "object": "video", "model": row["model"], "status": status,
                            "created_at": int(row["created"]), "prompt": spec["prompt"],
                            "size": f"{spec['width']}x{spec['height']}", "seconds": str(spec.get("seconds") or ""),
                            "completed_at": int(row["finished"]) if row.get("finished") else None,
                            "error": json.loads(row["error"]) if row.get("error") else None}
    if status == "queued":
        view["progress"] = 0
    elif status == "completed":
        view["progress"] = 100
        if result is not None and result.get("fps"):
            view["seconds"] = f"{result['frame_count'] / result['fps']:g}"
            view["frame_count"] = result["frame_count"]
    return view


async def _own_video(services: Services, video_id: str) -> dict[str, Any]:
    row = await required(services.jobs).get(video_id, viewer())
    if row is None or row["kind"] != "video":
        raise Refusal(404, f"no video {video_id}", fix="GET /v1/videos lists yours")
    return row


async def _finished(row: dict[str, Any]) -> dict[str, Any] | None:
    """The finished render (inline, or from its artifact file); None when it was purged or pruned."""
    result = _result(row)
    if result is None and row.get("artifact"):
        try:
            result = json.loads(await trio.Path(row["artifact"]).read_text())
        except FileNotFoundError:
            return None
    return result


@blueprint.get("/v1/videos/<video_id>")
@role(Role.KEY)
async def retrieve_video(video_id: str):
    try:
        row = await _own_video(current_services(), video_id)
    except Refusal as error:
        return refuse(error)
    return json_response(video_object(row, await _finished(row) if row["state"] == "completed" else None))


@blueprint.get("/v1/videos")
@role(Role.KEY)
async def list_videos():
    try:
        limit = limit_arg(request.args, 10, 100)
    except Refusal as error:
        return refuse(error)
    rows = await required(current_services().jobs).list(state=None, kind="video", limit=limit + 1, viewer=viewer())
    rows = sorted(rows, key=lambda row: row["updated"], reverse=True)
    data = [video_object(row) for row in rows[:limit]]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit})


@blueprint.get("/v1/videos/<video_id>/content")
@role(Role.KEY)
async def video_content(video_id: str):
    try:
        row = await _own_video(current_services(), video_id)
        if row["state"] != "completed":
            raise Refusal(404, f"video {video_id} is {STATUS.get(row['state'], row['state'])}: there is no content "
                          "yet", fix=f"poll GET /v1/videos/{video_id} until its status is completed")
        if request.args.get("variant", "video") != "video":
            raise Refusal(400, f"variant {request.args.get('variant')!r} is not made here; only the video itself "
                          "(variant=video)")
        result = await _finished(row)
        if result is None:
            raise Refusal(410, f"video {video_id}'s content was deleted or pruned", fix="create the video again")
    except Refusal as error:
        return refuse(error)
    data = await trio.to_thread.run_sync(base64.b64decode, result["b64_json"])
    return Response(data, content_type=result.get("mime_type") or "application/octet-stream")


@blueprint.delete("/v1/videos/<video_id>")
@role(Role.KEY)
async def delete_video(video_id: str):
    """Idempotent on every state: a queued or rendering video is cancelled, a finished one's render is purged
    (its content then answers 410); the record stays, as every job's does."""
    services = current_services()
    try:
        row = await _own_video(services, video_id)
    except Refusal as error:
        return refuse(error)
    await required(services.jobs).purge(row["id"], viewer())
    return json_response({"id": video_id, "object": "video.deleted", "deleted": True})


@blueprint.get("/v1/videos/jobs/<video_id>")
@role(Role.KEY)
async def video_job(video_id: str):
    try:
        row = await _own_video(current_services(), video_id)
    except Refusal as error:
        return refuse(error)
    view = job_view(row, artifact_url=f"/v1/jobs/{video_id}/artifact")
    view["object"] = "video.job"
    if isinstance(view.get("result"), dict):
        view["result"] = {k: v for k, v in view["result"].items() if k != "b64_json"} | {
            "content_url": f"/v1/videos/{video_id}/content"}
    return json_response(view)


@blueprint.post("/v1/videos/jobs/<video_id>/cancel")
@role(Role.KEY)
async def cancel_video_job(video_id: str):
    services = current_services()
    try:
        await _own_video(services, video_id)
    except Refusal as error:
        return refuse(error)
    state, row = await required(services.jobs).cancel_and_read(video_id, viewer())
    view = video_object(row)
    if state == "cancelling":
        view["status"] = "cancelling"
    return json_response(view)


@blueprint.get("/v1/videos/capabilities")
@role(Role.KEY)
async def video_capabilities():
    """The live menu of every loaded video model (a GET never loads one)."""
    try:
        menu = await live_menu(current_services(), caller(), "vid_gen", request.args.get("model"),
                               what="video model", fix="create a video with it first (POST /v1/videos)")
    except Refusal as error:
        return refuse(error)
    return json_response(menu)
