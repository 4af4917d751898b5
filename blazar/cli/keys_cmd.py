"""`blazar keys list|add|rm|rotate` and `blazar migrate`.

With a daemon running, keys commands go through its admin plane (authenticated with the CLI's local
token, or BLAZAR_API_KEY), so the change takes effect at once. With none running they edit
config.toml through the same round-trip, and the next `blazar serve` picks the change up.
"""

from __future__ import annotations

from typing import Any

import asyncclick as click
import httpx
import trio

from blazar.cli.daemon import daemon_client, daemon_url, healthy
from blazar.cli.output import emit_json, fail, note, say
from blazar.config import ConfigError, ConfigFile
from blazar.keys import (
    KeyChangeError,
    KeyTable,
    change_keys,
    change_result,
    check_new_key,
    migrate_document,
    records_from_config,
)
from blazar.paths import Paths


async def _daemon(paths: Paths) -> str | None:
    url = daemon_url(paths)
    return url if url is not None and await healthy(url) else None


async def _ask(paths: Paths, url: str, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    async with daemon_client(paths, base_url=url, timeout=30) as client:
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            fail(f"the daemon at {url} did not answer: {error}", fix="blazar doctor")
    try:
        payload = response.json()
    except ValueError:
        fail(f"the daemon answered {response.status_code} without JSON", fix="blazar doctor")
    if response.status_code >= 400:
        message = payload.get("error") if isinstance(payload.get("error"), str) else str(payload)
        if response.status_code == 401:
            fail(f"the daemon refused this CLI's credentials: {message}",
                 fix="set BLAZAR_API_KEY to an unscoped key, or run the command on the machine that runs "
                 "blazar serve, as the same user")
        fail(message)
    return payload


def _offline(paths: Paths, op: str, name: str, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Blocking: the same change, written straight into config.toml."""
    config_file = ConfigFile(paths.config)
    try:
        live = KeyTable(records_from_config(config_file.load().keys))
        config, secret = change_keys(config_file, op, name, live=live, entry=entry)
    except KeyChangeError as error:
        fail(error.message, fix=error.fix)
    except ConfigError as error:
        fail(error.message, fix=error.fix)
    return change_result(KeyTable(records_from_config(config.keys)), name, secret)


def _print_secret(result: dict[str, Any], as_json: bool, verb: str, live: bool) -> None:
    if as_json:
        emit_json(result)
        return
    say(result["secret"])
    note(f"{verb} key {result['name']!r}: the secret above is shown only this once (config.toml keeps its hash). "
         "Clients send it as `Authorization: Bearer …` or `x-api-key: …`.")
    if not live:
        note("no daemon is running: config.toml is changed, and blazar serve uses it from its next start")


async def _apply(op: str, name: str, method: str, route: str) -> tuple[dict[str, Any], bool]:
    """(result, whether the running daemon made the change)."""
    paths = Paths.from_env()
    url = await _daemon(paths)
    if url is not None:
        return await _ask(paths, url, method, route, params={"name": name}), True
    return await trio.to_thread.run_sync(_offline, paths, op, name), False


@click.group()
def keys() -> None:
    """API keys: list, add, rm, rotate (against the running daemon, else config.toml)."""


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON line per key.")
async def list_keys(as_json: bool) -> None:
    """Keys with their scopes, limits and usage (secrets redacted)."""
    paths = Paths.from_env()
    url = await _daemon(paths)
    if url is not None:
        rows = (await _ask(paths, url, "GET", "/api/keys"))["keys"]
    else:
        try:
            config = await trio.to_thread.run_sync(ConfigFile(paths.config).load)
        except ConfigError as error:
            fail(error.message, fix=error.fix)
        rows = [r.public() for r in KeyTable(records_from_config(config.keys)).records.values()]
    if as_json:
        for row in rows:
            emit_json(row)
        return
    if not rows:
        note("no API keys: the gateway is open (blazar keys add NAME locks it)")
        return
    say(f"{'NAME':<20} {'SECRET':<12} {'SOURCE':<7} {'MODELS':<24} {'RPM':>5} {'TPM':>7} {'DAILY':>9} {'CONC':>4} "
        f"{'TOKENS TODAY':>12}")
    for row in rows:
        today = (row.get("live") or {}).get("tokens_today", "")
        say(f"{row['name']:<20} {row['secret']:<12} {row['source']:<7} {','.join(row['models']) or '(all, admin)':<24} "
            f"{row['rpm'] or '-':>5} {row['tpm'] or '-':>7} {row['daily_tokens'] or '-':>9} "
            f"{row['max_concurrent'] or '-':>4} {today:>12}")


@keys.command("add")
@click.argument("name")
@click.option("--models", default="", help="Comma-separated models this key may use (empty: all, and admin).")
@click.option("--rpm", type=int, default=0, help="Requests per minute (0 = unlimited).")
@click.option("--tpm", type=int, default=0, help="Tokens per minute, prompt + completion (0 = unlimited).")
@click.option("--daily-tokens", type=int, default=0, help="Tokens per UTC day (0 = unlimited).")
@click.option("--max-concurrent", type=int, default=0, help="Requests in flight at once (0 = unlimited).")
@click.option("--weight", type=int, default=1, help="Fair-queueing share (also of the job slots).")
@click.option("--spawn-options", is_flag=True,
              help="A scoped key may send Ollama spawn options (num_thread, …) that restart a shared engine.")
@click.option("--json", "as_json", is_flag=True, help="The new key as one JSON line (with its secret).")
async def add_key(name: str, models: str, rpm: int, tpm: int, daily_tokens: int, max_concurrent: int, weight: int,
                  spawn_options: bool, as_json: bool) -> None:
    """Create a key; its secret is printed once."""
    body = {"name": name, "models": [m.strip() for m in models.split(",") if m.strip()], "rpm": rpm, "tpm": tpm,
            "daily_tokens": daily_tokens, "max_concurrent": max_concurrent, "weight": weight}
    if spawn_options:
        body["spawn_options"] = True
    try:
        entry = check_new_key(body)
    except KeyChangeError as error:
        fail(error.message, fix="blazar keys add --help lists the options")
    paths = Paths.from_env()
    url = await _daemon(paths)
    if url is not None:
        result = await _ask(paths, url, "POST", "/api/keys", json=body)
    else:
        result = await trio.to_thread.run_sync(_offline, paths, "add", name, entry)
    _print_secret(result, as_json, "created", url is not None)


@keys.command("rm")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
async def remove_key(name: str, as_json: bool) -> None:
    """Remove a key (never the last one)."""
    result, _ = await _apply("remove", name, "DELETE", "/api/keys")
    if as_json:
        emit_json(result)
    else:
        say(f"removed key {name!r}")


@keys.command("rotate")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
async def rotate_key(name: str, as_json: bool) -> None:
    """A new secret for a key (the old one stops working at once); scope, limits and usage stay."""
    result, live = await _apply("rotate", name, "POST", "/api/keys/rotate")
    _print_secret(result, as_json, "rotated", live)


@click.command()
@click.option("--json", "as_json", is_flag=True)
async def migrate(as_json: bool) -> None:
    """Legacy top-level api_keys = [...] -> [[keys]] entries (hashed; idempotent; backup first)."""
    paths = Paths.from_env()
    config_file = ConfigFile(paths.config)
    added: list[str] = []

    def change(document: Any) -> None:
        added.extend(migrate_document(document))

    try:
        legacy = "api_keys" in await trio.to_thread.run_sync(config_file.file_data)
    except ConfigError as error:
        fail(error.message, fix=error.fix)
    if not legacy:
        result = {"migrated": [], "note": "nothing to migrate: config.toml has no legacy api_keys"}
    else:
        try:
            await trio.to_thread.run_sync(config_file.mutate, change)
        except ConfigError as error:
            fail(error.message, fix=error.fix)
        backups = config_file.backups()
        result = {"migrated": added, "backup": str(backups[-1]) if backups else None}
    if as_json:
        emit_json(result)
    elif result["migrated"]:
        say(f"migrated {len(added)} legacy key(s) to [[keys]]: {', '.join(added)} (hashed; backup {result['backup']})")
        note("restart blazar serve if it is running, so it reads them")
    else:
        say(result.get("note") or "nothing to migrate: every legacy key is already a [[keys]] entry")
