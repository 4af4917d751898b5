"""`blazar rpc serve`: ggml's rpc-server as a supervised child on a worker host.

Lifecycle: starting --port accepts--> serving --exits on its own--> restarting (backoff 1, 2, 4 … 30 s;
more than 5 exits in 5 minutes: give up, exit 1) --> starting; SIGINT/SIGTERM --> stopping (SIGTERM to its
process group, grace, SIGKILL, reaped) --> exit 0.

The RPC protocol has no authentication and no encryption: whoever reaches the port can run work on this
host's devices and read what is sent. So the worker binds loopback unless `--allow-remote` says otherwise.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import asyncclick as click
import trio

from blazar.cli.output import EXIT_UNAVAILABLE, emit_json, fail, note, say
from blazar.engines import EngineError, Roster
from blazar.paths import Paths

RESTART_WINDOW_SECS = 300.0
MAX_RESTARTS = 5
NO_AUTH_WARNING = ("the llama.cpp RPC protocol has no authentication and no encryption: anyone who can reach this "
                   "port can use this host's devices; expose it only to hosts you trust (a private LAN or a tunnel)")


def _loopback(host: str) -> bool:
    from blazar.middleware import loopback_host

    return loopback_host(host)


def rpc_server_binary(paths: Paths) -> tuple[Path, str]:
    """The active engine's rpc-server and its help text."""
    import subprocess

    try:
        engine = Roster(paths).require_active()
    except EngineError as error:
        fail(error.message, fix=error.fix, code=EXIT_UNAVAILABLE)
    binary = (engine.tools or {}).get("rpc-server")
    if not binary or not Path(binary).exists():
        fail(f"the active engine ({engine.tag}) has no rpc-server", code=EXIT_UNAVAILABLE,
             fix="rebuild it: blazar engine build cpu (it builds ggml's rpc-server with GGML_RPC=ON)")
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    return Path(binary), help_text.stdout + help_text.stderr


@click.group()
def rpc() -> None:
    """llama.cpp RPC workers: spread one model's layers over several hosts."""


@rpc.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=50052, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--mem", "mem_mib", type=click.IntRange(min=1), default=None,
              help="Memory (MiB) the worker offers, on engines whose rpc-server has --mem.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads of the worker's CPU device.")
@click.option("--allow-remote", is_flag=True, help="Bind a non-loopback address (the protocol has no auth).")
@click.option("--json", "as_json", is_flag=True, help="JSONL events on stdout.")
async def serve(host: str, port: int, mem_mib: int | None, threads: int | None, allow_remote: bool,
                as_json: bool) -> None:
    """Run ggml's rpc-server here, supervised, until Ctrl-C."""
    from lanes.rpc import rpc_server_argv

    if not _loopback(host) and not allow_remote:
        fail(f"refusing to bind {host}: {NO_AUTH_WARNING}",
             fix=f"bind loopback (the default), or say you mean it: blazar rpc serve --host {host} --allow-remote")
    binary, help_text = await trio.to_thread.run_sync(rpc_server_binary, Paths.from_env().ensure())
    if mem_mib and "--mem" not in help_text:
        fail(f"this engine's rpc-server has no --mem (it offers the device's whole memory): {binary}",
             fix="drop --mem, or build a llama.cpp version whose rpc-server has it")
    argv = rpc_server_argv(binary, host, port, threads=threads, mem_mib=mem_mib)
    if not _loopback(host):
        note(f"warning: {NO_AUTH_WARNING}")

    def event(kind: str, **fields: object) -> None:
        if as_json:
            emit_json({"event": kind, **fields})

    exits: list[float] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def watch_signals() -> None:
                async for _ in signals:
                    stop.set()
                    return

            nursery.start_soon(watch_signals)
            while not stop.is_set():
                code = await _run_once(argv, host, port, stop, event)
                if stop.is_set():
                    break
                now = time.monotonic()
                exits[:] = [t for t in exits if now - t < RESTART_WINDOW_SECS] + [now]
                if len(exits) > MAX_RESTARTS:
                    event("gave_up", exits=len(exits))
                    fail(f"rpc-server exited {len(exits)} times in {RESTART_WINDOW_SECS:g}s (last code {code}); "
                         "giving up", fix="run it by hand to see why: " + " ".join(argv))
                delay = min(30.0, 2.0 ** (len(exits) - 1))
                note(f"rpc-server exited with code {code}; restarting in {delay:g}s")
                event("restarting", code=code, delay_secs=delay)
                with trio.move_on_after(delay):
                    await stop.wait()
            nursery.cancel_scope.cancel()
    event("stopped")
    if not as_json:
        say("rpc worker stopped")


async def _run_once(argv: list[str], host: str, port: int, stop: trio.Event, event) -> int:
    from lanes.child import EngineProcess
    from lanes.rpc import probe_rpc_workers

    child = EngineProcess(argv, name="rpc-server")
    exited = trio.Event()
    code = -1

    async def on_exit(returncode: int) -> None:
        nonlocal code
        code = returncode
        exited.set()

    async with trio.open_nursery() as nursery:
        await child.start(nursery, on_exit)
        address = f"{'[' + host + ']' if ':' in host else host}:{port}"
        while not exited.is_set():  # serving once the port accepts
            if not (await probe_rpc_workers([address], within=1.0))[0][1]:
                note(f"rpc worker serving on {address} (pid {child.pid}); list it in the gateway's config.toml: "
                     f'[[rpc_workers]] address = "{address}"')
                event("serving", address=address, pid=child.pid)
                break
            await trio.sleep(0.1)
        with trio.CancelScope() as watch:
            async def end_on_exit() -> None:
                await exited.wait()
                watch.cancel()

            nursery.start_soon(end_on_exit)
            await stop.wait()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await child.terminate()
        nursery.cancel_scope.cancel()
    if code == -1 and child.returncode is not None:
        code = child.returncode
    if not stop.is_set() and code != -1:
        last = child.output_tail(5)
        if last:
            note(last)
    return code
