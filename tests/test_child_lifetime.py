"""No child outlives its gateway: every child Blazar starts (blazar.childproc) is SIGKILLed by the kernel when
the process that started it dies, even by SIGKILL, and not a moment before (a healthy engine survives trio's
worker threads coming and going). What a dead gateway leaves is pidfiles, which `blazar doctor` clears."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
import trio

from blazar import audio_models, childproc
from blazar.orphans import doctor_orphans
from blazar.paths import Paths, read_daemon_file
from blazar.procs import pid_alive
from tests.conftest import ServeProcess, arun_cli
from tests.lane_fixtures import add_shared_audio, add_shared_model, chat_body, ps, register_engine

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN_SECS = 3.0
VOICE = "en_US-joe-medium"


def children_of(pid: int) -> set[int]:
    """Every live child of `pid`, whichever of its threads forked it (Linux: /proc/PID/task/TID/children)."""
    found: set[int] = set()
    for listing in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found |= {int(child) for child in Path(listing).read_text().split()}
        except OSError:
            continue  # that thread exited while we looked
    return {child for child in found if pid_alive(child)}


async def all_gone(pids: set[int], within: float = GONE_WITHIN_SECS) -> None:
    """Wait (bounded) until none of `pids` runs; a zombie nobody reaped yet counts as gone."""
    with trio.fail_after(within):
        while any(pid_alive(pid) for pid in pids):  # noqa: ASYNC110 - other processes
            await trio.sleep(0.05)


# ---------------------------------------------------------------- the spawn helper on its own (no engine)

PARENT = textwrap.dedent("""
    import json, shutil, sys, trio
    from blazar import childproc

    async def main():
        # the two shapes ffmpeg is started in (audio_routes): a live pipe (ffmpeg itself where it is installed:
        # it waits for PCM on stdin), and a one-shot run fed its input
        ffmpeg = shutil.which("ffmpeg")
        encoder = [ffmpeg, "-loglevel", "error", "-f", "s16le", "-ar", "22050", "-ac", "1", "-i", "pipe:0",
                   "-f", "mp3", "pipe:1"] if ffmpeg else ["/bin/cat"]
        piped = await childproc.spawn(encoder, stdin=childproc.PIPE, stdout=childproc.PIPE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: childproc.run(["/bin/sleep", "300"], input=b"wav bytes"))
            await trio.sleep(0)
            print(json.dumps({"piped": piped.pid}), flush=True)
            await trio.sleep_forever()

    trio.run(main)
""")


async def test_children_of_a_sigkilled_parent_die_with_it(tmp_path: Path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = await trio.lowlevel.open_process([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=REPO,
                                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        with trio.fail_after(20):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await parent.stdout.receive_some()
                assert chunk, f"the parent script exited with {parent.returncode}"
                line += chunk
            piped = json.loads(line)["piped"]
            while len(children := children_of(parent.pid)) < 2:  # noqa: ASYNC110 - the one-shot child may still be forking
                await trio.sleep(0.05)
        assert piped in children
        if shutil.which("ffmpeg"):
            assert b"ffmpeg" in await trio.Path(f"/proc/{piped}/cmdline").read_bytes()
        parent.kill()
        await parent.wait()
        await all_gone(children)
    finally:
        if parent.returncode is None:
            parent.kill()
        await parent.wait()


async def test_a_child_survives_the_thread_that_asked_for_it():
    """The death signal follows the forking thread: a child forked from a thread that then ends (a trio worker
    after its idle timeout, or a trio run in a thread of its own) would be killed right then. childproc forks
    from its own long-lived thread, so the asking thread ending changes nothing."""
    started: list[int] = []

    def ask_and_end() -> None:
        started.append(trio.run(_spawn_pid, ["/bin/sleep", "300"]))

    await trio.to_thread.run_sync(lambda: _run_thread_to_its_end(ask_and_end))
    (pid,) = started
    try:
        with trio.move_on_after(0.5):  # a death signal would arrive as the thread exits; give it time to show
            while pid_alive(pid):  # noqa: ASYNC110 - another process
                await trio.sleep(0.02)
        assert pid_alive(pid)
    finally:
        os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # subprocess may have reaped its forgotten Popen already
            os.waitpid(pid, 0)  # noqa: ASYNC222 - SIGKILLed just now: it is reaped at once


def _run_thread_to_its_end(target) -> None:
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive()


async def _spawn_pid(argv: list[str]) -> int:
    return (await childproc.spawn(argv)).pid


def test_a_child_whose_parent_died_before_the_signal_was_armed_exits_before_exec():
    """The race: the gateway dies between fork and prctl. The child finds another parent than the one recorded
    before the fork and exits instead of running unsupervised."""
    orphan = subprocess.Popen(["/bin/sleep", "300"], start_new_session=True,
                              preexec_fn=childproc.die_with_parent(parent_pid=os.getpid() + 1_000_000))
    assert orphan.wait(timeout=10) == childproc.EXIT_ORPHANED


def test_doctor_clears_what_a_dead_gateway_left_and_spares_a_live_ones(home: Paths):
    dead_gateway = subprocess.Popen(["/bin/true"])
    dead_gateway.wait()
    left_running = subprocess.Popen(["/bin/sleep", "300"], start_new_session=True)
    live_ones = subprocess.Popen(["/bin/sleep", "300"], start_new_session=True)
    children = home.run / "children"
    children.mkdir(parents=True, exist_ok=True)

    def pidfile(child: int, model: str, gateway: int) -> Path:
        path = children / f"{child}.json"
        path.write_text(json.dumps({"pid": child, "model": model, "argv0": "/bin/sleep", "gateway_pid": gateway}))
        return path

    pidfile(left_running.pid, "left:running", dead_gateway.pid)
    pidfile(dead_gateway.pid + 1_000_000, "died:with-it", dead_gateway.pid)
    spared = pidfile(live_ones.pid, "live:gateway", os.getpid())
    try:
        found = {orphan.model: orphan for orphan in doctor_orphans(home)}
        assert set(found) == {"left:running", "died:with-it"}
        assert found["left:running"].stopped and "killed left:running" in found["left:running"].describe()
        assert not found["died:with-it"].stopped and "died with gateway pid" in found["died:with-it"].describe()
        assert left_running.wait(timeout=5) == -signal.SIGKILL
        assert live_ones.poll() is None and spared.exists()
        assert [p.name for p in children.iterdir()] == [spared.name]
    finally:
        for child in (left_running, live_ones):
            child.kill()
            child.wait()


# ---------------------------------------------------------------- real gateways, real engines

@pytest.fixture
def text_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    return home


@pytest.fixture
def speech_home(text_home: Paths, shared_home: Paths) -> Paths:
    if "tiny.en" not in audio_models.installed_whisper(shared_home) or \
            VOICE not in audio_models.installed_voices(shared_home):
        pytest.fail(f"whisper tiny.en or {VOICE} is not installed in {shared_home.home}: run ./scripts/setup")
    add_shared_audio(text_home, shared_home)
    return text_home


async def _warm(client: httpx.AsyncClient, model: str) -> int:
    answer = await client.post("/api/warm", json={"model": model, "wait": True}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["resident"]["pid"]


async def _speak_and_hear(client: httpx.AsyncClient) -> None:
    """Makes the piper voice and whisper tiny.en resident: speak a word, transcribe it."""
    spoken = await client.post("/v1/audio/speech", json={"model": VOICE, "voice": "alloy", "input": "Hi."},
                               timeout=120)
    assert spoken.status_code == 200, spoken.text
    heard = await client.post("/v1/audio/transcriptions", data={"model": "whisper:tiny.en"},
                              files={"file": ("hi.wav", spoken.content)}, timeout=120)
    assert heard.status_code == 200, heard.text


@pytest.mark.engine
async def test_a_sigkilled_gateway_takes_every_child_with_it(speech_home: Paths, tmp_path: Path):
    server = ServeProcess(speech_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(180):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"]) as client, trio.open_nursery() as loads:
                loads.start_soon(_warm, client, "smollm2:135m")
                loads.start_soon(_speak_and_hear, client)
            async with httpx.AsyncClient(base_url=info["url"]) as client:
                residents = {row["model"]: row["pid"] for row in await ps(client)}
            assert set(residents) == {"smollm2:135m", VOICE, "whisper:tiny.en"}
            children = children_of(info["pid"])
            assert set(residents.values()) == children  # every child the gateway has is a resident engine
            pidfiles = {p.name for p in (speech_home.run / "children").iterdir()}
            assert pidfiles == {f"{pid}.json" for pid in children}
        os.kill(info["pid"], signal.SIGKILL)  # the gateway alone: its children are in groups of their own
        assert await server.wait() == -signal.SIGKILL
        await all_gone(children)
    finally:
        server.kill()
    assert read_daemon_file(speech_home) is None  # nothing started a new gateway (whose boot sweep would act)

    doctor = await arun_cli("doctor", "--json")
    rows = [json.loads(line) for line in doctor.stdout.splitlines()]
    orphans = {row["check"]: row for row in rows if row["check"].startswith("orphan ")}
    assert set(orphans) == {f"orphan {model}" for model in residents}
    for model, pid in residents.items():
        row = orphans[f"orphan {model}"]
        assert row["status"] == "warn"
        assert f"(pid {pid}): it died with gateway pid {info['pid']}" in row["detail"]
    assert not list((speech_home.run / "children").iterdir())
    again = [json.loads(line) for line in (await arun_cli("doctor", "--json")).stdout.splitlines()]
    assert [row["status"] for row in again if row["check"] == "orphans"] == ["ok"]


def ffmpeg_children(pid: int) -> set[int]:
    """The children of `pid` that run ffmpeg."""
    found = set()
    for child in children_of(pid):
        try:
            argv0 = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue  # it exited while we looked
        if Path(argv0.decode(errors="replace")).name == "ffmpeg":
            found.add(child)
    return found


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (a zombie nobody reaped yet does not count)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:  # after "(comm)": state, ppid, pgrp
            return True
    return False


@pytest.mark.engine
async def test_a_sigkilled_gateway_takes_a_live_transcode_with_it(speech_home: Paths, tmp_path: Path):
    """ffmpeg is a child like an engine (supervisors.transcode): SIGKILL the gateway while a streamed mp3 is
    being encoded, and the ffmpeg goes with it; the next boot finds nothing of it, not even its pidfile. The
    test holds ffmpeg's pipes open meanwhile, so the gateway's ends closing (EOF, EPIPE) cannot end it: only
    its death signal can, as for an encoder that is stuck or would otherwise run on."""
    if shutil.which("ffmpeg") is None:
        pytest.fail("ffmpeg is not installed: ./scripts/test installs it")
    long_text = " ".join(f"This is sentence number {n}, spoken to keep the encoder busy." for n in range(60))
    children_dir = speech_home.run / "children"
    server = ServeProcess(speech_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    held: list[int] = []
    try:
        with trio.fail_after(180):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=120) as client, client.stream(
                    "POST", "/v1/audio/speech", json={"model": VOICE, "voice": "alloy", "input": long_text,
                                                      "response_format": "mp3", "stream": True}) as response:
                assert response.status_code == 200, await response.aread()
                encoder = None
                while encoder is None or not (children_dir / f"{encoder}.json").exists():  # spawned, recorded
                    await trio.sleep(0.05)
                    encoder = min(ffmpeg_children(info["pid"]), default=None)
                assert len(ffmpeg_children(info["pid"])) == 1
                record = json.loads((children_dir / f"{encoder}.json").read_text())
                assert record["model"] == "ffmpeg" and record["gateway_pid"] == info["pid"]
                held += [os.open(f"/proc/{encoder}/fd/0", os.O_WRONLY | os.O_NONBLOCK),  # its stdin, and
                         os.open(f"/proc/{encoder}/fd/1", os.O_RDONLY | os.O_NONBLOCK)]  # its stdout
                os.kill(info["pid"], signal.SIGKILL)  # mid-transcode: ffmpeg is in a process group of its own
        assert await server.wait() == -signal.SIGKILL
        await all_gone({encoder})
        assert not group_alive(encoder), "a process of ffmpeg's group outlived the gateway"
    finally:
        server.kill()
        for fd in held:
            os.close(fd)

    speech_home.daemon_file.unlink(missing_ok=True)  # the dead gateway's: ServeProcess.start waits for a new one
    booted = ServeProcess(speech_home, tmp_path / "serve2.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(60):
            again = await booted.start()
        assert again["pid"] != info["pid"]
        assert not pid_alive(encoder) and not group_alive(encoder)
        assert not ffmpeg_children(again["pid"])
        assert not list(children_dir.iterdir())  # the boot sweep took every pidfile the dead gateway left
    finally:
        booted.kill()


@pytest.mark.engine
async def test_a_client_hanging_up_stops_its_live_transcode(speech_home: Paths, tmp_path: Path):
    """The other way a live transcode ends early: the client leaves mid-stream, and its ffmpeg is stopped and
    reaped, its pidfile removed, while the gateway serves on."""
    long_text = " ".join(f"This is sentence number {n}, spoken to keep the encoder busy." for n in range(60))
    children_dir = speech_home.run / "children"
    server = ServeProcess(speech_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(180):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=120) as client:
                async with client.stream("POST", "/v1/audio/speech", json={
                        "model": VOICE, "voice": "alloy", "input": long_text, "response_format": "mp3",
                        "stream": True}) as response:
                    assert response.status_code == 200, await response.aread()
                    async for _ in response.aiter_bytes():
                        break  # ffmpeg has produced something: it is live
                    while not (encoders := ffmpeg_children(info["pid"])):  # noqa: ASYNC110 - another process
                        await trio.sleep(0.05)
                    # The pipe is a task of the session supervisor, not of the route: listed while it runs.
                    sessions = (await client.get("/api/ps")).json()["sessions"]
                    assert [(row["kind"], row["voice"], row["format"]) for row in sessions] == \
                        [("transcode", VOICE, "mp3")], sessions
                (encoder,) = encoders
                with trio.fail_after(10):  # the client left with the stream context
                    while (children_dir / f"{encoder}.json").exists():  # noqa: ASYNC110 - the gateway's file
                        await trio.sleep(0.05)
                assert not await trio.Path(f"/proc/{encoder}").exists()  # stopped and reaped (before its pidfile went)
                assert (await client.get("/health")).status_code == 200
    finally:
        server.kill()


@pytest.mark.engine
async def test_a_sigkilled_rpc_serve_takes_its_rpc_server_with_it(tmp_path: Path, shared_engine):
    from tests.test_rpc import RpcWorkerProcess

    home = Paths(tmp_path / "rpc").ensure()
    register_engine(home, shared_engine.binary, shared_engine.tag, tools=shared_engine.tools)
    worker = RpcWorkerProcess(home)
    await worker.start()
    try:
        rpc_server = json.loads(worker.output.splitlines()[0])["pid"]
        assert pid_alive(rpc_server)
        worker.process.kill()
        await worker.process.wait()
        await all_gone({rpc_server})
    finally:
        if worker.process.returncode is None:
            worker.process.kill()
        await worker.process.wait()


@pytest.mark.engine
async def test_an_idle_engine_outlives_trio_worker_threads(text_home: Paths, tmp_path: Path):
    """trio's worker threads exit after IDLE_TIMEOUT without work; an engine forked from one of them with a
    death signal would die with it. Keep one resident and idle past that, then talk to it."""
    from trio._core._thread_cache import IDLE_TIMEOUT  # what the wait below must outlast

    server = ServeProcess(text_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        info = await server.start()
        async with httpx.AsyncClient(base_url=info["url"], timeout=60) as client:
            with trio.fail_after(120):
                engine = await _warm(client, "smollm2:135m")
            with trio.move_on_after(IDLE_TIMEOUT + 3):  # wall time is the point here: it must pass idle
                while pid_alive(engine):  # noqa: ASYNC110 - another process
                    await trio.sleep(0.25)
            assert pid_alive(engine), (tmp_path / "serve.log").read_text()[-2000:]
            with trio.fail_after(60):
                answer = await client.post("/v1/chat/completions", json=chat_body(max_tokens=8))
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"]
                (row,) = await ps(client)
            assert row["pid"] == engine
    finally:
        server.kill()
