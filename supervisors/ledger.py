"""The Ledger actor: sole owner of the apsw connection.

States: opening -> serving -> closed. Every database call runs in `trio.to_thread` behind a
CapacityLimiter(1), so the trio thread never blocks on SQLite and calls never interleave.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from blazar import ledger as db

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell


class Execute(Envelope, frozen=True, kw_only=True, tag="execute"):
    sql: str
    params: tuple


class Query(Envelope, frozen=True, kw_only=True, tag="query"):
    sql: str
    params: tuple


class LedgerActor(MessageLoop):
    name = "ledger"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.connection: db.apsw.Connection | None = None
        self.limiter = trio.CapacityLimiter(1)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.connection = await trio.to_thread.run_sync(db.open_ledger, self.path, limiter=self.limiter)

    async def on_stop(self) -> None:
        if self.connection is not None:
            connection, self.connection = self.connection, None
            await trio.to_thread.run_sync(connection.close, limiter=self.limiter)

    async def handle(self, message: Envelope) -> Reply | None:
        assert self.connection is not None  # on_start opened it before the first message
        try:
            match message:
                case Execute(sql=sql, params=params):
                    rowid = await trio.to_thread.run_sync(
                        db.execute, self.connection, sql, params, limiter=self.limiter)
                    return Ok(rowid)
                case Query(sql=sql, params=params):
                    rows = await trio.to_thread.run_sync(
                        db.query, self.connection, sql, params, limiter=self.limiter)
                    return Ok(rows)
        except db.apsw.Error as error:
            return Err("ledger", f"ledger error: {error}", status=500)
        return Err("unknown_op", f"ledger does not understand {type(message).__name__}")


class LedgerClient:
    """Typed calls into the Ledger actor's mailbox."""

    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def execute(self, sql: str, params: tuple = ()) -> int:
        return await call(self.mailbox, lambda r: Execute(reply=r, sql=sql, params=params))

    async def query(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        return await call(self.mailbox, lambda r: Query(reply=r, sql=sql, params=params))

    def record_event(self, kind: str, *, model: str | None = None, **detail: Any) -> bool:
        """Fire-and-forget: an event log must never slow or fail the request that caused it."""
        return tell(self.mailbox, Execute(reply=None,
            sql="INSERT INTO events (ts, kind, model, detail) VALUES (?, ?, ?, ?)",
            params=(time.time(), kind, model, json.dumps(detail, default=str)),
        ))

    async def recent_events(self, limit: int = 100, kind: str | None = None) -> list[dict[str, Any]]:
        if kind:
            return await self.query(
                "SELECT * FROM events WHERE kind = ? ORDER BY id DESC LIMIT ?", (kind, limit))
        return await self.query("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
