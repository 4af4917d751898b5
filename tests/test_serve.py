"""`blazar serve` as a real process: boot, drain on SIGTERM with a request in flight, exit 3 on a
taken port, refusal of a malformed config."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import httpx
import pytest
import trio

from blazar.paths import Paths
from tests.conftest import BLAZAR, ServeProcess


async def test_boot_answers_then_sigterm_stops_cleanly(home: Paths, tmp_path):
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(30):
            info = await server.start()
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"{info['url']}/healthz")).text == "ok"
            server.signal(signal.SIGTERM)
            assert await server.wait() == 0
    finally:
        server.kill()
    assert not home.daemon_file.exists()
    log = (tmp_path / "serve.log").read_text()
    assert "listening on http://127.0.0.1:" in log and "blazar stopped" in log


async def _stream_until_signalled(client: httpx.AsyncClient, body: dict, first_token: trio.Event,
                                  signalled: trio.Event, frames: dict[str, list[str]]) -> None:
    """Stream a chat answer, noting which frames came before and which after the signal."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    frames["after" if signalled.is_set() else "before"].append(line[6:])
                    first_token.set()
    except httpx.HTTPError as error:
        frames["error"].append(type(error).__name__)


def _engine_home(home: Paths, shared_home: Paths, shared_engine, *, grace: int) -> None:
    from tests.lane_fixtures import add_shared_model, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    home.config.write_text(f"shutdown_grace_secs = {grace}\n")


async def _until_logged(log: Path, text: str) -> None:
    while text not in await trio.Path(log).read_text():  # noqa: ASYNC110 - another process's log
        await trio.sleep(0.02)


@pytest.mark.engine
async def test_sigterm_lets_an_in_flight_request_finish(home: Paths, tmp_path, shared_home, shared_engine):
    """SIGTERM while a generation streams (its first tokens already at the client): the rest of the answer
    still arrives, all of it, and then the daemon exits 0."""
    _engine_home(home, shared_home, shared_engine, grace=300)
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    frames: dict[str, list[str]] = {"before": [], "after": [], "error": []}
    try:
        with trio.fail_after(240):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=120) as client:
                first_token, signalled = trio.Event(), trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_stream_until_signalled, client, body, first_token, signalled, frames)
                    await first_token.wait()  # in flight for certain: the client holds its first tokens
                    server.signal(signal.SIGTERM)
                    signalled.set()
            # (The client's pool is closed first: an idle keep-alive connection would hold the drain open.)
            exit_code = await server.wait()
    finally:
        server.kill()
    assert exit_code == 0
    assert frames["error"] == [] and frames["after"], frames  # tokens kept coming after the signal
    assert frames["after"][-1] == "[DONE]"
    assert json.loads(frames["after"][-2])["choices"][0]["finish_reason"] == "length"  # all 60 tokens
    assert "draining in-flight requests" in (tmp_path / "serve.log").read_text()


@pytest.mark.engine
async def test_a_second_signal_skips_the_drain(home: Paths, tmp_path, shared_home, shared_engine):
    """A generation of thousands of tokens is streaming and the drain would wait up to 300 s for it: SIGTERM
    (seen in the log: the drain began), then SIGINT, and the daemon exits 0 at once, cutting the stream."""
    _engine_home(home, shared_home, shared_engine, grace=300)
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    frames: dict[str, list[str]] = {"before": [], "after": [], "error": []}
    try:
        with trio.fail_after(240):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=120) as client:
                first_token, signalled = trio.Event(), trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_stream_until_signalled, client, body, first_token, signalled, frames)
                    await first_token.wait()
                    server.signal(signal.SIGTERM)
                    signalled.set()
                    await _until_logged(tmp_path / "serve.log", "draining in-flight requests")
                    server.signal(signal.SIGINT)
                    started = trio.current_time()
                    assert await server.wait() == 0
                    stopped_in = trio.current_time() - started
    finally:
        server.kill()
    assert stopped_in < 5
    assert "second signal: stopping now" in (tmp_path / "serve.log").read_text()
    # The stream was cut, not finished: no [DONE] after 4000 tokens.
    assert "[DONE]" not in frames["after"] and len(frames["before"]) + len(frames["after"]) < 4000


async def test_a_taken_port_exits_3_naming_the_port_and_the_key(home: Paths, tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with trio.fail_after(30):
            result = await trio.run_process(
                [BLAZAR, "serve"],
                env={**os.environ, "BLAZAR_HOST": f"127.0.0.1:{port}"},
                capture_stdout=True, capture_stderr=True, check=False)
    finally:
        holder.close()
    assert result.returncode == 3
    message = result.stderr.decode()
    assert f"port {port}" in message and "config set bind" in message and "BLAZAR_HOST" in message
    assert len(message.strip().splitlines()) == 1
    assert result.stdout == b""


async def test_a_malformed_config_refuses_to_start_with_file_line_column(home: Paths):
    home.config.write_text('bind = "127.0.0.1:0"\n[engine\nretention = 1\n')
    with trio.fail_after(30):
        result = await trio.run_process(
            [BLAZAR, "serve"],
            capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 78
    message = result.stderr.decode()
    assert f"{home.config}:2:" in message and "fix:" in message
    assert "Traceback" not in message


async def test_no_engine_child_survives_serve(home: Paths, tmp_path, shared_home, shared_engine):
    from tests.lane_fixtures import add_shared_model, pid_alive, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(60):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=30) as client:
                response = await client.post("/v1/chat/completions", json={
                    "model": "smollm2:135m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                assert response.status_code == 200
                (row,) = (await client.get("/api/ps")).json()["models"]
            assert pid_alive(row["pid"])
            server.signal(signal.SIGTERM)
            assert await server.wait() == 0
    finally:
        server.kill()
    assert not pid_alive(row["pid"])
    assert not list((home.run / "children").glob("*.json"))


async def test_boot_sweeps_children_a_dead_daemon_left(home: Paths, tmp_path):
    import json

    from tests.lane_fixtures import pid_alive

    orphan = await trio.lowlevel.open_process(["/bin/sleep", "300"], start_new_session=True)
    children = home.run / "children"
    children.mkdir(parents=True, exist_ok=True)
    (children / f"{orphan.pid}.json").write_text(json.dumps(
        {"pid": orphan.pid, "model": "x", "engine_tag": "t", "argv0": "/bin/sleep"}))
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(30):
            await server.start()
            await orphan.wait()
            server.signal(signal.SIGTERM)
            await server.wait()
    finally:
        server.kill()
        orphan.kill()
    assert not pid_alive(orphan.pid)
    assert "left by a previous daemon" in (tmp_path / "serve.log").read_text()
