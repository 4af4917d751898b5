"""The route side of Blazar's dialects: decode a request, build its caller, render a refusal, relay a stream.

Routes stay mailboxes: they decode and validate, build the caller (`caller()`), and call
`supervisors.relay.forward()`, which admits, asks the model's lane for its instance, submits, and returns what
the instance answers. This module is what every route shares of that: the caller of the current request, the
dialect-shaped error response, JSON bodies, the SSE relay with its cancel, singleflight.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec
import trio
from quart import Response

from blazar.errors import TeachingError
from dialects.current import blazar_scope, key_record
from dialects.wire import RequestError, decode_object
from lanes.remote import HOPS_HEADER
from supervisors.caller import Caller, Echo, LeaseBook
from supervisors.instance import StreamFailure, UpstreamReply, UpstreamStream
from supervisors.refusal import Refusal
from supervisors.relay import engine_failure
from supervisors.services import Services


def respond(error: Refusal, path: str) -> Response:
    """A refusal as the error response of `path`'s dialect (with its Retry-After where it applies)."""
    return Response(error.body(path), status=error.status, content_type="application/json", headers=error.headers())


def refuse(error: TeachingError) -> Response:
    """Any teaching error (a Refusal, the store's, a lane's, a request's decoding) in the error shape of the
    current path's dialect: one renderer for every route."""
    from quart import request

    if not isinstance(error, Refusal):
        error = Refusal(error.status, error.message, fix=error.fix, param=getattr(error, "param", None))
    return respond(error, request.path)


async def json_body() -> dict[str, Any]:
    """The current request's body as a JSON object, or a teaching 400 Refusal."""
    from quart import request

    try:
        return decode_object(await request.get_data(cache=True, as_text=False, parse_form_data=False))  # bytes
    except RequestError as error:
        raise Refusal(400, error.message) from None


def owner(scope: Any = None) -> str | None:
    """The name of the key that made the current request or WebSocket (None on an open gateway)."""
    if scope is None:
        from quart import request

        scope = request.scope
    record = scope.get("blazar.key") if scope.get("blazar.auth") else None
    return record.name if record is not None else None


def limit_arg(args: Any, default: int, highest: int) -> int:
    """A list route's `?limit=`, checked: a whole number from 1 to `highest`."""
    raw = args.get("limit", str(default))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= highest:
        raise Refusal(400, f"?limit= must be a whole number from 1 to {highest} (default {default}); got {raw!r}")
    return int(raw)


def viewer() -> str | None:
    """Whose records the current request may see: a scoped key only its own; an admin key or an open
    gateway all (None)."""
    from quart import request

    record = key_record(request.scope)
    if not request.scope.get("blazar.auth") or record is None or record.admin:
        return None
    return record.name


def caller_of(scope: Any, headers: Any) -> Caller:
    """The caller of an HTTP request or WebSocket, built once per connection from what the auth and request-log
    middleware put in its scope and from Blazar's request headers (a bad X-Blazar-Num-Ctx is a teaching 400)."""
    cached = scope.get("blazar.caller")
    if cached is not None:
        return cast(Caller, cached)
    record = key_record(scope)
    keyed = bool(scope.get("blazar.auth"))
    key = record.name if keyed and record is not None else None
    # As dialects.roles.caller_is_admin: an unscoped key, the CLI's local token, or anyone on an open gateway.
    admin = not keyed or (record is not None and (record.admin or record.source == "local"))
    leases = scope.get("blazar.leases")
    if leases is None:
        leases = blazar_scope(scope)["blazar.leases"] = LeaseBook(once=True)  # the auth middleware gives them back
    caller = Caller(key=key, admin=admin, reshapes_engines=admin or record is None or record.spawn_options,
                    priority=headers.get("x-blazar-priority"), deadline_ms=headers.get("x-blazar-deadline-ms"),
                    num_ctx=num_ctx_header(headers), trace_id=str(scope.get("blazar.trace_id") or ""),
                    hops=_hops(headers), leases=leases, echo=Echo())
    blazar_scope(scope)["blazar.echo"] = caller.echo  # the request-log middleware adds its headers, its model
    blazar_scope(scope)["blazar.caller"] = caller
    return caller


def caller() -> Caller:
    """The caller of the current HTTP request (routes build it once and pass it on)."""
    from quart import request

    return caller_of(request.scope, request.headers)


def _hops(headers: Any) -> int:
    raw = (headers.get(HOPS_HEADER) or "0").strip()
    return int(raw) if raw.isascii() and raw.isdigit() else 0


def reply_header(name: str, value: str) -> None:
    """A header for the response of the current request (added by the request-log middleware at response
    start, whatever route or dialect answers)."""
    caller().echo.headers[name] = value


def num_ctx_header(headers: Any) -> int | None:
    raw = headers.get("x-blazar-num-ctx")
    if raw is None or raw.strip() == "":
        return None
    if not (raw.strip().isascii() and raw.strip().isdigit()) or int(raw) < 128:
        raise Refusal(400, f"X-Blazar-Num-Ctx must be a whole number of tokens ≥ 128, got {raw!r}",
                      fix="e.g. X-Blazar-Num-Ctx: 8192")
    return int(raw)


def json_reply(reply: UpstreamReply, transform: Callable[[Any], Any] | None = None,
               headers: dict[str, str] | None = None) -> Response:
    if reply.status >= 400:
        raise engine_failure(reply)
    body = reply.body
    if transform is not None and "json" in reply.content_type:
        body = msgspec.json.encode(transform(msgspec.json.decode(body)))
    return Response(body, status=reply.status, content_type=reply.content_type or "application/json",
                    headers=headers)


async def tracked(services: Services, control: Any, work: Callable[[], Any]) -> Any:
    """Run `work()` so that a cancel or interrupt from another connection stops it."""
    with trio.CancelScope() as scope:
        if control.stop.is_set():
            scope.cancel()
        control.scopes.add(scope)
        try:
            return await work()
        finally:
            control.scopes.discard(scope)
    raise Refusal(499, f"request {control.id} was cancelled from another connection (POST /v1/requests/{control.id}/"
                  f"{control.kind or 'cancel'})", code="request_cancelled")


async def follow_or_lead(control: Any, work: Callable[[], Any]) -> tuple[Any, bool]:
    """Singleflight: a follower waits for the leader's answer; the leader (or an orphaned follower) asks.
    Returns (result, led)."""
    if control.follow is not None:
        with control.follow:
            outcome = await control.follow.receive()
        if isinstance(outcome, Refusal):
            raise outcome
        if outcome is not None:
            return outcome, False
    return await work(), True


def sse_response(stream: UpstreamStream, rewrite: Callable[[bytes], bytes], error_frame: Callable[[str], bytes],
                 headers: dict[str, str] | None = None, *, control: Any = None,
                 interrupt_frame: Callable[[], bytes] | None = None, cancel_frame: Callable[[str], bytes] | None = None,
                 finish: Callable[[str], Any] | None = None) -> Response:
    """Relay a stream as it arrives. A cancel/interrupt from another connection cancels the wait for the next
    chunk at once (each wait is a cancel scope the request's control holds, never spanning a yield) and ends
    the stream with the dialect's frame; closing the channel closes the upstream request, so the engine stops."""

    async def body() -> AsyncIterator[bytes]:
        state = "disconnected"
        try:
            with stream.chunks:
                while True:
                    item: Any = None
                    with trio.CancelScope() as waiting:
                        if control is not None:
                            control.scopes.add(waiting)
                            if control.stop.is_set():
                                waiting.cancel()
                        try:
                            item = await stream.chunks.receive()
                        except trio.EndOfChannel:
                            state = "done"
                            return
                        finally:
                            if control is not None:
                                control.scopes.discard(waiting)
                    if control is not None and control.stop.is_set():
                        if control.kind == "interrupt" and interrupt_frame is not None:
                            state = "interrupted"
                            yield interrupt_frame()
                        else:
                            state = "cancelled"
                            yield (cancel_frame or error_frame)(
                                f"request {control.id} was cancelled from another connection")
                        return
                    assert item is not None  # only a stop cancels the wait, and a stop ended the stream above
                    if isinstance(item, StreamFailure):
                        state = "failed"
                        yield error_frame(item.message)
                        return
                    out = rewrite(item.data)
                    if out:
                        yield out
        finally:
            if finish is not None:
                with trio.CancelScope(shield=True):
                    await finish(state)

    response = Response(body(), content_type="text/event-stream",
                        headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
    response.timeout = None  # quart-trio would cut a stream at 60 s
    return response


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status=status, headers=headers,
                    content_type="application/json")
