"""The request registry: live request cards, cancel/interrupt from another connection, completion
metadata cards, and singleflight for identical concurrent non-stream requests.

Card lifecycle (only this actor's loop changes a card):
    queued -> running -> done | cancelled | interrupted | disconnected | failed
Terminal cards move to a bounded per-boot ring. A route holds only its request's `Control`
(events it waits on); it reports progress with fire-and-forget `Update` messages.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import trio

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell

TERMINAL_RING = 512
PARTIAL_LIMIT = 64 * 1024
COMPLETION_CARDS = 4096


@dataclass
class Control:
    """What a running request listens to: set by the registry when someone cancels or interrupts it.
    A route's wait on the engine sits in a cancel scope it registers here (`watching`), so a stop cancels
    it directly: no watcher task per request."""

    id: str
    stop: trio.Event = field(default_factory=trio.Event)
    kind: str = ""  # "cancel" | "interrupt"
    follow: Any = None  # singleflight: a channel to wait on as a follower, None as the leader
    scopes: set[trio.CancelScope] = field(default_factory=set)

    def signal(self, kind: str) -> None:
        self.kind = kind
        self.stop.set()
        for scope in self.scopes:
            scope.cancel()


class Open(Envelope, frozen=True, kw_only=True, tag="open"):
    trace_id: str
    model: str
    route: str
    stream: bool
    flight_key: str | None  # singleflight: join the flight of identical requests
    key: str | None  # the API key that made it (None on an open gateway)


class Update(Envelope, frozen=True, kw_only=True, tag="update"):
    id: str
    fields: dict
    partial: str  # appended


class Close(Envelope, frozen=True, kw_only=True, tag="close"):
    id: str
    state: str
    fields: dict
    partial: str
    flight_key: str | None  # singleflight: hand `result` to the followers
    result: Any


class Get(Envelope, frozen=True, kw_only=True, tag="get"):
    id: str
    viewer: str | None  # a scoped key's name: it sees only its own cards; None sees all


class List(Envelope, frozen=True, kw_only=True, tag="list"):
    model: str | None
    state: str | None
    viewer: str | None


class Signal(Envelope, frozen=True, kw_only=True, tag="signal"):
    id: str
    kind: str
    viewer: str | None


class SaveCompletion(Envelope, frozen=True, kw_only=True, tag="save_completion"):
    card: dict


class UpdateCompletion(Envelope, frozen=True, kw_only=True, tag="update_completion"):
    id: str
    metadata: dict
    owner: str | None  # the key asking: only the key that created a completion changes its metadata



def _visible(card: dict[str, Any], viewer: str | None) -> bool:
    return viewer is None or card.get("key") == viewer


class RequestRegistry(MessageLoop):
    name = "requests"

    def __init__(self) -> None:
        self.live: dict[str, dict[str, Any]] = {}
        self.controls: dict[str, Control] = {}
        self.finished: deque[dict[str, Any]] = deque(maxlen=TERMINAL_RING)
        self.completions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.flights: dict[str, list[trio.MemorySendChannel]] = {}

    async def handle(self, message: Envelope) -> Reply | None:
        control: Control | None  # a Signal may find none
        match message:
            case Open():
                card_id = f"req_{secrets.token_hex(8)}"
                self.live[card_id] = {"id": card_id, "object": "request", "trace_id": message.trace_id,
                                      "model": message.model, "route": message.route, "stream": message.stream,
                                      "key": message.key,
                                      "state": "queued", "created": time.time(), "engine": None, "tokens": None,
                                      "queue_ms": None, "compute_ms": None, "partial": ""}
                control = Control(card_id)
                self.controls[card_id] = control
                if message.flight_key is not None:
                    control.follow = self._join(message.flight_key)
                return Ok(control)
            case Update(id=card_id, fields=fields, partial=partial):
                card = self.live.get(card_id)
                if card is not None:
                    card.update(fields)
                    if partial and len(card["partial"]) < PARTIAL_LIMIT:
                        card["partial"] = (card["partial"] + partial)[:PARTIAL_LIMIT]
                return None
            case Close(id=card_id, state=state, fields=fields):
                if message.flight_key is not None:
                    self._publish(message.flight_key, message.result)
                card = self.live.pop(card_id, None)
                self.controls.pop(card_id, None)
                if card is not None:
                    card.update(fields)
                    if message.partial:
                        card["partial"] = (card["partial"] + message.partial)[:PARTIAL_LIMIT]
                    card["state"] = state
                    card["finished"] = time.time()
                    self.finished.append(card)
                return None
            case Get(id=card_id, viewer=viewer):
                card = self.live.get(card_id) or next((c for c in self.finished if c["id"] == card_id), None)
                if card is None or not _visible(card, viewer):
                    return Err("request_not_found", f"no request {card_id} in this boot's cards",
                               fix="GET /v1/requests lists live requests and the recent finished ones", status=404)
                return Ok(dict(card))
            case List(model=model, state=state, viewer=viewer):
                rows = [*self.live.values(), *reversed(self.finished)]
                rows = [dict(c) for c in rows if model in (None, c["model"]) and state in (None, c["state"])
                        and _visible(c, viewer)]
                return Ok(rows)
            case Signal(id=card_id, kind=kind, viewer=viewer):
                control = self.controls.get(card_id)
                if control is not None and not _visible(self.live[card_id], viewer):
                    control = None  # another key's request: it does not exist for this caller
                if control is None:
                    known = any(c["id"] == card_id and _visible(c, viewer) for c in self.finished)
                    return Err("request_finished" if known else "request_not_found",
                               f"request {card_id} has already finished" if known else f"no live request {card_id}",
                               fix="GET /v1/requests lists the live ones", status=409 if known else 404)
                if kind == "interrupt" and not self.live[card_id]["stream"]:
                    return Err("interrupt_needs_stream",
                               f"request {card_id} is not streamed, so there is no partial answer to keep",
                               fix=f"POST /v1/requests/{card_id}/cancel stops it instead", status=409)
                control.signal(kind)
                return Ok(dict(self.live[card_id]))
            case SaveCompletion(card=card):
                self.completions[card["id"]] = card
                while len(self.completions) > COMPLETION_CARDS:
                    self.completions.popitem(last=False)
                return None
            case UpdateCompletion(id=card_id, metadata=metadata, owner=owner):
                card = self.completions.get(card_id)
                if card is None or card.get("key") != owner:  # another key's completion: not there, for it
                    return Err("completion_not_found",
                               f"no stored completion {card_id}: only non-stream completions created with a "
                               f"`metadata` object are kept, and only the last {COMPLETION_CARDS}",
                               fix="create the completion with \"metadata\": {...} and stream false", status=404)
                card["metadata"] = metadata
                self.completions.move_to_end(card_id)
                return Ok({name: value for name, value in card.items() if name != "key"})  # its owner stays private
        return Err("unknown_op", f"request registry does not understand {type(message).__name__}")

    def _join(self, key: str) -> trio.MemoryReceiveChannel | None:
        """None: lead (ask the engine). A channel: follow (the leader's result arrives there)."""
        followers = self.flights.get(key)
        if followers is None:
            self.flights[key] = []
            return None
        send, receive = trio.open_memory_channel[Any](1)
        followers.append(send)
        return receive

    def _publish(self, key: str, result: Any) -> None:
        for follower in self.flights.pop(key, []):
            try:
                follower.send_nowait(result)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass  # that follower's client left


class RequestsClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def open(self, *, trace_id: str, model: str, route: str, stream: bool,
                   flight_key: str | None = None, key: str | None = None) -> Control:
        return await call(self.mailbox, lambda r: Open(reply=r, trace_id=trace_id, model=model, route=route,
                                                         stream=stream, flight_key=flight_key, key=key))

    def update(self, card_id: str, partial: str = "", **fields: Any) -> None:
        tell(self.mailbox, Update(reply=None, id=card_id, fields=fields, partial=partial))

    async def close(self, card_id: str, state: str, *, partial: str = "", flight_key: str | None = None,
                    result: Any = None, **fields: Any) -> None:
        message = Close(reply=None, id=card_id, state=state, fields=fields, partial=partial, flight_key=flight_key,
                        result=result)
        try:
            self.mailbox.send_nowait(message)  # no scheduler pass on the way out of every request
        except trio.WouldBlock:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.mailbox.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the registry has stopped (shutdown): no card to close

    async def get(self, card_id: str, viewer: str | None = None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Get(reply=r, id=card_id, viewer=viewer))

    async def list(self, model: str | None, state: str | None, viewer: str | None = None) -> list[dict[str, Any]]:
        return await call(self.mailbox, lambda r: List(reply=r, model=model, state=state, viewer=viewer))

    async def signal(self, card_id: str, kind: str, viewer: str | None = None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Signal(reply=r, id=card_id, kind=kind, viewer=viewer))

    def save_completion(self, card: dict[str, Any]) -> None:
        tell(self.mailbox, SaveCompletion(reply=None, card=card))

    async def update_completion(self, card_id: str, metadata: dict[str, str], owner: str | None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: UpdateCompletion(reply=r, id=card_id, metadata=metadata,
                                                                   owner=owner))

