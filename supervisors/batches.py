"""The batch runner, for both dialects: one job per batch, its items replayed one after another through the same
canonical calls as live requests, under the batch owner's caller (admission, quotas) at low priority, so
interactive requests keep the engine's other slot and overtake queued items (EDF tiers).

Each finished item is a row in `batch_items` (outcome + body) as soon as it ends, so a batch survives a
gateway restart: the job is resumable, and on resume it skips the items already done. A malformed
item fails that item, never the batch. An item refused with 503 all_slots_busy never reached the engine
and is tried again after a pause. What one item is (translate, call) is the dialect's `ItemWork`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from blazar.errors import TeachingError

from .caller import Caller
from .jobs import JobContext
from .refusal import Refusal
from .relay import acting_for
from .services import Services

BUSY_PAUSE_SECS = 2.0
RETENTION_SECS = 24 * 3600


class ItemFailed(Exception):
    """One item's failure: its HTTP-like status, error code and teaching message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


# One item's work, done as the batch owner's caller (admitted and charged per item, at low priority).
ItemWork = Callable[[dict[str, Any], Caller], Awaitable[dict[str, Any]]]


async def run_items(services: Services, ctx: JobContext, items: list[dict[str, Any]], work: ItemWork) -> dict[str, Any]:
    """Run every item not done yet; returns the request counts. `work(item, caller)` answers the item's body or
    raises ItemFailed, a Refusal or another teaching error (a request that does not check)."""
    done = {row["idx"]: row["outcome"] for row in await services.ledger.query(
        "SELECT idx, outcome FROM batch_items WHERE job_id = ?", (ctx.id,))}
    counts = {"total": len(items), "succeeded": sum(o == "succeeded" for o in done.values()),
              "errored": sum(o == "errored" for o in done.values())}
    if ctx.resumed and done:
        ctx.event("resumed_items", done=len(done), remaining=len(items) - len(done))
    for index, item in enumerate(items):
        if index in done:
            continue
        outcome, body = await _one(services, ctx, item, work)
        await services.ledger.execute(
            "INSERT OR REPLACE INTO batch_items (job_id, idx, custom_id, outcome, body) VALUES (?, ?, ?, ?, ?)",
            (ctx.id, index, str(item.get("custom_id", index)), outcome, json.dumps(body)))
        counts[outcome] += 1
        ctx.progress(**counts)
    return counts


async def _one(services: Services, ctx: JobContext, item: dict[str, Any], work: ItemWork) -> tuple[str, dict[str, Any]]:
    while True:
        try:
            async with acting_for(services, ctx.key, trace_id=ctx.id) as who:
                return "succeeded", await work(item, who)
        except Refusal as refusal:
            if refusal.code == "all_slots_busy":
                await trio.sleep(BUSY_PAUSE_SECS)  # it never reached the engine: wait for a slot, try again
                continue
            message = f"{refusal.message} (fix: {refusal.fix})" if refusal.fix else refusal.message
            return "errored", {"status": refusal.status, "code": refusal.code or "request_failed", "message": message}
        except ItemFailed as failure:
            return "errored", {"status": failure.status, "code": failure.code, "message": failure.message}
        except TeachingError as error:  # the item's body did not decode or check (the dialect's RequestError)
            return "errored", {"status": error.status, "code": "invalid_request" if error.status == 400
                               else "request_failed", "message": error.message}


async def item_rows(services: Services, job_id: str) -> list[dict[str, Any]]:
    rows = await services.ledger.query(
        "SELECT idx, custom_id, outcome, body FROM batch_items WHERE job_id = ? ORDER BY idx", (job_id,))
    return [{**row, "body": json.loads(row["body"])} for row in rows]


def counts_of(row: dict[str, Any], total: int) -> dict[str, int]:
    """The request counts of a batch job: its last progress, or its result once it ended."""
    for source in (row.get("result"), row.get("progress")):
        if source:
            value = json.loads(source)
            counts = value.get("counts", value)
            if "total" in counts:
                return counts
    return {"total": total, "succeeded": 0, "errored": 0}


def expired(row: dict[str, Any]) -> bool:
    return bool(row.get("finished")) and time.time() > row["finished"] + RETENTION_SECS
