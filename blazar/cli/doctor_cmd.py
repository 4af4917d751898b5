"""`blazar doctor`."""

from __future__ import annotations

import asyncclick as click
import httpx
import trio

from blazar.cli.output import emit_json, say
from blazar.doctor import (
    GROUPS,
    Check,
    channel_checks,
    engine_checks,
    gpu_checks,
    model_checks,
    runtime_checks,
    system_checks,
)
from blazar.paths import Paths

MARK = {"ok": "✓", "info": "·", "warn": "!", "fail": "✗"}


@click.command()
@click.option("--flat", is_flag=True, help="One line per check, no group headings.")
@click.option("--json", "as_json", is_flag=True, help="One JSON line per check.")
async def doctor(flat: bool, as_json: bool) -> None:
    """Grouped diagnostics: SYSTEM / GPU / ENGINES / MODELS / CHANNELS / RUNTIME."""
    paths = Paths.from_env()
    health = await _probe_health_async(paths)
    rows: list[Check] = []
    for group in (system_checks, gpu_checks, engine_checks, model_checks, channel_checks):
        rows.extend(await trio.to_thread.run_sync(group, paths))
    rows.extend(await trio.to_thread.run_sync(runtime_checks, paths, lambda url: health.get(url)))
    for group in GROUPS:
        members = [r for r in rows if r.group == group]
        if not as_json and not flat and members:
            say(group)
        for row in members:
            if as_json:
                emit_json(row)
            elif flat:
                say(f"{row.group:<8} {row.status:<4} {row.check}: {row.detail}"
                    + (f" (fix: {row.fix})" if row.fix else ""))
            else:
                say(f"  {MARK[row.status]} {row.check}: {row.detail}")
                if row.fix:
                    say(f"      fix: {row.fix}")
    if any(r.status == "fail" for r in rows):
        raise SystemExit(1)


async def _probe_health_async(paths: Paths) -> dict[str, str | None]:
    """Probe a running daemon's /healthz up front, on the trio thread, with a short deadline."""
    from blazar.server import read_daemon_file

    info = read_daemon_file(paths)
    if info is None:
        return {}
    url = info["url"]
    try:
        async with httpx.AsyncClient(timeout=3) as client:
            response = await client.get(f"{url}/healthz")
        return {url: None if response.status_code == 200 else f"/healthz answered {response.status_code}"}
    except httpx.HTTPError as error:
        return {url: f"/healthz unreachable ({type(error).__name__})"}
