"""Batches, for both dialects: one job per batch, its items replayed one after another through the same
canonical calls as live requests, under the batch owner's key (admission, quotas) and at low priority,
so interactive requests keep the engine's other slot and overtake queued items (EDF tiers).

Each finished item is a row in `batch_items` (outcome + body) as soon as it ends, so a batch survives a
gateway restart: the job is resumable, and on resume it skips the items already done. A malformed
item fails that item, never the batch. An item refused with 503 all_slots_busy never reached the engine
and is tried again after a pause.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from supervisors.caller import Caller
from supervisors.jobs import JobContext
from supervisors.services import Services

from .edge import Refusal, acting_for
from .wire import RequestError

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
    """Run every item not done yet; returns the request counts. `work(item, caller)` answers the item's body or raises
    ItemFailed / RequestError / Refusal."""
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
        except RequestError as error:
            return "errored", {"status": 400, "code": "invalid_request", "message": error.message}
        except ItemFailed as failure:
            return "errored", {"status": failure.status, "code": failure.code, "message": failure.message}


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


MAX_BATCH_LINES = 50_000  # requests per batch input file, as OpenAI's Batch API allows
DETAILED_LINE_ERRORS = 100  # bad lines whose parse error is kept word for word; later ones share one message
_LATER_BAD_LINE = (f"not a JSON object (the exact parse error is kept for the first {DETAILED_LINE_ERRORS} bad "
                   "lines of a file only; check this one the same way)")


class BatchFileRefused(RequestError):
    """A batch input file refused as a whole (too many lines): a teaching 400 about `input_file_id`."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="input_file_id")


def _too_many_lines() -> BatchFileRefused:
    return BatchFileRefused(f"the input file has more than {MAX_BATCH_LINES:,} request lines; a batch takes at most "
                            f"{MAX_BATCH_LINES:,} (one JSON object per line, blank lines not counted). Split it "
                            "into several files and create one batch for each")


def scan_lines(data: bytes, *, keep: bool = True) -> tuple[list[dict[str, Any]], int]:
    """Blocking (run it in a worker thread): a JSONL batch input file -> (items, request line count). Read one
    line at a time, stopping with BatchFileRefused at line MAX_BATCH_LINES + 1, so a hostile file costs at
    most that many items. A line that is not a JSON object becomes an item that fails alone; only the first
    DETAILED_LINE_ERRORS of them carry their own parse error. `keep=False` only counts."""
    items: list[dict[str, Any]] = []
    count = bad = 0
    for number, raw in enumerate(io.BytesIO(data), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_BATCH_LINES:
            raise _too_many_lines()
        if not keep:
            continue
        line = raw.decode(errors="replace")
        try:
            item = msgspec.json.decode(line)
        except msgspec.DecodeError as error:
            item, reason = None, f"line {number} is not valid JSON ({error})"
        else:
            reason = "" if isinstance(item, dict) else f"line {number} is not a JSON object"
        if reason:
            bad += 1
            items.append({"custom_id": f"line-{number}",
                          "_invalid": reason if bad <= DETAILED_LINE_ERRORS else _LATER_BAD_LINE})
            continue
        items.append(item)
    return items, count


async def decode_lines(data: bytes) -> list[dict[str, Any]]:
    """A JSONL batch input file's items, decoded in a worker thread (see scan_lines). Raises BatchFileRefused."""
    items, _ = await trio.to_thread.run_sync(scan_lines, data)
    return items


async def count_lines(data: bytes) -> int:
    """How many requests a batch input file holds, counted in a worker thread without decoding them. Raises
    BatchFileRefused past MAX_BATCH_LINES."""
    _, count = await trio.to_thread.run_sync(lambda: scan_lines(data, keep=False))
    return count
