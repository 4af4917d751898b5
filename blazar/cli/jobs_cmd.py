"""`blazar jobs list|show|cancel|events`: the daemon's durable job plane (/v1/jobs), over HTTP."""

from __future__ import annotations

import time
from typing import Any

import asyncclick as click
import httpx

from blazar.cli.config_cmd import json_option
from blazar.cli.daemon import daemon_client, require_daemon
from blazar.cli.output import emit_json, fail, note, say
from blazar.paths import Paths

STATES = ("queued", "running", "completed", "failed", "cancelled")


async def _ask(method: str, path: str, **kwargs: Any) -> Any:
    paths = Paths.from_env()
    url = await require_daemon(paths)
    async with daemon_client(paths, base_url=url, timeout=30) as client:
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            fail(f"the daemon at {url} did not answer: {error}", fix="blazar doctor")
    payload = response.json()
    if response.status_code >= 400:
        error = payload.get("error") or {}
        fail(error.get("message", str(payload)) if isinstance(error, dict) else str(error))
    return payload


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


@click.group()
def jobs() -> None:
    """Background work kept in the ledger: responses, batches, pulls (needs a running daemon)."""


@jobs.command(name="list")
@click.option("--state", type=click.Choice(STATES), help="Only jobs in this state.")
@click.option("--kind", help="Only jobs of this kind (responses, batch, message_batch, pull).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@json_option
async def list_(state: str | None, kind: str | None, limit: int, as_json: bool) -> None:
    """Jobs, most recently updated first."""
    params = {k: v for k, v in (("state", state), ("kind", kind), ("limit", str(limit))) if v}
    rows = (await _ask("GET", "/v1/jobs", params=params))["data"]
    if as_json:
        for row in rows:
            emit_json(row)
        return
    if not rows:
        note("no jobs")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("ID", "KIND", "MODEL", "STATUS", "UPDATED"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["id"], row["kind"], row["model"] or "-", row["status"], _when(row["updated_at"]))
    Console(width=200).print(table)


def _show(job: dict[str, Any]) -> None:
    say(f"{job['id']}  {job['kind']}  {job['status']}")
    for label, key in (("model", "model"), ("created", "created_at"), ("started", "started_at"),
                       ("finished", "finished_at")):
        value = job[key]
        say(f"  {label:9}{_when(value) if key.endswith('_at') else value or '-'}")
    if job.get("progress"):
        say(f"  progress {job['progress']}")
    if job.get("error"):
        say(f"  error    {job['error']['message']}\n  fix      {job['error'].get('fix', '')}")


@jobs.command()
@click.argument("job_id")
@json_option
async def show(job_id: str, as_json: bool) -> None:
    """One job: status, timings, progress, error with its fix."""
    job = await _ask("GET", f"/v1/jobs/{job_id}")
    emit_json(job) if as_json else _show(job)


@jobs.command()
@click.argument("job_id")
@json_option
async def cancel(job_id: str, as_json: bool) -> None:
    """Cancel a job (a finished one is left as it is)."""
    job = await _ask("POST", f"/v1/jobs/{job_id}/cancel")
    emit_json(job) if as_json else say(f"{job['id']}: {job['status']}")


@jobs.command()
@click.argument("job_id")
@json_option
async def events(job_id: str, as_json: bool) -> None:
    """A job's event trail, in order."""
    rows = (await _ask("GET", f"/v1/jobs/{job_id}/events"))["data"]
    for row in rows:
        emit_json(row) if as_json else say(f"{row['seq']:>4}  {_when(row['ts'])}  {row['kind']}  "
                                           f"{row['detail'] or ''}")
