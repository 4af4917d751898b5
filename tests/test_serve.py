"""`blazar serve` as a real process: boot, drain on SIGTERM with a request in flight, exit 3 on a
taken port, refusal of a malformed config."""

from __future__ import annotations

import os
import signal
import socket

import httpx
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


async def test_sigterm_lets_an_in_flight_request_finish(home: Paths, tmp_path):
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0",
                          env={"BLAZAR_TEST_HOOKS": "1"})
    try:
        with trio.fail_after(30):
            info = await server.start()
            results = {}

            async def busy_request():
                async with httpx.AsyncClient(timeout=20) as client:
                    results["busy"] = await client.post(f"{info['url']}/__test__/slow?ms=1500", content=b"hi")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(busy_request)
                await trio.sleep(0.4)
                server.signal(signal.SIGTERM)
                exit_code = await server.wait()
            assert exit_code == 0
            assert results["busy"].status_code == 200
            assert results["busy"].json() == {"slept_ms": 1500, "body_bytes": 2}
    finally:
        server.kill()
    assert "draining in-flight requests" in (tmp_path / "serve.log").read_text()


async def test_a_second_signal_skips_the_drain(home: Paths, tmp_path):
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0",
                          env={"BLAZAR_TEST_HOOKS": "1"})
    try:
        with trio.fail_after(30):
            info = await server.start()

            async def stuck_request():
                async with httpx.AsyncClient(timeout=20) as client:
                    try:
                        await client.post(f"{info['url']}/__test__/slow?ms=60000")
                    except httpx.HTTPError:
                        pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stuck_request)
                await trio.sleep(0.4)
                server.signal(signal.SIGTERM)
                await trio.sleep(0.4)
                server.signal(signal.SIGINT)
                started = trio.current_time()
                assert await server.wait() == 0
                assert trio.current_time() - started < 5
                nursery.cancel_scope.cancel()
    finally:
        server.kill()


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
