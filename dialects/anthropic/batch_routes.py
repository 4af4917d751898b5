"""Anthropic Message Batches: POST and GET /v1/messages/batches, GET and DELETE /v1/messages/batches/{id},
POST /v1/messages/batches/{id}/cancel, GET /v1/messages/batches/{id}/results (JSONL). A batch is a job of kind
`message_batch`; its items replay through the same translation as /v1/messages (dialects/batches.py)."""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
from quart import Blueprint, Response, request

from dialects.chat_core import run_chat
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, limit_arg, owner, refuse, viewer
from dialects.roles import Role, role
from dialects.wire import RequestError
from supervisors.batches import RETENTION_SECS, ItemFailed, counts_of, expired, item_rows, run_items
from supervisors.caller import Caller
from supervisors.jobs import TERMINAL, JobContext
from supervisors.refusal import Refusal
from supervisors.relay import admit_work
from supervisors.services import Services

from . import translate as t

blueprint = Blueprint("anthropic_batches", __name__)

MAX_REQUESTS = 10_000


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


async def _message_item(services: Services, item: dict[str, Any], who: Caller) -> dict[str, Any]:
    params = item.get("params")
    if not isinstance(params, dict):
        raise ItemFailed(400, "invalid_request_error", "`params` must be a Messages API request object")
    if params.get("stream") is True:
        raise ItemFailed(400, "invalid_request_error", "`params.stream` cannot be true inside a batch")
    canonical = t.to_openai({**params, "stream": False})
    result = await run_chat(services, canonical, who)
    return t.from_openai(result.payload or {}, canonical["model"], params.get("stop_sequences"))


async def run_message_batch(services: Services, ctx: JobContext) -> dict[str, Any]:
    counts = await run_items(services, ctx, ctx.request["requests"],
                             lambda item, who: _message_item(services, item, who))
    return {"counts": counts}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    total = len(json.loads(row["request"])["requests"])
    counts = counts_of(row, total)
    state = row["state"]
    ended = state in TERMINAL
    canceled = total - counts["succeeded"] - counts["errored"] if state == "cancelled" else 0
    processing = 0 if ended else total - counts["succeeded"] - counts["errored"]
    return {
        "id": row["id"], "type": "message_batch", "processing_status": "ended" if ended else "in_progress",
        "request_counts": {"processing": processing, "succeeded": counts["succeeded"], "errored": counts["errored"],
                           "canceled": canceled, "expired": 0},
        "ended_at": _iso(row["finished"]), "created_at": _iso(row["created"]),
        "expires_at": _iso(row["created"] + RETENTION_SECS), "archived_at": _iso(row.get("archived")),
        "cancel_initiated_at": None,
        "results_url": f"{request.host_url.rstrip('/')}/v1/messages/batches/{row['id']}/results" if ended else None,
    }


def _missing(batch_id: str) -> Response:
    return refuse(Refusal(404, f"no message batch {batch_id}", fix="GET /v1/messages/batches lists yours"))


async def _row(batch_id: str) -> dict[str, Any] | None:
    row = await required(current_services().jobs).get(batch_id, viewer())
    return row if row is not None and row["kind"] == "message_batch" and not row.get("archived") else None


@blueprint.post("/v1/messages/batches")
@role(Role.KEY)
async def create_batch():
    services = current_services()
    try:
        body = await json_body()
        requests = body.get("requests")
        if not isinstance(requests, list) or not requests or len(requests) > MAX_REQUESTS:
            raise RequestError(f"`requests` must be an array of 1 to {MAX_REQUESTS} "
                               "{\"custom_id\": …, \"params\": {…}} objects")
        seen: set[str] = set()
        for index, item in enumerate(requests):
            custom_id = item.get("custom_id") if isinstance(item, dict) else None
            if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 64:
                raise RequestError(f"`requests[{index}].custom_id` must be a string of 1-64 characters")
            if custom_id in seen:
                raise RequestError(f"`requests[{index}].custom_id` {custom_id!r} is used twice; each must be unique")
            seen.add(custom_id)
        await admit_work(services, caller())
    except (RequestError, Refusal) as error:
        return refuse(error)
    batch_id = f"msgbatch_{secrets.token_hex(12)}"
    jobs = required(services.jobs)
    await jobs.create("message_batch", model=None, key=owner(), job_id=batch_id, request={"requests": requests})
    row = await jobs.get(batch_id)
    assert row is not None  # created above; job rows are archived, never deleted
    return json_response(batch_object(row))


@blueprint.get("/v1/messages/batches")
@role(Role.KEY)
async def list_batches():
    try:
        limit = limit_arg(request.args, 20, 1000)
    except Refusal as error:
        return refuse(error)
    rows = await required(current_services().jobs).list(state=None, kind="message_batch", limit=limit, viewer=viewer())
    data = [batch_object(r) for r in rows if not r.get("archived")]
    return json_response({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


@blueprint.get("/v1/messages/batches/<batch_id>")
@role(Role.KEY)
async def get_batch(batch_id: str):
    row = await _row(batch_id)
    return _missing(batch_id) if row is None else json_response(batch_object(row))


@blueprint.post("/v1/messages/batches/<batch_id>/cancel")
@role(Role.KEY)
async def cancel_batch(batch_id: str):
    services = current_services()
    row = await _row(batch_id)
    if row is None:
        return _missing(batch_id)
    state, row = await required(services.jobs).cancel_and_read(batch_id, viewer())
    view = batch_object(row)
    if state == "cancelling":
        view["processing_status"] = "canceling"
        view["cancel_initiated_at"] = _iso(time.time())
    return json_response(view)


async def _ended_row(batch_id: str, what: str, fix: str) -> dict[str, Any]:
    """The batch's row once it has ended; a 404 or a 409 (still processing) otherwise."""
    row = await _row(batch_id)
    if row is None:
        raise Refusal(404, f"no message batch {batch_id}", fix="GET /v1/messages/batches lists yours")
    if row["state"] not in TERMINAL:
        raise Refusal(409, f"message batch {batch_id} is still processing: {what}", fix=fix)
    return row


@blueprint.get("/v1/messages/batches/<batch_id>/results")
@role(Role.KEY)
async def batch_results(batch_id: str):
    services = current_services()
    try:
        row = await _ended_row(batch_id, "results are ready once processing_status is \"ended\"",
                               f"poll GET /v1/messages/batches/{batch_id}")
    except Refusal as error:
        return refuse(error)
    if expired(row):
        return refuse(Refusal(404, f"message batch {batch_id}'s results expired 24 hours after it ended"))
    done = {item["idx"]: item for item in await item_rows(services, batch_id)}
    lines = []
    for index, item in enumerate(json.loads(row["request"])["requests"]):
        result = done.get(index)
        if result is None:
            outcome: dict[str, Any] = {"type": "canceled"}
        elif result["outcome"] == "succeeded":
            outcome = {"type": "succeeded", "message": result["body"]}
        else:
            kind = "invalid_request_error" if result["body"]["status"] == 400 else "api_error"
            outcome = {"type": "errored", "error": {"type": "error", "error": {
                "type": kind, "message": result["body"]["message"]}}}
        lines.append(msgspec.json.encode({"custom_id": item["custom_id"], "result": outcome}) + b"\n")
    return Response(b"".join(lines), content_type="application/x-jsonl")


@blueprint.delete("/v1/messages/batches/<batch_id>")
@role(Role.KEY)
async def delete_batch(batch_id: str):
    try:
        await _ended_row(batch_id, "only an ended batch can be deleted",
                         f"cancel it first: POST /v1/messages/batches/{batch_id}/cancel")
    except Refusal as error:
        return refuse(error)
    await required(current_services().jobs).archive(batch_id)
    return json_response({"id": batch_id, "type": "message_batch_deleted"})
