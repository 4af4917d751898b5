"""The Responses API: POST /v1/responses (and /responses), GET /v1/responses/{id}, GET and DELETE
/v1/conversations/{id}. Mailboxes: the chat goes through the canonical chat call in a request session,
stored responses through the ResponseStore actor, background ones through the Job supervisor."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from quart import Blueprint, Response

from dialects.chat_core import StreamBroken, run_chat
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, owner, refuse, viewer
from dialects.roles import Role, role
from dialects.session import RequestSession, flight_key
from dialects.wire import RequestError
from supervisors.caller import Caller
from supervisors.jobs import JobFailed
from supervisors.refusal import Refusal
from supervisors.relay import acting_for, admit_work
from supervisors.responses import StoredResponse
from supervisors.services import Services

from . import responses_translate as t

blueprint = Blueprint("responses", __name__)


class PreviousMissing(LookupError):
    """previous_response_id names no stored response."""


async def _history(services: Services, body: dict[str, Any], key_view: str | None
                   ) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation a request continues (previous_response_id, else its named conversation's latest
    response), and the conversation it is filed under (inherited through the chain)."""
    conversation = t.conversation_name(body)
    previous_id = body.get("previous_response_id")
    if previous_id:
        previous = await required(services.responses).get(previous_id, key_view)
        if previous is None:
            raise PreviousMissing(previous_id)
        return previous.messages, conversation or previous.conversation
    if conversation:
        thread = await required(services.responses).conversation(conversation, key_view)
        if thread:
            return thread[-1].messages, conversation
    return [], conversation


async def _route_history(services: Services, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    try:
        return await _history(services, body, viewer())
    except PreviousMissing as missing:
        raise Refusal(404, f"previous_response_id {missing.args[0]!r} is not stored: it never was (store: false), "
                      "or it expired after 24 hours", fix="send the whole conversation in `input` instead") from None


async def _store(services: Services, response_id: str, body: dict[str, Any], conversation: str | None,
                 turn: list[dict[str, Any]], message: dict[str, Any], stored_body: dict[str, Any],
                 key: str | None) -> None:
    if body.get("store", True):
        await required(services.responses).put(StoredResponse(
            id=response_id, created=time.time(), key=key, conversation=conversation,
            previous_id=body.get("previous_response_id"), body=stored_body, messages=[*turn, message]))


async def answer(services: Services, body: dict[str, Any], response_id: str, who: Caller) -> dict[str, Any]:
    """One buffered response, stored when asked: the work of a background job or a batch item (`who`: the job's
    caller), outside any HTTP request."""
    key = who.key
    try:
        history, conversation = await _history(services, body, key)
    except PreviousMissing as missing:
        raise JobFailed(f"previous_response_id {missing.args[0]!r} is no longer stored",
                        fix="send the whole conversation in `input`") from None
    chat, turn = t.to_chat(body, history)
    result = await run_chat(services, {**chat, "stream": False}, who)
    payload = result.payload or {}
    message = t.chat_message(payload)
    obj = t.response_object(response_id, body, status="completed", output=t.output_items(message),
                            usage=t.usage_of(payload.get("usage")), created=time.time(), conversation=conversation)
    await _store(services, response_id, body, conversation, turn, message, obj, key)
    return obj


async def run_background(services: Services, ctx: Any) -> dict[str, Any]:
    """A background response's job: the answer is stored; a refusal becomes the job's teaching failure."""
    try:
        async with acting_for(services, ctx.key, trace_id=ctx.id, priority=None) as who:
            return await answer(services, ctx.request["body"], ctx.id, who)
    except (RequestError, Refusal) as error:
        raise JobFailed(error.message, fix=getattr(error, "fix", "") or "fix the request and submit it again") from None


@blueprint.post("/v1/responses")
@blueprint.post("/responses")
@role(Role.KEY)
async def create_response():
    services = current_services()
    try:
        body = await json_body()
        t.check_request(body)
        response_id = t.new_id("resp")
        if body.get("background") is True:
            await _route_history(services, body)  # a missing previous response is refused now, not in the job
            await admit_work(services, caller(), body["model"])
            await required(services.jobs).create("responses", model=body["model"], key=owner(),
                                                 request={"body": body}, job_id=response_id)
            queued = t.response_object(response_id, body, status="queued", output=[], usage=None,
                                       created=time.time(), conversation=t.conversation_name(body))
            return json_response(queued, status=202)
        history, conversation = await _route_history(services, body)
        chat, turn = t.to_chat(body, history)
        stream = chat["stream"]
        session = await RequestSession.open(services, chat["model"], stream=stream,
                                            flight=flight_key(chat, "responses") if not body.get("store", True)
                                            else None)
        result = await session.run(lambda: run_chat(services, chat, caller()))
    except (RequestError, Refusal) as error:
        return refuse(error)
    key = owner()
    if result.payload is not None:
        payload = result.payload
        message = t.chat_message(payload)
        obj = t.response_object(response_id, body, status="completed", output=t.output_items(message),
                                usage=t.usage_of(payload.get("usage")), created=time.time(),
                                conversation=conversation)
        await _store(services, response_id, body, conversation, turn, message, obj, key)
        return json_response(obj, headers=result.headers)
    chunks = result.chunks
    assert chunks is not None  # not buffered and not raw_stream: a stream of chunk dicts
    streamed = t.StreamedResponse(response_id, body, conversation)

    async def events() -> AsyncIterator[bytes]:
        async for frame in streamed.events(chunks, StreamBroken):
            yield frame
        if streamed.final is not None:
            await _store(services, response_id, body, conversation, turn, streamed.message, streamed.final, key)

    response = Response(events(), content_type="text/event-stream",
                        headers={"cache-control": "no-cache", **result.headers})
    response.timeout = None
    return response


@blueprint.get("/v1/responses/<response_id>")
@role(Role.KEY)
async def get_response(response_id: str):
    """A stored response verbatim; a background one's job status while it runs, or its failure."""
    services = current_services()
    stored = await required(services.responses).get(response_id, viewer())
    if stored is not None:
        return Response(msgspec.json.encode(stored.body), content_type="application/json")
    row = await required(services.jobs).get(response_id, viewer())
    if row is None or row["kind"] != "responses":
        return refuse(Refusal(404, f"no stored response {response_id}: responses are kept 24 hours, and only with "
                              "`store: true`", fix="GET /v1/conversations/{name} lists a conversation's responses"))
    body = msgspec.json.decode(row["request"])["body"]
    status = {"queued": "queued", "running": "in_progress", "cancelled": "cancelled"}.get(row["state"], "failed")
    error = None
    if row["state"] == "failed":
        failure = msgspec.json.decode(row["error"]) if row["error"] else {}
        error = {"code": "server_error", "message": f"{failure.get('message', 'failed')} "
                 f"(fix: {failure.get('fix', 'submit it again')})"}
    return json_response(t.response_object(response_id, body, status=status, output=[], usage=None,
                                           created=row["created"], conversation=t.conversation_name(body),
                                           error=error))


@blueprint.get("/v1/conversations/<name>")
@role(Role.KEY)
async def get_conversation(name: str):
    thread = await required(current_services().responses).conversation(name, viewer())
    if not thread:
        return refuse(Refusal(404, f"no conversation {name!r}: a conversation exists once a stored response names "
                              "it", fix="POST /v1/responses with \"conversation\": \"" + name + "\""))
    return json_response({"object": "conversation", "id": name, "created_at": int(thread[0].created),
                          "data": [s.body for s in thread]})


@blueprint.delete("/v1/conversations/<name>")
@role(Role.KEY)
async def delete_conversation(name: str):
    removed = await required(current_services().responses).delete_conversation(name, viewer())
    if not removed:
        return refuse(Refusal(404, f"no conversation {name!r}"))
    return json_response({"object": "conversation.deleted", "id": name, "deleted": True, "responses": removed})
