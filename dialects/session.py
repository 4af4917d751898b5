"""One request session for every generation route of every dialect (OpenAI /v1/chat/completions and
/v1/completions, Ollama /api/chat and /api/generate, Anthropic /v1/messages): per-key admission, a
request card from arrival to the last byte, cancel and interrupt from another connection
(POST /v1/requests/{id}/cancel|interrupt), and singleflight for identical buffered requests.

Lifecycle of a card (the RequestRegistry actor owns it; this helper only sends it messages):

    queued (opened before the engine is asked) -> running (the stream has begun)
        -> done | failed | cancelled | interrupted | disconnected   (closed exactly once)

A route opens a session, hands it the work (`run`), and relays what comes back: a buffered
`ChatResult`, a stream of chunk dicts (already carded: text recorded, stops honoured between
chunks), or a raw engine byte stream, which the route relays with `sse()` so that no chunk is
parsed twice on the OpenAI hot path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import trio
from quart import Response, request

from supervisors.caller import Caller
from supervisors.refusal import Refusal
from supervisors.relay import admit_request
from supervisors.requests import RequestsClient
from supervisors.services import Services

from .chat_core import ChatResult, StreamBroken, run_chat
from .current import blazar_scope
from .edge import caller, follow_or_lead, owner, sse_response, tracked

PROGRESS_EVERY = 8  # text pieces between card updates: the card stays live without a message per token


def text_of(payload: dict[str, Any]) -> str:
    """The first choice's text of a buffered chat or completion answer."""
    choice = (payload.get("choices") or [{}])[0]
    return str((choice.get("message") or {}).get("content") or choice.get("text") or "")


def flight_key(body: dict[str, Any], *parts: Any) -> str | None:
    """What makes two buffered requests identical: the route, the body and the spawn shape. Streams never
    share a flight."""
    if body.get("stream") is True:
        return None
    return "\0".join((request.path, request.headers.get("x-blazar-num-ctx", ""), *map(repr, parts),
                      msgspec.json.encode(body).decode()))


class RequestSession:
    """One generation request, seen from its route."""

    def __init__(self, services: Services, control: Any, *, stream: bool, flight: str | None,
                 charge: Callable[[int], None] | None) -> None:
        self.services = services
        self.control = control
        self.stream = stream
        self.flight = flight
        self.charge = charge
        self.started = trio.current_time()
        self._pending: list[str] = []
        self._tokens = 0

    @classmethod
    async def open(cls, services: Services, model: str, *, stream: bool, flight: str | None = None) -> RequestSession:
        # Admitted before singleflight: a follower served from another request's answer still counts.
        charge = await admit_request(services, model, "tokens", caller())
        assert services.requests is not None  # the composition root starts the request registry
        trace_id = blazar_scope(request.scope).get("blazar.trace_id", "")
        control = await services.requests.open(trace_id=trace_id, model=model,
                                               route=request.path, stream=stream, flight_key=flight, key=owner())
        return cls(services, control, stream=stream, flight=flight, charge=charge)

    @property
    def _requests(self) -> RequestsClient:
        assert self.services.requests is not None  # open() asked it for this session's card
        return self.services.requests

    @property
    def id(self) -> str:
        return self.control.id

    def _compute_ms(self) -> float:
        return round((trio.current_time() - self.started) * 1000, 1)

    async def run(self, ask: Callable[[], Awaitable[ChatResult]]) -> ChatResult:
        """`ask()` under this session: singleflight and a closed card for a buffered answer; for a stream,
        the card stays open until the relay ends (`carried` chunks close it; a raw stream needs `sse`)."""
        if not self.stream:
            return await self._buffered(ask)
        try:
            result = await tracked(self.services, self.control, ask)
        except BaseException as error:
            await self._requests.close(self.id, "cancelled" if getattr(error, "status", 0) == 499
                                               else "failed", compute_ms=self._compute_ms())
            raise
        if result.payload is not None:
            await self.finish("done", partial=text_of(result.payload))
            return result
        self._requests.update(self.id, state="running", queue_ms=round(result.queued_secs * 1000, 1))
        if result.chunks is not None:
            return ChatResult(chunks=self._carried(result.chunks), headers=result.headers,
                              queued_secs=result.queued_secs)
        return result

    async def _buffered(self, ask: Callable[[], Awaitable[ChatResult]]) -> ChatResult:
        state, outcome, led, closing = "failed", None, self.control.follow is None, {}
        try:
            result, led = await tracked(self.services, self.control, lambda: follow_or_lead(self.control, ask))
            outcome = result
            usage = (result.payload or {}).get("usage") or {}
            if not led and self.charge is not None:  # the leader's engine counts were charged to the leader
                self.charge(int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0))
            state = "done"
            closing = {"partial": text_of(result.payload or {}), "tokens": usage.get("completion_tokens"),
                       "queue_ms": round(result.queued_secs * 1000, 1)}
            return result
        except Refusal as error:
            state = "cancelled" if error.status == 499 else "failed"
            if error.status != 499:
                outcome = error  # followers of this flight get the same refusal
            raise
        except BaseException:
            state = "disconnected"
            raise
        finally:
            await self._requests.close(self.id, state, flight_key=self.flight if led else None,
                                               result=outcome, compute_ms=self._compute_ms(), **closing)

    def saw(self, piece: str) -> None:
        """A piece of streamed text, kept on the card (sent every few pieces)."""
        self._pending.append(piece)
        self._tokens += 1
        if len(self._pending) >= PROGRESS_EVERY:
            self._requests.update(self.id, partial="".join(self._pending))
            self._pending.clear()

    async def finish(self, state: str, *, partial: str = "") -> None:
        """Close the card (shielded: it runs in a stream's cleanup too)."""
        with trio.CancelScope(shield=True):
            await self._requests.close(self.id, state, partial="".join(self._pending) + partial,
                                               tokens=self._tokens or None, compute_ms=self._compute_ms())
        self._pending.clear()

    async def _carried(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """Chunk dicts relayed with the card kept: a cancel ends the stream with the dialect's error frame
        (StreamBroken), an interrupt as a normal finish. Checked between chunks (one per token)."""
        state = "disconnected"
        try:
            async for chunk in chunks:
                if self.control.stop.is_set():
                    if self.control.kind == "interrupt":
                        state = "interrupted"
                        return
                    state = "cancelled"
                    raise StreamBroken(f"request {self.id} was cancelled from another connection "
                                       f"(POST /v1/requests/{self.id}/cancel)")
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if isinstance(piece, str) and piece:
                        self.saw(piece)
                yield chunk
            state = "done"
        except StreamBroken:
            if state != "cancelled":
                state = "failed"
            raise
        finally:
            with trio.CancelScope(shield=True):
                close_upstream = getattr(chunks, "aclose", None)
                if close_upstream is not None:
                    await close_upstream()  # closes the engine request now, not when collected
                await self.finish(state)

    def sse(self, result: ChatResult, rewrite: Callable[[bytes], bytes], error_frame: Callable[[str], bytes], *,
            headers: dict[str, str] | None = None, interrupt_frame: Callable[[], bytes] | None = None,
            cancel_frame: Callable[[str], bytes] | None = None) -> Response:
        """Relay a raw engine byte stream; `rewrite` reports text through `saw`. The card closes when it ends."""
        assert result.stream is not None  # a result asked for with raw_stream
        return sse_response(result.stream, rewrite, error_frame, headers, control=self.control,
                            interrupt_frame=interrupt_frame, cancel_frame=cancel_frame, finish=self.finish)


async def chat_session(services: Services, body: dict[str, Any], who: Caller, *, keep_alive: float | None = None,
                       num_ctx: int | None = None, spawn_options: dict[str, Any] | None = None) -> ChatResult:
    """The canonical chat call (`run_chat`) inside a request session: what Ollama and Anthropic routes use.
    Raises Refusal like run_chat (499 when cancelled from another connection)."""
    session = await RequestSession.open(services, body["model"], stream=body.get("stream") is True,
                                        flight=flight_key(body, num_ctx, sorted((spawn_options or {}).items())))
    return await session.run(lambda: run_chat(services, body, who, keep_alive=keep_alive, num_ctx=num_ctx,
                                              spawn_options=spawn_options))
