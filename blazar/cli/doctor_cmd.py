"""`blazar doctor`."""

from __future__ import annotations

import asyncclick as click
import httpx
import trio

from blazar.cli.daemon import daemon_client
from blazar.cli.output import emit_json, say
from blazar.doctor import (
    GROUPS,
    Check,
    channel_checks,
    engine_checks,
    gpu_checks,
    model_checks,
    orphan_checks,
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
    live_keys = await _live_keys(paths)
    rows: list[Check] = []
    for group in (system_checks, gpu_checks, engine_checks, model_checks):
        rows.extend(await trio.to_thread.run_sync(group, paths))
    rows.extend(await trio.to_thread.run_sync(channel_checks, paths, live_keys))
    rows.extend(await trio.to_thread.run_sync(runtime_checks, paths, lambda url: health.get(url)))
    rows.extend(await trio.to_thread.run_sync(orphan_checks, paths))
    rows.extend(await _runtime_probe(paths))
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


async def _live_keys(paths: Paths) -> bool | None:
    """Whether the running daemon's auth middleware enforces keys (its manifest), or None."""
    from blazar.paths import read_daemon_file

    info = read_daemon_file(paths)
    if info is None:
        return None
    try:
        async with daemon_client(paths, base_url=info["url"], timeout=5) as client:
            return bool((await client.get("/.well-known/blazar")).json()["features"]["keys"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def _runtime_probe(paths: Paths) -> list[Check]:
    """RUNTIME checks that ask the running daemon itself: residents, breakers, latency, engine."""
    from blazar.paths import read_daemon_file

    info = read_daemon_file(paths)
    if info is None:
        return []
    rows: list[Check] = []
    try:
        async with daemon_client(paths, base_url=info["url"], timeout=5) as client:
            residents = (await client.get("/api/ps")).json()["models"]
            quantiles = (await client.get("/api/quantiles")).json()
            manifest = (await client.get("/.well-known/blazar")).json()
    except (httpx.HTTPError, ValueError, KeyError) as error:
        return [Check(group="RUNTIME", check="api", status="fail", detail=f"the daemon's API did not answer: {error}",
                      fix="restart it: blazar stop && blazar serve")]
    broken = [r for r in residents if r.get("state") == "broken"]
    live = [r for r in residents if r.get("state") != "broken"]
    rows.append(Check(group="RUNTIME", check="residents", status="ok",
                      detail=", ".join(f"{r['model']} ({r['state']}, ctx {r.get('context')}, pid {r.get('pid')})"
                                       for r in live) or "no model loaded"))
    for row in broken:
        rows.append(Check(group="RUNTIME", check=f"breaker {row['model']}", status="fail",
                          detail=(row.get("failure") or "").splitlines()[0], fix="blazar ps --reset"))
    ttft = quantiles["ttft"]
    rows.append(Check(group="RUNTIME", check="latency", status="ok" if ttft["count"] else "info",
                      detail=f"TTFT p50 {ttft['p50_ms']} ms, p99 {ttft['p99_ms']} ms over {ttft['count']} requests"
                      if ttft["count"] else "no generations measured since the daemon started"))
    rows.append(Check(group="RUNTIME", check="engine", status="ok" if manifest["engine"].get("tag") else "warn",
                      detail=f"daemon serves with {manifest['engine'].get('tag') or 'no engine'}; "
                      f"{manifest['endpoint_count']} routes"))
    return rows


async def _probe_health_async(paths: Paths) -> dict[str, str | None]:
    """Probe a running daemon's /healthz up front, on the trio thread, with a short deadline."""
    from blazar.paths import read_daemon_file

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
