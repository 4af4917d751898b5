"""PCM/WAV in, encoded audio out, through an ffmpeg child under the child discipline: the speech route's lossy
formats (mp3, opus, aac, flac) and nothing else.

Every ffmpeg is started by `blazar.childproc.spawn`, as the engines are: its own process group, SIGKILLed by the
kernel when the gateway dies (even by SIGKILL), and a pidfile in `run/children/` while it runs, which the next
boot's sweep (or `blazar doctor`) acts on. However it ends (done, failed, over its time budget, or the client
hung up on a live stream), it is stopped the same way: SIGTERM to its group, a short grace, SIGKILL, reaped, its
pidfile removed, all shielded and bounded so a cancelled request cannot leave it running.

Two shapes:
- `encode()`: a whole utterance, buffered: its PCM as a WAV into ffmpeg, the encoded file back, within
  FFMPEG_SECS;
- `live()`: sentence PCM from a streaming piper reply into one ffmpeg pipe, the encoded bytes handed out as
  ffmpeg produces them. The pipe runs as a task of a nursery the caller names (the app's), the caller's
  response relays a bounded channel, and a client that hangs up closes it: ffmpeg is stopped and the upstream
  synthesis channel closed.

Refusals are `TranscodeFailed`, a teaching error with its HTTP status (the route renders it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import trio

from blazar import childproc
from blazar.errors import TeachingError
from blazar.pcm import pcm_to_wav
from supervisors.instance import StreamFailure, UpstreamStream

log = logging.getLogger("blazar.transcode")

FFMPEG_SECS = 60.0      # a buffered transcode's budget: 504 after it
STOP_GRACE_SECS = 2.0   # SIGTERM to SIGKILL
LIVE_BUFFER = 16        # encoded chunks between the pipe and the response
READ_BYTES = 65536
STDERR_TAIL = 400       # what a failure quotes of ffmpeg's own words
FORMATS = {"mp3": ["-f", "mp3"], "opus": ["-c:a", "libopus", "-f", "ogg"], "aac": ["-f", "adts"],
           "flac": ["-f", "flac"]}


class TranscodeFailed(TeachingError):
    """ffmpeg is missing, failed, or ran past its budget; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, *, fix: str = "") -> None:
        super().__init__(message, fix, status)


def ffmpeg_binary(fmt: str) -> str:
    """The system ffmpeg, or a teaching 400 naming the formats that need none."""
    binary = shutil.which("ffmpeg")
    if binary is None:
        raise TranscodeFailed(400, f"response_format {fmt} needs ffmpeg, which is not installed on the gateway's "
                              "machine", fix="use response_format wav or pcm, or install ffmpeg "
                              "(apt-get install ffmpeg)")
    return binary


def ffmpeg_argv(pcm_rate: int, fmt: str, *, wav: bool = False) -> list[str]:
    """ffmpeg reading mono PCM16 at `pcm_rate` (or a WAV) on stdin and writing `fmt` on stdout."""
    source = ["-f", "wav"] if wav else ["-f", "s16le", "-ar", str(pcm_rate), "-ac", "1"]
    return [ffmpeg_binary(fmt), "-hide_banner", "-loglevel", "error", *source, "-i", "pipe:0", *FORMATS[fmt],
            "pipe:1"]


async def encode(pcm: bytes, rate: int, fmt: str, *, children: Path | None) -> bytes:
    """A whole utterance's PCM16 (mono, `rate` Hz) encoded as `fmt`. Raises TranscodeFailed: 504 past
    FFMPEG_SECS, 502 when ffmpeg fails. `children`: the pidfile folder (run/children), or None for none."""
    argv = ffmpeg_argv(rate, fmt, wav=True)
    wav = pcm_to_wav(pcm, rate)
    out = bytearray()

    async def feed(stdin: trio.lowlevel.FdStream) -> None:
        await stdin.send_all(wav)

    async def keep(data: bytes) -> None:
        out.extend(data)

    with trio.move_on_after(FFMPEG_SECS) as budget:
        code, stderr = await _pipe(argv, feed, keep, children)
    if budget.cancelled_caught:
        raise TranscodeFailed(504, f"ffmpeg did not finish within {FFMPEG_SECS:g} s",
                              fix="send shorter text per request")
    if code != 0 or not out:
        raise TranscodeFailed(502, f"ffmpeg failed ({code}): {stderr.decode(errors='replace')[-STDERR_TAIL:]}",
                              fix="use response_format wav or pcm")
    return bytes(out)


async def live(start: Callable[[Callable[[], Awaitable[None]]], Awaitable[object]], stream: UpstreamStream,
               rate: int, fmt: str, *, children: Path | None) -> AsyncIterator[bytes]:
    """The encoded bytes of a streaming piper reply (raw PCM16, sentence by sentence), as ffmpeg produces them.
    The pipe is a task that `start` runs under a supervisor (the session supervisor's `run_task`: it outlives
    the route's handler, which returns the response first); closing or abandoning the returned iterator (the
    client hung up) stops
    ffmpeg and closes `stream`'s channel, which stops the synthesis upstream. Raises TranscodeFailed (400)
    at once when ffmpeg is missing; a failure later ends the audio short (audio has no error frame)."""
    try:
        argv = ffmpeg_argv(rate, fmt)
    except TranscodeFailed:
        stream.chunks.close()  # nothing will read the synthesis
        raise
    send, receive = trio.open_memory_channel[bytes](LIVE_BUFFER)

    async def feed(stdin: trio.lowlevel.FdStream) -> None:
        async for item in stream.chunks:
            if isinstance(item, StreamFailure):
                return
            await stdin.send_all(item.data)

    async def pipe() -> None:
        try:
            with stream.chunks:
                async with send:
                    code, stderr = await _pipe(argv, feed, send.send, children)
            if code != 0:
                log.warning("live ffmpeg exited %s: %s", code, stderr.decode(errors="replace")[-STDERR_TAIL:])
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left
        except* Exception:  # a failed pipe ends this audio short, and nothing else
            log.exception("live transcoding failed")

    try:
        await start(pipe)
    except BaseException:
        stream.chunks.close()  # never started: nothing will read the synthesis
        raise

    async def relay() -> AsyncIterator[bytes]:
        with receive:
            async for data in receive:
                yield data

    return relay()


async def _pipe(argv: list[str], feed: Callable[[trio.lowlevel.FdStream], Awaitable[None]],
                sink: Callable[[bytes], Awaitable[None]], children: Path | None) -> tuple[int, bytes]:
    """One ffmpeg child: `feed` writes its stdin (closed after), each piece of its stdout goes to `sink`, until
    it exits. Returns its exit status and the tail of its stderr. Whatever happens (a sink that raises, a
    cancellation), it is stopped, reaped and its pidfile removed before this returns or raises."""
    child = await childproc.spawn(argv, stdin=childproc.PIPE, stdout=childproc.PIPE, stderr=childproc.PIPE)
    stderr = bytearray()
    try:
        await trio.to_thread.run_sync(_write_pidfile, child, argv[0], children)
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None  # all piped

        async def fed(stdin: trio.lowlevel.FdStream) -> None:
            async with stdin:  # closing it is ffmpeg's end of input
                with contextlib.suppress(trio.BrokenResourceError):  # it stopped reading: its status says why
                    await feed(stdin)

        async def tail(stream: trio.lowlevel.FdStream) -> None:
            while data := await stream.receive_some(READ_BYTES):
                stderr.extend(data)
                del stderr[:-STDERR_TAIL]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fed, child.stdin)
            nursery.start_soon(tail, child.stderr)
            while data := await child.stdout.receive_some(READ_BYTES):
                await sink(data)
        return await child.wait(), bytes(stderr)
    finally:
        await _stop(child, children)


async def _stop(child: childproc.ChildProcess, children: Path | None) -> None:
    """Our pipe ends closed (an ffmpeg still writing gets EPIPE rather than a full pipe), SIGTERM its group, a
    grace of STOP_GRACE_SECS, then childproc.stop (SIGKILL, reap), then its pidfile. Shielded and bounded: a
    cancelled caller still gets it done."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(STOP_GRACE_SECS):
            if child.returncode is None:
                child.close_streams()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGTERM)
                await child.wait()
        await childproc.stop(child)
        with trio.move_on_after(STOP_GRACE_SECS):
            await trio.to_thread.run_sync(_remove_pidfile, child, children)


def _pidfile(child: childproc.ChildProcess, children: Path | None) -> Path | None:
    return None if children is None else children / f"{child.pid}.json"


def _write_pidfile(child: childproc.ChildProcess, argv0: str, children: Path | None) -> None:
    """The same record an engine child gets (supervisors.instance), so the boot sweep and doctor see it."""
    path = _pidfile(child, children)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"pid": child.pid, "model": "ffmpeg", "argv0": argv0,
                                    "gateway_pid": os.getpid()}))


def _remove_pidfile(child: childproc.ChildProcess, children: Path | None) -> None:
    path = _pidfile(child, children)
    if path is not None:
        path.unlink(missing_ok=True)
