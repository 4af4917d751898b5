"""The Job supervisor: every async unit of work (a background response, a batch, a model pull asked over
HTTP) is a row in the ledger's `jobs` table and, while it runs, a task in this actor's nursery.

Lifecycle of a job (only this actor's loop writes its row):

    queued --(a concurrency slot frees)--> running --> completed | failed | cancelled
    queued --Cancel--> cancelled                running --Cancel--> cancelled (its task is cancelled)

- A job's task waits for one of `concurrency` slots, then runs its kind's runner with a `JobContext`.
  The runner reports events (the append-only trail, seq-ordered, bounded) and progress (streamed to
  watchers, last value kept on the row) by message; it returns the result or raises `JobFailed`.
- A result up to 1 MiB is stored inline; a larger one is spilled to `jobs/<id>.json` under the data
  dir and the row points at it (GET /v1/jobs/{id}/artifact; 410 once pruned).
- At boot, rows a previous process left queued or running are resumed when their kind can resume
  (a batch continues with its unfinished items), else closed as failed with a resubmit hint. No row
  stays queued or running without a task behind it.

Reads (list, get, events) are ledger queries; they need no state of this actor.
"""

from __future__ import annotations

import builtins
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from blazar.errors import TeachingError

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell
from .fair_slots import FairSlots
from .ledger import LedgerClient

log = logging.getLogger("blazar.jobs")

TERMINAL = ("completed", "failed", "cancelled")
INLINE_RESULT_BYTES = 1024 * 1024
EVENT_TRAIL = 1000
WATCH_BUFFER = 64


class JobFailed(TeachingError):
    """A runner's teaching failure: what went wrong and the fix (the job row keeps both)."""

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message, fix)


@dataclass
class JobContext:
    """What a runner sees of its job. `event` and `progress` are fire-and-forget messages to the actor."""

    id: str
    kind: str
    model: str | None
    key: str | None
    request: dict[str, Any]
    resumed: bool
    _mailbox: trio.MemorySendChannel

    def event(self, kind: str, **detail: Any) -> None:
        tell(self._mailbox, _Event(reply=None, id=self.id, kind=kind, detail=detail))

    def progress(self, **fields: Any) -> None:
        tell(self._mailbox, _Progress(reply=None, id=self.id, fields=fields))


Runner = Callable[[JobContext], Awaitable[Any]]


@dataclass
class JobKind:
    run: Runner
    resumable: bool = False  # at boot, an unfinished job of this kind continues instead of failing
    # The files a job of this kind was given (an upload kept for it): removed when the job ends, whatever its end.
    inputs: Callable[[dict[str, Any]], list[str]] = field(default=lambda _request: [])


class Create(Envelope, frozen=True, kw_only=True, tag="create"):
    kind: str
    model: str | None
    key: str | None
    request: dict
    job_id: str | None  # a caller that names its job (e.g. `resp_…`) gets that id
    watch: bool  # also answer a channel of its progress, registered before the job starts


class Cancel(Envelope, frozen=True, kw_only=True, tag="cancel"):
    id: str
    viewer: str | None


class Purge(Envelope, frozen=True, kw_only=True, tag="purge"):
    """Drop a job's result (inline and spilled artifact), cancelling it first when it has not ended; the row stays."""

    id: str
    viewer: str | None


class Watch(Envelope, frozen=True, kw_only=True, tag="watch"):
    id: str


class _Event(Envelope, frozen=True, kw_only=True, tag="job_event"):
    id: str
    kind: str
    detail: dict


class _Progress(Envelope, frozen=True, kw_only=True, tag="job_progress"):
    id: str
    fields: dict


class _Started(Envelope, frozen=True, kw_only=True, tag="job_started"):
    id: str


class _Done(Envelope, frozen=True, kw_only=True, tag="job_done"):
    id: str
    state: str
    result: Any
    error: dict | None


@dataclass
class _Live:
    scope: trio.CancelScope
    watchers: list[trio.MemorySendChannel] = field(default_factory=list)
    cancelled: bool = False
    seq: int = 0


def new_job_id(kind: str) -> str:
    return f"job_{kind[:8]}_{secrets.token_hex(8)}"


class JobSupervisor(MessageLoop):
    name = "jobs"

    def __init__(self, ledger: LedgerClient, kinds: dict[str, JobKind], *, artifacts: Path,
                 concurrency: int = 2, weight_of: Callable[[str | None], int] = lambda _key: 1) -> None:
        self.ledger = ledger
        self.kinds = kinds
        self.artifacts = artifacts
        self.slots = FairSlots(concurrency, weight_of)
        self.live: dict[str, _Live] = {}
        self.mailbox: trio.MemorySendChannel  # set by supervise(): job tasks report back through it

    async def on_start(self, nursery: trio.Nursery) -> None:
        rows = await self.ledger.query("SELECT * FROM jobs WHERE state IN ('queued', 'running')")
        for row in rows:
            kind = self.kinds.get(row["kind"])
            if kind is not None and kind.resumable:
                self._start(row["id"], row["kind"], row["model"], row["key_name"], json.loads(row["request"]),
                            resumed=True, seq=await self._last_seq(row["id"]))
                await self._append(row["id"], "resumed", {"after": "a gateway restart"})
                continue
            error = {"message": f"the gateway stopped while this job was {row['state']}",
                     "fix": "submit it again"}
            await self.ledger.execute(
                "UPDATE jobs SET state = 'failed', error = ?, updated = ?, finished = ? WHERE id = ?",
                (json.dumps(error), time.time(), time.time(), row["id"]))
            await self._append(row["id"], "failed", error)
            if kind is not None:
                await self._remove_inputs(kind, json.loads(row["request"]))
        if rows:
            log.info("jobs left by the previous process: %d resumed or closed", len(rows))

    async def _last_seq(self, job_id: str) -> int:
        rows = await self.ledger.query("SELECT MAX(seq) AS seq FROM job_events WHERE job_id = ?", (job_id,))
        return int(rows[0]["seq"] or 0) if rows else 0

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case Create():
                return await self._create(message)
            case Cancel(id=job_id, viewer=viewer):
                return await self._cancel(job_id, viewer)
            case Purge(id=job_id, viewer=viewer):
                return await self._purge(job_id, viewer)
            case Watch(id=job_id):
                live = self.live.get(job_id)
                if live is None:
                    return Ok(None)
                send, receive = trio.open_memory_channel[dict](WATCH_BUFFER)
                live.watchers.append(send)
                return Ok(receive)
            case _Event(id=job_id, kind=kind, detail=detail):
                await self._append(job_id, kind, detail)
                return None
            case _Progress(id=job_id, fields=fields):
                live = self.live.get(job_id)
                if live is not None:
                    for watcher in list(live.watchers):
                        try:
                            watcher.send_nowait(fields)
                        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                            pass  # a slow or departed watcher: the job goes on
                await self.ledger.execute("UPDATE jobs SET progress = ?, updated = ? WHERE id = ?",
                                          (json.dumps(fields), time.time(), job_id))
                return None
            case _Started(id=job_id):
                now = time.time()
                await self.ledger.execute(
                    "UPDATE jobs SET state = 'running', started = COALESCE(started, ?), updated = ? "
                    "WHERE id = ? AND state = 'queued'", (now, now, job_id))
                await self._append(job_id, "running", {})
                return None
            case _Done():
                await self._finish(message)
                return None
        return Err("unknown_op", f"jobs does not understand {type(message).__name__}")

    async def _create(self, message: Create) -> Reply:
        if message.kind not in self.kinds:
            return Err("unknown_job_kind", f"no job kind {message.kind!r}", status=400)
        job_id = message.job_id or new_job_id(message.kind)
        now = time.time()
        await self.ledger.execute(
            "INSERT INTO jobs (id, kind, model, state, key_name, created, updated, request) "
            "VALUES (?, ?, ?, 'queued', ?, ?, ?, ?)",
            (job_id, message.kind, message.model, message.key, now, now, json.dumps(message.request)))
        self._start(job_id, message.kind, message.model, message.key, message.request, resumed=False, seq=0)
        receive = None
        if message.watch:
            send, receive = trio.open_memory_channel[dict](WATCH_BUFFER)
            self.live[job_id].watchers.append(send)
        await self._append(job_id, "created", {"kind": message.kind, "model": message.model})
        return Ok((job_id, receive))

    def _start(self, job_id: str, kind: str, model: str | None, key: str | None, request: dict[str, Any], *,
               resumed: bool, seq: int) -> None:
        live = _Live(scope=trio.CancelScope(), seq=seq)
        self.live[job_id] = live
        context = JobContext(id=job_id, kind=kind, model=model, key=key, request=request, resumed=resumed,
                             _mailbox=self.mailbox)
        self.nursery.start_soon(self._run, context, live)

    async def _run(self, context: JobContext, live: _Live) -> None:
        state, result, error = "failed", None, None
        with live.scope:
            try:
                async with self.slots.hold(context.key):
                    await self.mailbox.send(_Started(reply=None, id=context.id))
                    result = await self.kinds[context.kind].run(context)
                state = "completed"
            except JobFailed as failure:
                error = {"message": failure.message, "fix": failure.fix}
            except Exception as failure:  # a runner bug is this job's failure, never the supervisor's crash
                log.exception("job %s failed", context.id)
                error = {"message": f"{type(failure).__name__}: {failure}", "fix": "see the gateway log"}
        if live.scope.cancelled_caught or live.cancelled:
            state, error = "cancelled", None
        with trio.CancelScope(shield=True):
            await self._remove_inputs(self.kinds[context.kind], context.request)
            await self.mailbox.send(_Done(reply=None, id=context.id, state=state, result=result, error=error))

    @staticmethod
    async def _remove_inputs(kind: JobKind, request: dict[str, Any]) -> None:
        def remove() -> None:
            for name in kind.inputs(request):
                Path(name).unlink(missing_ok=True)

        with trio.move_on_after(5):
            await trio.to_thread.run_sync(remove)

    async def _finish(self, message: _Done) -> None:
        live = self.live.get(message.id)  # kept until the terminal event is in the trail (it numbers it)
        now = time.time()
        inline = artifact = None
        if message.result is not None:
            encoded = json.dumps(message.result)
            if len(encoded) <= INLINE_RESULT_BYTES:
                inline = encoded
            else:
                path = self.artifacts / f"{message.id}.json"
                await trio.to_thread.run_sync(_write_artifact, path, encoded)
                artifact = str(path)
        await self.ledger.execute(
            "UPDATE jobs SET state = ?, result = ?, artifact = ?, error = ?, updated = ?, finished = ? WHERE id = ?",
            (message.state, inline, artifact, json.dumps(message.error) if message.error else None, now, now,
             message.id))
        await self._append(message.id, message.state, message.error or {})
        self.live.pop(message.id, None)
        if live is not None:
            for watcher in live.watchers:
                watcher.close()

    async def _cancel(self, job_id: str, viewer: str | None) -> Reply:
        rows = await self.ledger.query("SELECT state, key_name FROM jobs WHERE id = ?", (job_id,))
        if not rows or (viewer is not None and rows[0]["key_name"] != viewer):
            return Err("job_not_found", f"no job {job_id}", fix="GET /v1/jobs lists your jobs", status=404)
        live = self.live.get(job_id)
        if live is not None and not live.cancelled:
            live.cancelled = True
            live.scope.cancel()
            await self._append(job_id, "cancel_requested", {})
        return Ok(rows[0]["state"] if live is None else "cancelling")

    async def _purge(self, job_id: str, viewer: str | None) -> Reply:
        cancelled = await self._cancel(job_id, viewer)
        if isinstance(cancelled, Err):
            return cancelled
        rows = await self.ledger.query("SELECT artifact FROM jobs WHERE id = ?", (job_id,))
        await self.ledger.execute("UPDATE jobs SET result = NULL, artifact = NULL, updated = ? WHERE id = ?",
                                  (time.time(), job_id))
        if rows and rows[0]["artifact"]:
            await trio.to_thread.run_sync(lambda: Path(rows[0]["artifact"]).unlink(missing_ok=True))
        await self._append(job_id, "purged", {})
        return Ok(None)

    async def _append(self, job_id: str, kind: str, detail: dict[str, Any]) -> None:
        live = self.live.get(job_id)
        if live is None:
            seq = await self._last_seq(job_id) + 1
        else:
            live.seq += 1
            seq = live.seq
        if seq > EVENT_TRAIL and kind not in TERMINAL:
            return  # bounded: the trail keeps its first entries and always its terminal one
        await self.ledger.execute(
            "INSERT OR REPLACE INTO job_events (job_id, seq, ts, kind, detail) VALUES (?, ?, ?, ?, ?)",
            (job_id, min(seq, EVENT_TRAIL + 1), time.time(), kind, json.dumps(detail, default=str)))


def _write_artifact(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    temp.replace(path)


def job_view(row: dict[str, Any], *, artifact_url: str | None = None) -> dict[str, Any]:
    """A job row as the API shows it."""
    result = json.loads(row["result"]) if row.get("result") else None
    view = {"id": row["id"], "object": "job", "kind": row["kind"], "model": row["model"], "status": row["state"],
            "created_at": row["created"], "updated_at": row["updated"], "started_at": row["started"],
            "finished_at": row["finished"], "result": result,
            "error": json.loads(row["error"]) if row.get("error") else None,
            "progress": json.loads(row["progress"]) if row.get("progress") else None}
    if row.get("artifact"):
        view["artifact"] = {"url": artifact_url or f"/v1/jobs/{row['id']}/artifact"}
    return view


class JobsClient:
    """Typed calls into the Job supervisor, and the ledger reads that need no actor."""

    def __init__(self, mailbox: trio.MemorySendChannel, ledger: LedgerClient) -> None:
        self.mailbox = mailbox
        self.ledger = ledger

    async def create(self, kind: str, *, model: str | None, key: str | None, request: dict[str, Any],
                     job_id: str | None = None) -> str:
        job, _ = await call(self.mailbox, lambda r: Create(reply=r, kind=kind, model=model, key=key,
                                                           request=request, job_id=job_id, watch=False))
        return job

    async def create_watched(self, kind: str, *, model: str | None, key: str | None, request: dict[str, Any]
                             ) -> tuple[str, trio.MemoryReceiveChannel]:
        """A new job and its progress from the first event on (closed when the job ends)."""
        return await call(self.mailbox, lambda r: Create(reply=r, kind=kind, model=model, key=key,
                                                         request=request, job_id=None, watch=True))

    async def archive(self, job_id: str) -> None:
        await self.ledger.execute("UPDATE jobs SET archived = ? WHERE id = ?", (time.time(), job_id))

    async def cancel(self, job_id: str, viewer: str | None) -> str:
        return await call(self.mailbox, lambda r: Cancel(reply=r, id=job_id, viewer=viewer))

    async def cancel_and_read(self, job_id: str, viewer: str | None) -> tuple[str, dict[str, Any]]:
        """Cancel a job the caller may see, then its row as it is now: (the cancel's state, the row)."""
        state = await self.cancel(job_id, viewer)
        row = await self.get(job_id)
        assert row is not None  # the cancel found it; job rows are archived, never deleted
        return state, row

    async def purge(self, job_id: str, viewer: str | None) -> None:
        """Cancel the job if it runs, and drop its result: its content is gone, its record stays."""
        await call(self.mailbox, lambda r: Purge(reply=r, id=job_id, viewer=viewer))

    async def watch(self, job_id: str) -> trio.MemoryReceiveChannel | None:
        """Progress of a live job as it happens (None once it has finished); closed when it ends."""
        return await call(self.mailbox, lambda r: Watch(reply=r, id=job_id))

    async def get(self, job_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        rows = await self.ledger.query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows or (viewer is not None and rows[0]["key_name"] != viewer):
            return None
        return rows[0]

    async def list(self, *, state: str | None, kind: str | None, limit: int, viewer: str | None
                   ) -> list[dict[str, Any]]:
        clauses, params = [], []
        for column, value in (("state", state), ("kind", kind), ("key_name", viewer)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return await self.ledger.query(f"SELECT * FROM jobs {where} ORDER BY updated DESC, id LIMIT ?",
                                       (*params, limit))

    async def events(self, job_id: str) -> builtins.list[dict[str, Any]]:  # `list` here is the method above
        rows = await self.ledger.query("SELECT seq, ts, kind, detail FROM job_events WHERE job_id = ? ORDER BY seq",
                                       (job_id,))
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]
