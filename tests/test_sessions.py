"""Realtime sessions live under the Session supervisor: listed while connected, counted per key, and closed
with a word to the client when the gateway drains, through a real `blazar serve` and real engines."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
import trio
import trio_websocket

from blazar.paths import Paths
from blazar.procs import pid_alive
from tests.conftest import ServeProcess
from tests.lane_fixtures import chat_body

pytestmark = pytest.mark.engine

VOICE = "en_US-joe-medium"


async def next_event(ws: trio_websocket.WebSocketConnection) -> dict:
    return json.loads(await ws.get_message())


async def test_two_sessions_are_listed_then_closed_with_a_shutdown_event_when_the_gateway_drains(
        voice_home: Paths, tmp_path):
    server = ServeProcess(voice_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(120):
            info = await server.start()
            url = info["url"].replace("http://", "ws://") + f"/v1/realtime?voice={VOICE}"
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as http:
                # An engine child too, so "no process left" covers one.
                assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
                [engine] = [row["pid"] for row in (await http.get("/api/ps")).json()["models"]]
                async with trio_websocket.open_websocket_url(url) as first, \
                        trio_websocket.open_websocket_url(url) as second:
                    ids = {(await next_event(ws))["session"]["id"] for ws in (first, second)}  # session.created
                    listed = (await http.get("/api/ps")).json()["sessions"]
                    assert {row["session"] for row in listed} == ids
                    assert all(row["kind"] == "realtime" and row["state"] == "running" and row["voice"] == VOICE
                               for row in listed)
                    server.signal(signal.SIGTERM)
                    for ws in (first, second):
                        goodbye = await next_event(ws)
                        assert goodbye["type"] == "error" and goodbye["error"]["code"] == "gateway_shutdown"
                        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                            await ws.get_message()
                        assert closed.value.reason.code == 1001  # going away
            assert await server.wait() == 0
            assert not pid_alive(engine)
        log = (tmp_path / "serve.log").read_text()
        assert "draining: 2 session(s) told to close" in log
    finally:
        server.kill()
