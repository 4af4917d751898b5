"""`blazar serve` (alias `start`) and `blazar stop`."""

from __future__ import annotations

import os
import signal

import asyncclick as click
import msgspec
import trio

from blazar.cli.output import EXIT_CONFIG, emit_json, fail, note, say
from blazar.config import ConfigError, ConfigFile
from blazar.logs import setup_logging
from blazar.paths import Paths
from blazar.procs import pid_alive


@click.command()
@click.option("--bind", metavar="HOST:PORT", help="Listen here instead of config `bind` / BLAZAR_HOST.")
async def serve(bind: str | None) -> None:
    """Run the daemon in the foreground (all three APIs on one port)."""
    from blazar.server import run_daemon

    paths = Paths.from_env().ensure()
    try:
        config = ConfigFile(paths.config).load()
        if bind:
            config = msgspec.structs.replace(config, bind=bind)
            from blazar.config import validate

            validate(msgspec.to_builtins(config), "--bind")
    except ConfigError as error:
        fail(f"refusing to start: {error.message}", fix=error.fix, code=EXIT_CONFIG)
    setup_logging(config.log_level)
    raise SystemExit(await run_daemon(paths, config))


@click.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
@click.option("--timeout", "wait_secs", default=30.0, show_default=True,
              help="Seconds to wait for the daemon to exit.")
async def stop(model: str | None, as_json: bool, wait_secs: float) -> None:
    """Stop the daemon; with MODEL, unload that model now."""
    from blazar.paths import read_daemon_file

    paths = Paths.from_env()
    if model:
        await _unload(paths, model, as_json)
        return
    info = read_daemon_file(paths)
    if info is None:
        fail(f"no blazar daemon is running for {paths.home}", fix="start one with `blazar serve`")
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    note(f"sent SIGTERM to blazar (pid {pid}); waiting for it to drain")
    with trio.move_on_after(wait_secs):
        while pid_alive(pid):  # noqa: ASYNC110 - another process: there is no event to wait on
            await trio.sleep(0.1)
    stopped = not pid_alive(pid)
    if as_json:
        emit_json({"stopped": stopped, "pid": pid, "url": info.get("url")})
    elif stopped:
        say(f"stopped blazar (pid {pid})")
    if not stopped:
        fail(f"blazar (pid {pid}) is still draining after {wait_secs:g}s",
             fix="wait, or run `blazar stop` again to skip the drain (a second signal stops it now)")


async def _unload(paths: Paths, model: str, as_json: bool) -> None:

    from blazar.cli.daemon import daemon_client, require_daemon

    url = await require_daemon(paths)
    async with daemon_client(paths, timeout=60) as client:
        response = await client.post(f"{url}/api/evict", json={"model": model})
    if response.status_code != 200:
        fail(f"blazar stop {model}: {response.json().get('error')}", fix="blazar ps lists loaded models")
    if as_json:
        emit_json(response.json())
    else:
        say(f"unloaded {response.json().get('model') or model}")
