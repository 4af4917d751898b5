"""The ResponseStore actor: stored Responses API objects, durable across restarts.

A hot LRU of the last 256 responses in memory, written through to the ledger's `responses` table; a
miss in memory is read from disk and promoted. Each response lives 24 hours (`expires`); an expired one
is gone for GET and chaining alike, and expired rows are swept hourly. Conversations are the responses
filed under one name, listed chronologically.

Only this actor's loop changes the LRU; disk work goes through the Ledger actor.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

import msgspec
import trio

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call
from .ledger import LedgerClient

HOT = 256
TTL_SECS = 24 * 3600
SWEEP_SECS = 3600


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What is kept of one response: its body (served verbatim), and the whole chat it ends (for chaining)."""

    id: str
    created: float
    key: str | None
    conversation: str | None
    previous_id: str | None
    body: dict
    messages: list


class Put(Envelope, frozen=True, kw_only=True, tag="put_response"):
    response: StoredResponse


class Get(Envelope, frozen=True, kw_only=True, tag="get_response"):
    id: str
    viewer: str | None


class Conversation(Envelope, frozen=True, kw_only=True, tag="conversation"):
    name: str
    viewer: str | None


class DeleteConversation(Envelope, frozen=True, kw_only=True, tag="delete_conversation"):
    name: str
    viewer: str | None


class _Sweep(Envelope, frozen=True, kw_only=True, tag="sweep_responses"):
    pass


def _from_row(row: dict[str, Any]) -> StoredResponse:
    return StoredResponse(id=row["id"], created=row["created"], key=row["key_name"], conversation=row["conversation"],
                          previous_id=row["previous_id"], body=json.loads(row["body"]),
                          messages=json.loads(row["messages"]))


class ResponseStore(MessageLoop):
    name = "responses"

    def __init__(self, ledger: LedgerClient, *, clock: Any = time.time) -> None:
        self.ledger = ledger
        self.clock = clock
        self.hot: OrderedDict[str, StoredResponse] = OrderedDict()
        self.mailbox: trio.MemorySendChannel  # set by supervise()

    async def on_start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._sweeper)

    async def _sweeper(self) -> None:
        while True:
            await self.mailbox.send(_Sweep(reply=None))
            await trio.sleep(SWEEP_SECS)

    def _fresh(self, stored: StoredResponse) -> bool:
        return self.clock() < stored.created + TTL_SECS

    def _remember(self, stored: StoredResponse) -> None:
        self.hot[stored.id] = stored
        self.hot.move_to_end(stored.id)
        while len(self.hot) > HOT:
            self.hot.popitem(last=False)

    async def handle(self, message: Envelope) -> Reply | None:
        stored: StoredResponse | None  # a Get may find none
        match message:
            case Put(response=stored):
                await self.ledger.execute(
                    "INSERT OR REPLACE INTO responses (id, created, expires, key_name, conversation, previous_id, "
                    "body, messages) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (stored.id, stored.created, stored.created + TTL_SECS, stored.key, stored.conversation,
                     stored.previous_id, json.dumps(stored.body), json.dumps(stored.messages)))
                self._remember(stored)
                return Ok(None)
            case Get(id=response_id, viewer=viewer):
                stored = self.hot.get(response_id)
                if stored is None:
                    rows = await self.ledger.query("SELECT * FROM responses WHERE id = ?", (response_id,))
                    stored = _from_row(rows[0]) if rows else None
                    if stored is not None:
                        self._remember(stored)  # promoted: the next read is served from memory
                if stored is None or not self._fresh(stored) or (viewer is not None and stored.key != viewer):
                    return Ok(None)
                return Ok(stored)
            case Conversation(name=name, viewer=viewer):
                rows = await self.ledger.query(
                    "SELECT * FROM responses WHERE conversation = ? AND expires > ? ORDER BY created, id",
                    (name, self.clock()))
                return Ok([_from_row(r) for r in rows if viewer is None or r["key_name"] == viewer])
            case DeleteConversation(name=name, viewer=viewer):
                rows = await self.ledger.query("SELECT id, key_name FROM responses WHERE conversation = ?", (name,))
                ids = [r["id"] for r in rows if viewer is None or r["key_name"] == viewer]
                for response_id in ids:
                    await self.ledger.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                    self.hot.pop(response_id, None)
                return Ok(ids)
            case _Sweep():
                now = self.clock()
                await self.ledger.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                for response_id in [k for k, v in self.hot.items() if not self._fresh(v)]:
                    del self.hot[response_id]
                return None
        return Err("unknown_op", f"responses does not understand {type(message).__name__}")


class ResponsesClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def put(self, stored: StoredResponse) -> None:
        await call(self.mailbox, lambda r: Put(reply=r, response=stored))

    async def get(self, response_id: str, viewer: str | None = None) -> StoredResponse | None:
        return await call(self.mailbox, lambda r: Get(reply=r, id=response_id, viewer=viewer))

    async def conversation(self, name: str, viewer: str | None = None) -> list[StoredResponse]:
        return await call(self.mailbox, lambda r: Conversation(reply=r, name=name, viewer=viewer))

    async def delete_conversation(self, name: str, viewer: str | None = None) -> list[str]:
        return await call(self.mailbox, lambda r: DeleteConversation(reply=r, name=name, viewer=viewer))
