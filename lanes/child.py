"""One engine child process, the same way for every lane: the piece the instance actor and quickbench share.

- spawned through `blazar.childproc` (own process group, so a stop reaches the engine's own children too;
  SIGKILLed by the kernel if the process that started it dies by any means), stdin closed,
  stdout+stderr into a bounded ring so a crash report carries the engine's last words;
- `wait_ready()` polls a health URL racing the child's exit and a deadline;
- `terminate()`: SIGTERM to the group, grace, SIGKILL, always reaped;
- `EngineHTTP`: how Blazar talks to a child over loopback (httpcore's keep-alive pool).

Its tasks run in the nursery the owner passes in; the owner hears about the exit through `on_exit`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpcore
import trio

from blazar import childproc

OUTPUT_RING_BYTES = 64 * 1024
STOP_GRACE_SECS = 5.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


TRANSPORT_ERRORS = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException)
CONNECT_TIMEOUT = {"timeout": {"connect": 10.0}}  # no read timeout: a long generation is not a failure


class EngineHTTP:
    """A keep-alive connection pool to engine children. httpcore is httpx's own transport without httpx's
    per-request model objects: the hot path relays bytes, so that is all it needs (measured in bench/)."""

    def __init__(self) -> None:
        self.pool = httpcore.AsyncConnectionPool(max_connections=None, max_keepalive_connections=64)

    async def __aenter__(self) -> EngineHTTP:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True):
            await self.pool.aclose()

    async def request(self, method: str, url: str, body: bytes = b"", content_type: str = "application/json",
                      read_secs: float | None = None) -> httpcore.Response:
        extensions = {"timeout": {"connect": 10.0, "read": read_secs}} if read_secs else CONNECT_TIMEOUT
        return await self.pool.request(method, url, content=body or None, extensions=extensions,
                                       headers=[(b"content-type", content_type.encode())] if body else [])

    def stream(self, method: str, url: str, body: bytes, content_type: str = "application/json"):
        """An async context manager yielding an httpcore.Response whose `aiter_stream()` relays the body."""
        return self.pool.stream(method, url, content=body, extensions=CONNECT_TIMEOUT,
                                headers=[(b"content-type", content_type.encode())])


T = TypeVar("T")


async def once_more_if_stale(attempt: Callable[[], Awaitable[T]], *, may_retry: Callable[[], bool] = lambda: True
                             ) -> T:
    """Send a request; if the server had closed the pooled keep-alive connection it went out on (llama-server
    does after a stream), the request never reached it, so it is sent once more on a new connection. For a
    stream, `attempt` enters the request's context on an AsyncExitStack (a failed enter leaves nothing there).
    `may_retry` says whether the server is still there to try again (a child that died is not)."""
    try:
        return await attempt()
    except httpcore.RemoteProtocolError:
        if not may_retry():
            raise
        return await attempt()


def header(response: httpcore.Response, name: bytes) -> str:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


# Lines of an engine's output that say why it stopped, whatever the engine: they go first in a crash report,
# ahead of the last lines (which are often routine warnings printed after the real cause).
_CAUSE = re.compile(r"error|fail|fatal|abort|assert|exception|terminate|out of memory|cannot|unable|killed|"
                    r"segmentation|illegal|panic|not found|invalid", re.IGNORECASE)


def exit_cause(returncode: int) -> str:
    """`exited with code 1`, or for a signal `was killed by SIGKILL (signal 9)`."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


def crash_lines(output: str, limit: int = 15) -> str:
    """The engine's own words about a crash: the lines that name a cause first (the last few of them), then
    the last lines it printed, without repeats, at most `limit` in all."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    causes = [line for line in lines if _CAUSE.search(line)][-max(1, limit // 2):]
    room = limit - len(causes)
    tail = [line for line in lines if line not in causes][-room:] if room > 0 else []
    if not causes:
        return "\n".join(tail)
    return "\n".join(causes) + ("\n(last lines)\n" + "\n".join(tail) if tail else "")


class ChildFailed(Exception):
    """The child exited or stayed unhealthy while loading; the message carries its last lines."""


class EngineProcess:
    def __init__(self, argv: list[str], *, name: str) -> None:
        self.argv = argv
        self.name = name
        self.process: childproc.ChildProcess | None = None
        self.output: deque[bytes | bytearray] = deque()  # what trio's pipe yields
        self.output_bytes = 0
        self.output_closed = trio.Event()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, nursery: trio.Nursery,
                    on_exit: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Spawn; raises ChildFailed when the binary cannot be started at all."""
        try:
            self.process = await childproc.spawn(self.argv, stdout=childproc.PIPE, stderr=childproc.STDOUT)
        except OSError as error:
            raise ChildFailed(f"could not start {self.argv[0]}: {error}") from None
        nursery.start_soon(self._drain_output)
        nursery.start_soon(self._watch_exit, on_exit)

    def output_tail(self, lines: int = 15) -> str:
        text = b"".join(self.output).decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    def crash_report(self, lines: int = 15) -> str:
        """The output lines that explain an exit, cause first (see `crash_lines`)."""
        return crash_lines(b"".join(self.output).decode(errors="replace"), lines)

    async def wait_ready(self, http: EngineHTTP, url: str, within: float) -> None:
        """Return once `url` answers 200; raise ChildFailed on exit or past the deadline."""
        assert self.process is not None
        deadline = trio.current_time() + within
        while True:
            if self.process.returncode is not None:
                with trio.move_on_after(0.5):
                    await self.output_closed.wait()  # the engine's last words explain the exit
                raise ChildFailed(f"{self.name}'s engine {exit_cause(self.process.returncode)} while "
                                  f"loading:\n{self.crash_report()}")
            with contextlib.suppress(*TRANSPORT_ERRORS):
                if (await http.request("GET", url, read_secs=2)).status == 200:
                    return
            if trio.current_time() > deadline:
                raise ChildFailed(f"{self.name}'s engine did not become healthy within {within:g}s:\n"
                                  f"{self.output_tail()}")
            await trio.sleep(0.1)

    async def terminate(self, grace: float = STOP_GRACE_SECS) -> None:
        """SIGTERM the group, wait `grace`, SIGKILL, reap. Safe to call more than once."""
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        await process.wait()

    async def _drain_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            async for chunk in self.process.stdout:
                self.output.append(chunk)
                self.output_bytes += len(chunk)
                while self.output_bytes > OUTPUT_RING_BYTES and len(self.output) > 1:
                    self.output_bytes -= len(self.output.popleft())
        finally:
            self.process.stdout.close()
            self.output_closed.set()

    async def _watch_exit(self, on_exit: Callable[[int], Awaitable[None]] | None) -> None:
        assert self.process is not None
        code = await self.process.wait()
        with trio.move_on_after(0.5):
            await self.output_closed.wait()
        if on_exit is not None:
            with trio.CancelScope(shield=True):
                await on_exit(code)
