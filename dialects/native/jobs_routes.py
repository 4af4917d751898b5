"""The durable job plane: /v1/jobs, one job, its cancel, its event trail, its spilled artifact.

Mailboxes only: reads are ledger queries through the JobsClient, a cancel is one message to the Job
supervisor. A scoped API key sees only its own jobs; an admin key (or an open gateway) sees all."""

from __future__ import annotations

from pathlib import Path

import trio
from quart import Blueprint, Response, request

from dialects.current import current_services, required
from dialects.edge import json_response, limit_arg, refuse, viewer
from dialects.roles import Role, role
from supervisors.jobs import TERMINAL, job_view
from supervisors.refusal import Refusal

blueprint = Blueprint("jobs", __name__)

STATES = ("queued", "running", *TERMINAL)


def _missing(job_id: str) -> Response:
    return refuse(Refusal(404, f"no job {job_id}", fix="GET /v1/jobs lists your jobs"))


@blueprint.get("/v1/jobs")
@role(Role.KEY)
async def list_jobs():
    args = request.args
    state, kind = args.get("state"), args.get("kind")
    if state is not None and state not in STATES:
        return refuse(Refusal(400, f"?state= must be one of {', '.join(STATES)}; got {state!r}"))
    try:
        limit = limit_arg(args, 50, 1000)
    except Refusal as error:
        return refuse(error)
    rows = await required(current_services().jobs).list(state=state, kind=kind, limit=limit, viewer=viewer())
    return json_response({"object": "list", "data": [job_view(r) for r in rows]})


@blueprint.get("/v1/jobs/<job_id>")
@role(Role.KEY)
async def get_job(job_id: str):
    row = await required(current_services().jobs).get(job_id, viewer())
    return _missing(job_id) if row is None else json_response(job_view(row))


@blueprint.post("/v1/jobs/<job_id>/cancel")
@role(Role.KEY)
async def cancel_job(job_id: str):
    """Idempotent: a finished job is answered as it is; a live one is cancelled (its task stops)."""
    jobs = required(current_services().jobs)
    await jobs.cancel(job_id, viewer())  # refusals (404) render through the app's ActorError handler
    row = await jobs.get(job_id, viewer())
    if row is None:
        return _missing(job_id)
    view = job_view(row)
    if row["state"] not in TERMINAL:
        view["status"] = "cancelling"
    return json_response(view)


@blueprint.get("/v1/jobs/<job_id>/events")
@role(Role.KEY)
async def job_events(job_id: str):
    jobs = required(current_services().jobs)
    if await jobs.get(job_id, viewer()) is None:
        return _missing(job_id)
    return json_response({"object": "list", "data": await jobs.events(job_id)})


@blueprint.get("/v1/jobs/<job_id>/artifact")
@role(Role.KEY)
async def job_artifact(job_id: str):
    row = await required(current_services().jobs).get(job_id, viewer())
    if row is None:
        return _missing(job_id)
    if not row.get("artifact"):
        return refuse(Refusal(404, f"job {job_id} has no artifact: its result is inline (GET /v1/jobs/{job_id})"))
    path = Path(row["artifact"])
    try:
        data = await trio.to_thread.run_sync(path.read_bytes)
    except FileNotFoundError:
        return refuse(Refusal(410, f"job {job_id}'s artifact was pruned from {path}",
                              fix="submit the job again to produce it"))
    return Response(data, content_type="application/json" if path.suffix == ".json" else "application/octet-stream",
                    headers={"content-length": str(len(data))})
