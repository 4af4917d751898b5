"""THE way Blazar starts a child process (engines, rpc-server, ffmpeg): one that cannot outlive the
process that started it, however that process ends (SIGKILL and OOM kills included).

The mechanism is Linux's parent-death signal: `prctl(PR_SET_PDEATHSIG, SIGKILL)`, set in the child between
fork and exec (a `preexec_fn`); it survives the exec. Two traps decide how it is used here:

- The signal follows the *thread* that forked the child, not the process: the child is killed when that
  thread exits. `trio.lowlevel.open_process` forks from a trio worker thread (`trio.to_thread`), and those
  exit after `IDLE_TIMEOUT` (10 s) without work, which would kill a healthy engine ten seconds after its
  load. So every child is forked from one dedicated spawner thread: started on first use, blocked on its
  queue between spawns, never returning, so it lives exactly as long as the process. (Forking from the trio
  thread would also work for `blazar serve`, whose trio run is the main thread, but it would stall the event
  loop for every fork; the spawner keeps the fork off the loop the way trio's own open_process does.)
- The race: a gateway that dies after the fork but before the child's prctl runs sends no signal (there was
  no death signal yet to send). So the child records nothing of its own; the parent records its pid before
  the fork, and the child, once the prctl is in place, compares `getppid()` with it: a different parent
  means it was already reparented, and it exits before exec. From then on a parent death signals it.

The trio side asks the spawner through a queue and waits for the answer delivered back with the trio
token (`run_sync_soon`); the wait is shielded, as trio's own open_process is, because a fork cannot be
undone halfway and a child nobody holds would run unsupervised until the gateway ends. The answer is a
`ChildProcess`: pipes as `trio.lowlevel.FdStream`s and an async `wait()` on a pidfd that reaps, built on
trio's public API only (trio.Process has no public constructor from a Popen).

Every child gets its own process group (a stop reaches the child's own children, and a terminal's Ctrl-C
reaches the gateway, which decides). The boot sweep of child pidfiles (`blazar.orphans.sweep_orphans`)
stays as the second line of defence, for a child whose own children escaped its group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import FileIO
from typing import Any

import trio

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_ORPHANED = 125   # the child's parent was gone before the death signal was armed
REAP_SECS = 10.0      # a SIGKILLed child stuck in the kernel (D state) does not hold a stop forever


def _resolve_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once here: the child between fork and exec must do as little as possible."""
    try:
        function = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: no death signal; the boot sweep is all there is
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return function


_PRCTL = _resolve_prctl()


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """The preexec_fn: arm SIGKILL-on-parent-death, then make sure the parent had not already died."""
    prctl = _PRCTL

    def arm() -> None:
        if prctl is None:
            return
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os._exit(EXIT_ORPHANED)  # reparented before the signal was armed: nobody is left to serve

    return arm


class _Spawner:
    """The one thread every child is forked from; see the module docstring for why it must never exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._owner_pid: int | None = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._owner_pid != os.getpid():  # first use, or a forked copy of us: the thread did not come along
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._jobs,), name="blazar-spawner", daemon=True).start()
                self._owner_pid = os.getpid()
            self._jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            jobs.get()()  # a job never raises: it hands its outcome back to the trio side


_SPAWNER = _Spawner()


class ChildProcess:
    """A started child: pid, its pipes as trio streams, signals, and `wait()`, which reaps it."""

    def __init__(self, popen: subprocess.Popen, stdin: trio.lowlevel.FdStream | None,
                 stdout: trio.lowlevel.FdStream | None, stderr: trio.lowlevel.FdStream | None) -> None:
        self._popen = popen
        self.args = popen.args
        self.pid: int = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._wait_lock = trio.Lock()  # one task at a time may wait on the pidfd (trio allows one per fd)
        self._pidfd: FileIO | None = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfd (kernel < 5.3): wait() uses waitid
            self._pidfd = FileIO(os.pidfd_open(self.pid), closefd=True)

    @property
    def returncode(self) -> int | None:
        """None while it runs; its exit status (negative: the signal) once it has exited (it is reaped then)."""
        return self._popen.poll()

    def send_signal(self, signum: int) -> None:
        if self._popen.returncode is None:
            self._popen.send_signal(signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        async with self._wait_lock:
            if self._popen.poll() is None:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd.fileno())
                else:  # a worker thread blocks until it exits; WNOWAIT leaves the reaping to Popen
                    with contextlib.suppress(ChildProcessError):
                        await trio.to_thread.run_sync(os.waitid, os.P_PID, self.pid, os.WEXITED | os.WNOWAIT,
                                                      abandon_on_cancel=True)
                self._popen.wait()  # it has exited: this only reaps
            else:
                await trio.lowlevel.checkpoint()
            if self._pidfd is not None:
                self._pidfd.close()
                self._pidfd = None
        assert self._popen.returncode is not None
        return self._popen.returncode

    def close_streams(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()


async def spawn(argv: Sequence[str], *, stdin: int | None = DEVNULL, stdout: int | None = DEVNULL,
                stderr: int | None = DEVNULL, **options: Any) -> ChildProcess:
    """Start `argv` in its own process group, dying with this process. stdin/stdout/stderr: PIPE (a trio
    stream on the ChildProcess), DEVNULL, STDOUT (stderr only) or an fd. `options` go to subprocess.Popen.
    Raises OSError when it cannot be started."""
    if "preexec_fn" in options or "start_new_session" in options:
        raise TypeError("spawn() owns preexec_fn and start_new_session")
    streams: list[trio.lowlevel.FdStream] = []  # our ends of the pipes
    child_ends: list[int] = []  # theirs: closed here once the child has its copies

    def connect(how: int | None, to_child: bool) -> tuple[int | None, trio.lowlevel.FdStream | None]:
        """What the child gets for one standard stream, and our end when it is a pipe."""
        if how != PIPE:
            return how, None
        read_end, write_end = os.pipe()
        ours, theirs = (write_end, read_end) if to_child else (read_end, write_end)
        streams.append(trio.lowlevel.FdStream(ours))
        child_ends.append(theirs)
        return theirs, streams[-1]

    try:
        child_stdin, stdin_stream = connect(stdin, to_child=True)
        child_stdout, stdout_stream = connect(stdout, to_child=False)
        child_stderr: int | None
        if stderr == STDOUT:  # into the same pipe as stdout (or whatever stdout is)
            child_stderr, stderr_stream = (STDOUT if child_stdout is None else child_stdout), None
        else:
            child_stderr, stderr_stream = connect(stderr, to_child=False)
        popen = await _fork_on_spawner(_popen_call(list(argv), child_stdin, child_stdout, child_stderr, options))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    finally:
        for fd in child_ends:
            os.close(fd)
    return ChildProcess(popen, stdin_stream, stdout_stream, stderr_stream)


def _popen_call(argv: list[str], stdin: int | None, stdout: int | None, stderr: int | None,
                options: dict[str, Any]) -> Callable[[], subprocess.Popen]:
    """The Popen call the spawner thread makes; the gateway's pid is read there, just before the fork."""
    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True,
                                preexec_fn=die_with_parent(os.getpid()), **options)

    return start


async def _fork_on_spawner(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    token = trio.lowlevel.current_trio_token()
    answered = trio.Event()
    answer: list[tuple[bool, Any]] = []

    def deliver(outcome: tuple[bool, Any]) -> None:  # on the trio thread
        answer.append(outcome)
        answered.set()

    def job() -> None:  # on the spawner thread
        try:
            outcome: tuple[bool, Any] = (True, start())
        except BaseException as error:  # handed to the trio task, which raises it
            outcome = (False, error)
        try:
            token.run_sync_soon(deliver, outcome)
        except trio.RunFinishedError:  # nobody is left to hold the child: do not leave it running
            if outcome[0]:
                with contextlib.suppress(OSError):
                    os.killpg(outcome[1].pid, signal.SIGKILL)
                outcome[1].wait()

    _SPAWNER.submit(job)
    with trio.CancelScope(shield=True):
        await answered.wait()
    ok, value = answer[0]
    if not ok:
        raise value
    return value


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: bytes
    stderr: bytes


async def run(argv: Sequence[str], *, input: bytes = b"", **options: Any) -> Completed:
    """Run `argv` to its end: feed it `input`, collect stdout and stderr. Cancelled: it is killed and reaped."""
    child = await spawn(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, **options)
    out, err = bytearray(), bytearray()

    async def feed() -> None:
        assert child.stdin is not None
        with contextlib.suppress(trio.BrokenResourceError):  # it stopped reading: its exit status says why
            await child.stdin.send_all(input)
        await child.stdin.aclose()

    async def collect(stream: trio.lowlevel.FdStream | None, into: bytearray) -> None:
        assert stream is not None
        while data := await stream.receive_some(65536):
            into += data

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            nursery.start_soon(collect, child.stdout, out)
            nursery.start_soon(collect, child.stderr, err)
        code = await child.wait()
    finally:
        await stop(child)
    return Completed(code, bytes(out), bytes(err))


async def stop(child: ChildProcess) -> None:
    """SIGKILL its group, reap it, close our pipe ends. Shielded and bounded; safe to repeat. (Engines get a
    SIGTERM grace first: lanes.child.EngineProcess.terminate.)"""
    with trio.CancelScope(shield=True), trio.move_on_after(REAP_SECS):
        try:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
        finally:
            child.close_streams()
