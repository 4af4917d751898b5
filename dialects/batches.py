"""Batch input files, for both dialects: a JSONL file read one line at a time with a bound on its lines (the
runner that replays the items is supervisors.batches)."""

from __future__ import annotations

import io
from typing import Any

import msgspec
import trio

from .wire import RequestError

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
