"""One memory budget across every lane (supervisors/placement.py): a chat model and a speech voice evict each
other when only one fits, whatever their lanes, through the real engines; and the placement's rules under
the autojump clock."""

from __future__ import annotations

import httpx
import pytest
import trio

from blazar import audio_models
from blazar.paths import Paths
from supervisors.actor import ActorError, supervise
from supervisors.placement import EvictForRoom, PlacementActor, PlacementClient
from tests.conftest import start_gateway
from tests.lane_fixtures import chat_body

VOICE = audio_models.DEFAULT_VOICE
MiB = 1024 * 1024


async def lanes_of(client: httpx.AsyncClient) -> list[tuple[str, str]]:
    return sorted((row["lane"], row["model"]) for row in (await client.get("/api/ps")).json()["models"]
                  if row["state"] in ("starting", "ready", "busy"))


async def speak(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/audio/speech", json={"model": "tts-1", "voice": VOICE, "input": "Hello there.",
                                                       "response_format": "wav"})


@pytest.mark.engine
async def test_a_budget_that_fits_one_model_evicts_the_idle_one_whatever_its_lane(nursery, voice_home: Paths):
    # SmolLM2 is 94 MiB and the piper voice 61 MiB: 130 MiB holds either, never both.
    gateway = await start_gateway(nursery, voice_home, ram_budget_mib=130)
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            assert await lanes_of(client) == [("llamacpp", "smollm2:135m")]
            spoken = await speak(client)
            assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
            assert await lanes_of(client) == [("piper", VOICE)]  # the chat model made room for the voice
            placement = (await client.get("/api/capacity")).json()["placement"]
            assert placement["ram_budget_bytes"] == 130 * MiB
            assert [(row["lane"], row["model"]) for row in placement["placed"]] == [("piper", VOICE)]
            assert (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code == 200
            assert await lanes_of(client) == [("llamacpp", "smollm2:135m")]  # and the voice for the chat model


class FakeLane:
    """A lane's mailbox as the placement sees it: it records EvictForRoom and ends the child at once."""

    def __init__(self, placement: PlacementClient) -> None:
        self.placement = placement
        self.send, self.receive = trio.open_memory_channel[EvictForRoom](16)
        self.children: dict[int, tuple[int, trio.Event]] = {}  # serial -> (reservation, gone)
        self.evicted: list[int] = []

    async def run(self) -> None:
        async for message in self.receive:
            self.evicted.append(message.serial)
            reservation, gone = self.children.pop(message.serial)
            self.placement.released(reservation)
            gone.set()

    async def spawn(self, serial: int, model: str, size: int, *, state: str = "ready", gpu: bool = False,
                    last_used: float = 0.0) -> list[trio.Event]:
        reservation, waits = await self.placement.reserve(lane="fake", lane_mailbox=self.send, model=model,
                                                          size_bytes=size, gpu=gpu, replacing=False)
        gone = trio.Event()
        self.placement.placed(reservation, serial, gone)
        self.placement.seen(reservation, state, last_used)
        self.children[serial] = (reservation, gone)
        return waits


async def test_placement_evicts_least_recently_used_idle_children_and_never_busy_ones(nursery, autojump_clock):
    placement = PlacementClient(await nursery.start(lambda task_status=trio.TASK_STATUS_IGNORED: supervise(
        lambda: PlacementActor(300 * MiB, gpu_probe=lambda: (0, "no GPU in this test")), task_status=task_status)))
    lane = FakeLane(placement)
    nursery.start_soon(lane.run)
    await lane.spawn(1, "old", 100 * MiB, last_used=1.0)
    await lane.spawn(2, "busy", 100 * MiB, state="busy", last_used=0.5)
    await lane.spawn(3, "recent", 100 * MiB, last_used=3.0)
    waits = await lane.spawn(4, "new", 100 * MiB)
    for gone in waits:
        await gone.wait()
    assert lane.evicted == [1]  # the least recently used idle one; the busy one is older but kept
    with pytest.raises(ActorError) as refused:  # 400 MiB more cannot fit beside a busy 100 MiB child
        await lane.spawn(5, "huge", 250 * MiB)
    assert refused.value.err.status == 503 and "none is idle" in refused.value.err.message
    assert lane.evicted == [1]  # a refusal evicts nothing
    described = await placement.describe()
    assert described["gpu_note"] == "no GPU in this test" and described["gpu_total_bytes"] is None
    with pytest.raises(ActorError) as too_big:
        await lane.spawn(6, "enormous", 301 * MiB)
    assert too_big.value.err.status == 507 and "ram_budget_mib" in too_big.value.err.message
