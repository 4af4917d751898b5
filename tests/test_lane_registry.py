"""LANES drives the server: a lane module registered there gets its own supervisor (with the settings it gives)
and its installed models in GET /v1/models, with no other wiring. (`EchoLaneDouble` is a test double that
never spawns anything; real lanes are proven by their own tests.)"""

from __future__ import annotations

from typing import Any

import pytest
import trio

import lanes
from blazar.paths import Paths
from lanes.speech import SpeechLane
from tests.conftest import start_gateway


class EchoLaneDouble(SpeechLane):
    kind = "echo"
    settings_asked: list[Any] = []

    def settings(self, config: Any) -> Any:
        self.settings_asked.append(config)
        return super().settings(config)

    def list_models(self, paths: Any) -> list[dict[str, Any]]:
        return [{"id": "echo:1", "object": "model", "owned_by": "blazar", "lane": self.kind, "engine": "echo-0",
                 "capabilities": ["echo"]}]

    def capabilities(self, manifest: Any) -> list[str]:
        return ["echo"]


async def test_a_lane_in_the_registry_is_supervised_and_listed(nursery, home: Paths, monkeypatch: pytest.MonkeyPatch):
    echo = EchoLaneDouble()
    monkeypatch.setitem(lanes.LANES, "echo", echo)
    gateway = await start_gateway(nursery, home)
    assert set(gateway.services.lane_clients()) == {"llamacpp", "whisper", "piper", "echo"}
    assert echo.settings_asked and echo.settings_asked[0].keep_alive == gateway.services.config.keep_alive
    with trio.fail_after(30):
        async with gateway.client() as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert {"id": "echo:1", "object": "model", "owned_by": "blazar", "lane": "echo", "engine": "echo-0",
                    "capabilities": ["echo"], "resident": None} in listed
            assert (await client.get("/api/ps")).json()["models"] == []  # asked of every lane, the new one too
