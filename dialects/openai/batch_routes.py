"""OpenAI files and the Batch API: POST /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content; POST and GET
/v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel. A batch is a job of kind `batch` (see
dialects/batches.py); its output and error files are rendered from its stored items when read."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, request

from dialects.batches import count_lines, decode_lines
from dialects.chat_core import completion_result, run_chat
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, limit_arg, owner, refuse, viewer
from dialects.roles import Role, role
from dialects.wire import RequestError, check_choices, require_model
from supervisors.batches import ItemFailed, counts_of, item_rows, run_items
from supervisors.caller import Caller
from supervisors.instance import UpstreamCall
from supervisors.jobs import TERMINAL, JobContext
from supervisors.refusal import Refusal
from supervisors.relay import admit_work, forward
from supervisors.services import Services

from .responses_routes import answer
from .responses_translate import check_request as check_response_request
from .responses_translate import new_id
from .translate import check_chat

blueprint = Blueprint("openai_batches", __name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PURPOSES = ("batch", "user_data")
WINDOW_SECS = 24 * 3600


# ------------------------------------------------------------------ files


def _file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


async def _file_row(services: Services, file_id: str) -> dict[str, Any] | None:
    rows = await services.ledger.query("SELECT * FROM files WHERE id = ?", (file_id,))
    if not rows:
        return None
    who = viewer()
    return rows[0] if who is None or rows[0]["key_name"] == who else None


@blueprint.post("/v1/files")
@role(Role.KEY)
async def upload_file():
    services = current_services()
    form = await request.form
    files = await request.files
    purpose = form.get("purpose")
    upload = files.get("file")
    if upload is None:
        return refuse(Refusal(400, "`file` is required: send multipart/form-data with a `file` part and a `purpose`"))
    if purpose not in PURPOSES:
        return refuse(Refusal(400, f"`purpose` must be one of {', '.join(PURPOSES)} (this gateway keeps files for "
                              f"batches), got {purpose!r}"))
    data = upload.read()
    try:
        await admit_work(services, caller())
    except Refusal as error:
        return refuse(error)
    key = owner()
    file_id = f"file-{secrets.token_hex(12)}"
    path = services.paths.home / "files" / file_id
    await trio.to_thread.run_sync(_write, path, data)
    row = {"id": file_id, "purpose": purpose, "filename": upload.filename or "upload.jsonl", "bytes": len(data),
           "created": time.time(), "key_name": key, "path": str(path)}
    if not await _insert_within_quota(services, row):
        await trio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
        return refuse(await _quota_refusal(services, key, len(data)))
    return json_response(_file_object(row))


UNLIMITED = 2**62


async def _insert_within_quota(services: Services, row: dict[str, Any]) -> bool:
    """Record the upload only while its key stays within `files_per_key` and `file_storage_per_key_mib` (an
    open gateway's files count as one owner's). The check and the insert are one statement in the ledger, so
    two uploads racing each other cannot both pass a quota that has room for one."""
    config = services.config
    files_cap = config.files_per_key or UNLIMITED
    bytes_cap = config.file_storage_per_key_mib * 1024 * 1024 or UNLIMITED
    inserted = await services.ledger.query(
        "INSERT INTO files (id, purpose, filename, bytes, created, key_name, path) SELECT ?, ?, ?, ?, ?, ?, ? "
        "WHERE (SELECT COUNT(*) FROM files WHERE key_name IS ?) < ? "
        "AND (SELECT COALESCE(SUM(bytes), 0) FROM files WHERE key_name IS ?) + ? <= ? RETURNING id",
        (*(row[k] for k in ("id", "purpose", "filename", "bytes", "created", "key_name", "path")),
         row["key_name"], files_cap, row["key_name"], row["bytes"], bytes_cap))
    return bool(inserted)


async def _quota_refusal(services: Services, key: str | None, size: int) -> Refusal:
    """The teaching 429 for an upload over its key's quota, naming the setting it is over."""
    config = services.config
    rows = await services.ledger.query("SELECT COUNT(*) AS files, COALESCE(SUM(bytes), 0) AS bytes FROM files "
                                       "WHERE key_name IS ?", (key,))
    files, stored = int(rows[0]["files"]), int(rows[0]["bytes"])
    whose = f"the API key {key!r}" if key is not None else "this gateway"
    if config.files_per_key and files >= config.files_per_key:
        return Refusal(429, f"{whose} already keeps {files} files; files_per_key allows {config.files_per_key}",
                       code="file_quota", fix="delete files it no longer needs (DELETE /v1/files/{id}), or raise "
                       "files_per_key in config.toml")
    return Refusal(429, f"{whose} keeps {stored} bytes of files and this upload adds {size}; "
                   f"file_storage_per_key_mib allows {config.file_storage_per_key_mib} MiB",
                   code="file_quota", fix="delete files it no longer needs (DELETE /v1/files/{id}), or raise "
                   "file_storage_per_key_mib in config.toml")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def _batch_file(services: Services, file_id: str) -> tuple[dict[str, Any], bytes] | None:
    """A batch's output or error file, rendered from its items: `file-<batch id>-output|errors`."""
    if not file_id.startswith("file-batch_") or not file_id.endswith(("-output", "-errors")):
        return None
    batch_id, which = file_id[len("file-"):].rsplit("-", 1)
    row = await required(services.jobs).get(batch_id, viewer())
    if row is None or row["kind"] != "batch":
        return None
    lines = []
    for item in await item_rows(services, batch_id):
        request_id = f"req_{secrets.token_hex(8)}"
        if which == "output" and item["outcome"] == "succeeded":
            lines.append({"id": f"batch_req_{secrets.token_hex(8)}", "custom_id": item["custom_id"],
                          "response": {"status_code": 200, "request_id": request_id, "body": item["body"]},
                          "error": None})
        elif which == "errors" and item["outcome"] == "errored":
            error = {"code": item["body"]["code"], "message": item["body"]["message"]}
            lines.append({"id": f"batch_req_{secrets.token_hex(8)}", "custom_id": item["custom_id"],
                          "response": None, "error": error})
    data = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
    meta = {"id": file_id, "purpose": "batch_output", "filename": f"{batch_id}_{which}.jsonl", "bytes": len(data),
            "created": row["finished"] or row["updated"]}
    return meta, data


@blueprint.get("/v1/files/<file_id>")
@role(Role.KEY)
async def get_file(file_id: str):
    services = current_services()
    rendered = await _batch_file(services, file_id)
    if rendered is not None:
        return json_response(_file_object(rendered[0]))
    row = await _file_row(services, file_id)
    if row is None:
        return refuse(Refusal(404, f"no file {file_id}", fix="upload one with POST /v1/files"))
    return json_response(_file_object(row))


@blueprint.delete("/v1/files/<file_id>")
@role(Role.KEY)
async def delete_file(file_id: str):
    """OpenAI's file delete: the owner's upload (or any, for an admin key) leaves the ledger and the disk. A
    batch still queued or running reads its input file (again after a restart), so that file is kept until
    the batch ends."""
    services = current_services()
    row = await _file_row(services, file_id)
    if row is None:
        hint = "batch output and error files are rendered from the batch; they go with it" \
            if file_id.startswith("file-batch_") else "GET /v1/files/{id} shows a file you own"
        return refuse(Refusal(404, f"no file {file_id}", fix=hint))
    readers = await services.ledger.query(
        "SELECT id FROM jobs WHERE kind = 'batch' AND state IN ('queued', 'running') AND "
        "json_extract(request, '$.input_file_id') = ?", (file_id,))
    if readers:
        batch = readers[0]["id"]
        return refuse(Refusal(409, f"file {file_id} is the input of batch {batch}, which has not finished",
                              fix=f"delete it once the batch ends, or cancel the batch first: POST "
                              f"/v1/batches/{batch}/cancel"))
    await services.ledger.execute("DELETE FROM files WHERE id = ?", (file_id,))
    await trio.to_thread.run_sync(lambda: Path(row["path"]).unlink(missing_ok=True))
    return json_response({"id": file_id, "object": "file", "deleted": True})


@blueprint.get("/v1/files/<file_id>/content")
@role(Role.KEY)
async def file_content(file_id: str):
    services = current_services()
    rendered = await _batch_file(services, file_id)
    if rendered is not None:
        return Response(rendered[1], content_type="application/jsonl")
    row = await _file_row(services, file_id)
    if row is None:
        return refuse(Refusal(404, f"no file {file_id}", fix="upload one with POST /v1/files"))
    try:
        data = await trio.to_thread.run_sync(Path(row["path"]).read_bytes)
    except FileNotFoundError:
        return refuse(Refusal(410, f"file {file_id}'s content was removed from {row['path']}",
                              fix="upload it again"))
    return Response(data, content_type="application/octet-stream")


# ------------------------------------------------------------------ batches


async def _openai_item(services: Services, endpoint: str, item: dict[str, Any], who: Caller) -> dict[str, Any]:
    if "_invalid" in item:
        raise ItemFailed(400, "invalid_json", item["_invalid"])
    if not isinstance(item.get("custom_id"), str):
        raise ItemFailed(400, "invalid_request", "each line needs a string `custom_id`")
    if item.get("method", "POST") != "POST" or item.get("url") != endpoint:
        raise ItemFailed(400, "invalid_request", f"this batch's endpoint is {endpoint}: every line must be "
                         f"{{\"method\": \"POST\", \"url\": \"{endpoint}\"}}, got {item.get('url')!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise ItemFailed(400, "invalid_request", "`body` must be the request object for the endpoint")
    body = {**body, "stream": False}
    model = require_model(body)
    if endpoint == "/v1/chat/completions":
        check_chat(body)
        result = await run_chat(services, body, who, choices=check_choices(body))
        return result.payload or {}
    if endpoint == "/v1/responses":
        check_response_request({**body, "background": False})
        return await answer(services, body, new_id("resp"), who)
    reply = await forward(services, model, UpstreamCall(method="POST", path=endpoint, body=msgspec.json.encode(body),
                                                        stream=False, content_type="application/json"), who)
    return completion_result(reply, strip=False).payload or {}


async def run_openai_batch(services: Services, ctx: JobContext) -> dict[str, Any]:
    rows = await services.ledger.query("SELECT path FROM files WHERE id = ?", (ctx.request["input_file_id"],))
    data = await trio.to_thread.run_sync(Path(rows[0]["path"]).read_bytes) if rows else b""
    endpoint = ctx.request["endpoint"]
    counts = await run_items(services, ctx, await decode_lines(data),
                             lambda item, who: _openai_item(services, endpoint, item, who))
    return {"counts": counts}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    spec = json.loads(row["request"])
    counts = counts_of(row, spec["total"])
    state = row["state"]
    status = {"queued": "validating", "running": "in_progress", "completed": "completed", "failed": "failed",
              "cancelled": "cancelled"}[state]
    ended = state in TERMINAL
    finished = int(row["finished"]) if row["finished"] else None
    errors = None
    if state == "failed" and row["error"]:
        failure = json.loads(row["error"])
        errors = {"object": "list", "data": [{"code": "batch_failed", "message": failure["message"], "param": None,
                                              "line": None}]}
    return {
        "id": row["id"], "object": "batch", "endpoint": spec["endpoint"], "errors": errors,
        "input_file_id": spec["input_file_id"], "completion_window": "24h", "status": status,
        "output_file_id": f"file-{row['id']}-output" if ended and counts["succeeded"] else None,
        "error_file_id": f"file-{row['id']}-errors" if ended and counts["errored"] else None,
        "created_at": int(row["created"]), "in_progress_at": int(row["started"]) if row["started"] else None,
        "expires_at": int(row["created"] + WINDOW_SECS), "finalizing_at": finished if state == "completed" else None,
        "completed_at": finished if state == "completed" else None,
        "failed_at": finished if state == "failed" else None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": finished if state == "cancelled" else None,
        "request_counts": {"total": counts["total"], "completed": counts["succeeded"], "failed": counts["errored"]},
        "metadata": spec.get("metadata") or None,
    }


@blueprint.post("/v1/batches")
@role(Role.KEY)
async def create_batch():
    services = current_services()
    try:
        body = await json_body()
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise RequestError(f"`endpoint` must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise RequestError("`completion_window` must be \"24h\"", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
            raise RequestError("`metadata` must be an object of at most 16 string keys", param="metadata")
        file_id = body.get("input_file_id")
        row = await _file_row(services, file_id) if isinstance(file_id, str) else None
        if row is None:
            raise Refusal(404, f"no file {file_id!r}: upload the JSONL input first",
                          fix="POST /v1/files with purpose=batch, then pass its id as input_file_id")
        if row["purpose"] != "batch":
            raise RequestError(f"file {file_id} was uploaded with purpose {row['purpose']!r}; batches read "
                               "purpose=batch files", param="input_file_id")
        data = await trio.to_thread.run_sync(Path(row["path"]).read_bytes)
        total = await count_lines(data)
        if total == 0:
            raise RequestError(f"file {file_id} has no request lines", param="input_file_id")
        await admit_work(services, caller())
    except (RequestError, Refusal) as error:
        return refuse(error)
    batch_id = f"batch_{secrets.token_hex(12)}"
    jobs = required(services.jobs)
    await jobs.create("batch", model=None, key=owner(), job_id=batch_id, request={
        "endpoint": endpoint, "input_file_id": file_id, "total": total, "metadata": metadata})
    row = await jobs.get(batch_id)
    assert row is not None  # created above; job rows are archived, never deleted
    return json_response(batch_object(row))


@blueprint.get("/v1/batches")
@role(Role.KEY)
async def list_batches():
    try:
        limit = limit_arg(request.args, 20, 100)
    except Refusal as error:
        return refuse(error)
    rows = await required(current_services().jobs).list(state=None, kind="batch", limit=limit, viewer=viewer())
    data = [batch_object(r) for r in rows]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": False})


async def _batch_row(batch_id: str) -> dict[str, Any] | None:
    row = await required(current_services().jobs).get(batch_id, viewer())
    return row if row is not None and row["kind"] == "batch" else None


@blueprint.get("/v1/batches/<batch_id>")
@role(Role.KEY)
async def get_batch(batch_id: str):
    row = await _batch_row(batch_id)
    if row is None:
        return refuse(Refusal(404, f"no batch {batch_id}", fix="GET /v1/batches lists yours"))
    return json_response(batch_object(row))


@blueprint.post("/v1/batches/<batch_id>/cancel")
@role(Role.KEY)
async def cancel_batch(batch_id: str):
    services = current_services()
    row = await _batch_row(batch_id)
    if row is None:
        return refuse(Refusal(404, f"no batch {batch_id}", fix="GET /v1/batches lists yours"))
    await required(services.jobs).cancel(batch_id, viewer())
    row = await required(services.jobs).get(batch_id)
    assert row is not None  # found above; job rows are archived, never deleted
    view = batch_object(row)
    if view["status"] in ("validating", "in_progress"):
        view["status"] = "cancelling"
        view["cancelling_at"] = int(time.time())
    return json_response(view)
