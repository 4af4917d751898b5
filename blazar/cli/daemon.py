"""Finding (or starting) the daemon a CLI command talks to."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import trio

from blazar.cli.output import fail, note
from blazar.paths import Paths


def daemon_url(paths: Paths) -> str | None:
    from blazar.paths import read_daemon_file

    info = read_daemon_file(paths)
    if info is not None:
        return info["url"]
    if os.environ.get("BLAZAR_HOST"):
        from blazar.config import parse_bind

        host, port = parse_bind(os.environ["BLAZAR_HOST"])
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    return None


def auth_headers(paths: Paths) -> dict[str, str]:
    """The key this CLI sends: BLAZAR_API_KEY when set (a remote or scoped gateway), else the running
    daemon's local CLI token, which only the owner of $BLAZAR_HOME can read."""
    from blazar.keys import read_cli_token

    secret = os.environ.get("BLAZAR_API_KEY") or read_cli_token(paths.run)
    return {"authorization": f"Bearer {secret}"} if secret else {}


def daemon_client(paths: Paths, **kwargs) -> httpx.AsyncClient:
    """An HTTP client for the daemon, authenticated as this CLI."""
    return httpx.AsyncClient(headers=auth_headers(paths), **kwargs)


async def healthy(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(f"{url}/healthz")).status_code == 200
    except httpx.HTTPError:
        return False


async def require_daemon(paths: Paths) -> str:
    url = daemon_url(paths)
    if url is None or not await healthy(url):
        fail(f"no blazar daemon is running for {paths.home}", fix="start one: blazar serve")
    return url


async def ensure_daemon(paths: Paths) -> str:
    """The running daemon's URL, starting `blazar serve` in the background when there is none."""
    url = daemon_url(paths)
    if url is not None and await healthy(url):
        return url
    paths.ensure()
    log_path = paths.logs / "serve.log"
    log = await trio.to_thread.run_sync(open, log_path, "ab")
    with log:
        # Its own session: the daemon outlives this command, like `blazar serve &` would.
        process = await trio.lowlevel.open_process([sys.executable, "-m", "blazar", "serve"],
                                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                   start_new_session=True)
    note(f"started blazar serve in the background (pid {process.pid}, log {log_path}); stop it with blazar stop")
    with trio.move_on_after(30):
        while True:
            if process.poll() is not None:
                fail(f"blazar serve exited with code {process.returncode}", fix=f"read {log_path}")
            url = daemon_url(paths)
            if url and await healthy(url):
                return url
            await trio.sleep(0.1)
    fail("blazar serve did not come up within 30 s", fix=f"read {log_path}")
