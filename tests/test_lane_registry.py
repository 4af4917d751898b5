"""LANES drives the server: a lane module registered there gets its own supervisor (with the settings it gives)
and its installed models in GET /v1/models, with no other wiring. (`EchoLaneDouble` is a test double that
never spawns anything; real lanes are proven by their own tests.)"""

from __future__ import annotations

from typing import Any

import msgspec
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
    assert set(gateway.services.lane_clients()) == {*lanes.LANES}  # every registered lane, the double too
    assert "echo" in gateway.services.lane_clients()
    assert echo.settings_asked and echo.settings_asked[0].keep_alive == gateway.services.config.keep_alive
    with trio.fail_after(30):
        async with gateway.client() as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert {"id": "echo:1", "object": "model", "owned_by": "blazar", "lane": "echo", "engine": "echo-0",
                    "capabilities": ["echo"], "resident": None} in listed
            assert (await client.get("/api/ps")).json()["models"] == []  # asked of every lane, the new one too


def test_every_model_name_belongs_to_one_lane(voice_home: Paths):
    """`lanes.lane_owning` is what pull, rm, /api/pull and /api/delete ask: the lane whose catalog or store has the
    name, else the catch-all llama.cpp lane (a hub repository)."""
    owners = {name: lanes.lane_owning(voice_home, name).kind for name in (
        "whisper:tiny.en", "tiny.en", "base", "en_US-joe-medium", "smollm2:135m", "smollm2", "Someone/Some-GGUF")}
    assert owners == {"whisper:tiny.en": "whisper", "tiny.en": "whisper", "base": "whisper",
                      "en_US-joe-medium": "piper", "smollm2:135m": "llamacpp", "smollm2": "llamacpp",
                      "Someone/Some-GGUF": "llamacpp"}


@pytest.mark.engine
async def test_pull_and_delete_reach_the_lane_whose_model_it_is(nursery, voice_home: Paths):
    """Before lanes owned their models, /api/pull and /api/delete knew only the GGUF store: a voice or a whisper
    model could be neither pulled nor deleted over HTTP. Now the route's registry asks the owning lane."""
    from blazar import audio_models
    from tests.conftest import arun_cli

    gateway = await start_gateway(nursery, voice_home)
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            pulled = await client.post("/api/pull", json={"model": "en_US-joe-medium"})
            assert pulled.status_code == 200, pulled.text
            events = [msgspec.json.decode(line) for line in pulled.text.splitlines()]
            assert events[-1] == {"status": "success", "model": "en_US-joe-medium", "lane": "piper"}, events

            async def listed() -> set[str]:
                return {row["id"] for row in (await client.get("/v1/models")).json()["data"]}

            assert {"whisper:base", "whisper:tiny.en", "en_US-joe-medium", "smollm2:135m"} <= await listed()
            for name in ("whisper:base", "en_US-joe-medium"):
                deleted = await client.post("/api/delete", json={"model": name})
                assert deleted.status_code == 200, deleted.text
            assert not audio_models.whisper_dir(voice_home, "base").exists()
            assert not audio_models.voice_file(voice_home, "en_US-joe-medium").exists()
            left = await listed()
            assert "whisper:base" not in left and "en_US-joe-medium" not in left
            assert {"whisper:tiny.en", "smollm2:135m"} <= left

            again = await client.post("/api/delete", json={"model": "whisper:base"})
            assert again.status_code == 404, again.text
            assert "no whisper model 'whisper:base' is installed; installed: tiny.en" in again.json()["error"]

    removed = await arun_cli("rm", "tiny.en", "--json")
    assert removed.returncode == 0, removed.stderr
    assert msgspec.json.decode(removed.stdout) == {"removed": "whisper:tiny.en"}
    assert audio_models.installed_whisper(voice_home) == []
