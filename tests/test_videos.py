"""The video half of the sdcpp lane through the real engine: sd-server on `vid-noise`, a **random-weight** model
with the real Wan 2.1 T2V 1.3B and Wan 2.1 VAE architecture and no text encoder (scripts/fixtures --video). It
renders noise video and ignores the prompt: these tests prove the path (the job plane, the engine's own vid_gen,
the container bytes, OpenAI's video objects), never quality."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from blazar.engines import EngineEntry, Roster
from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_diffusion

MODEL = "vid-noise"
SMALL = {"size": "64x64", "video_frames": 5, "steps": 1}


@pytest.fixture
def video_home(home: Paths, shared_home: Paths) -> Paths:
    engine = Roster(shared_home).active_of("sdcpp")
    if engine is None:
        pytest.fail(f"no sd-server built in {shared_home.home}: run ./scripts/fixtures")
    Roster(home).add(EngineEntry(tag=engine.tag, kind="sdcpp", binary=engine.binary, sha256=engine.sha256,
                                 created_at=time.time(), pseudo=True))
    add_shared_diffusion(home, shared_home, MODEL)
    add_shared_diffusion(home, shared_home, "sd-noise")
    return home


async def until_done(client: httpx.AsyncClient, video_id: str) -> dict:
    """Polling the video as a client does."""
    while True:
        view = (await client.get(f"/v1/videos/{video_id}")).json()
        if view["status"] not in ("queued", "in_progress"):
            return view
        await trio.sleep(0.2)


async def test_the_openai_client_creates_polls_downloads_and_deletes_a_video(nursery, video_home):
    from openai import AsyncOpenAI

    gateway = await start_gateway(nursery, video_home)
    with trio.fail_after(400):
        async with gateway.client(timeout=300) as client:
            models = {row["id"]: row for row in (await client.get("/v1/models")).json()["data"]}
            assert models[MODEL]["capabilities"] == ["video"] and models["sd-noise"]["capabilities"] == ["image"]
            assert models[MODEL]["fixture"] is True

            sdk = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=300, max_retries=0)
            video = await sdk.videos.create(model=MODEL, prompt="a lighthouse", size="64x64",  # type: ignore[arg-type]
                                            extra_body={"video_frames": 5, "steps": 1, "output_format": "avi"})
            assert video.object == "video" and video.status in ("queued", "in_progress") and video.size == "64x64"
            done = await until_done(client, video.id)
            assert done["status"] == "completed" and done["progress"] == 100, done
            assert done["frame_count"] == 5 and done["seconds"] == "0.3125"  # 5 frames at the model's 16 fps

            content = await sdk.videos.download_content(video.id)
            data = content.read()
            assert data[:4] == b"RIFF" and data[8:12] == b"AVI "  # a real container from the engine
            raw = await client.get(f"/v1/videos/{video.id}/content")
            assert raw.headers["content-type"] == "video/x-msvideo" and raw.content == data

            page = await sdk.videos.list(limit=10)
            assert [item.id for item in page.data] == [video.id]

            deleted = await sdk.videos.delete(video.id)
            assert deleted.deleted is True and deleted.object == "video.deleted"
            gone = await client.get(f"/v1/videos/{video.id}/content")
            assert gone.status_code == 410 and "deleted or pruned" in gone.json()["error"]["message"]
            again = await client.delete(f"/v1/videos/{video.id}")
            assert again.status_code == 200 and again.json()["deleted"] is True  # idempotent

            menu = (await client.get("/v1/videos/capabilities")).json()
            assert [card["model"] for card in menu["data"]] == [MODEL]
            assert "vid_gen" in menu["data"][0]["supported_modes"]


async def test_what_a_video_request_cannot_honour_is_a_teaching_400(nursery, video_home):
    gateway = await start_gateway(nursery, video_home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            for body, field, words in (
                ({"seconds": 4, "video_frames": 5}, "video_frames", "two dials for one knob"),
                ({"video_frames": 6}, "video_frames", "4n+1"),
                ({"size": "100x100"}, "size", "multiples of 16"),
                ({"remixed_from_video_id": "video_x"}, "remixed_from_video_id", "no local video-to-video"),
                ({"vram_overcommit": True}, "vram_overcommit", "renders video on CPU"),
                ({"output_format": "mp4"}, "output_format", "webm, webp, avi"),
                ({"video_frames": None, "seconds": "²"}, "seconds", "whole number"),  # a digit int() refuses
                ({"cfg_scale": "nan"}, "cfg_scale", "from 0 to 30"),
                ({"model": "sd-noise"}, "model", "installed: vid-noise"),
            ):
                reply = await client.post("/v1/videos", json={"model": MODEL, "prompt": "a lighthouse", **SMALL,
                                                              **body})
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["param"] == field and words in error["message"], error
            image = await client.post("/v1/images/generations", json={"model": MODEL, "prompt": "a lighthouse"})
            assert image.status_code == 400 and "renders video, not images" in image.json()["error"]["message"]
            hops = await client.get("/v1/videos/video_nope", headers={"x-blazar-hops": b"\xb2"})  # "²" in latin-1
            assert hops.status_code == 404  # a header of odd digits is not a 500
            missing = await client.get("/v1/videos/video_nope")
            assert missing.status_code == 404
            assert (await client.get("/v1/videos", params={"limit": 101})).status_code == 400
            assert not (await client.get("/api/ps")).json()["models"]  # nothing loaded for a refused request


async def test_a_running_video_job_is_viewed_and_cancelled(nursery, video_home):
    """The job spellings: /v1/videos/generations creates, /v1/videos/jobs/{id} shows the running job (loading the
    model or rendering), and its cancel ends it at once (a render the engine cannot interrupt is dropped)."""
    gateway = await start_gateway(nursery, video_home)
    with trio.fail_after(200):
        async with gateway.client(timeout=100) as client:
            created = await client.post("/v1/videos/generations", json={"model": MODEL, "prompt": "a lighthouse",
                                                                        **{**SMALL, "steps": 30}})
            assert created.status_code == 200, created.text
            video_id = created.json()["id"]
            job = (await client.get(f"/v1/videos/jobs/{video_id}")).json()
            while job["status"] != "running":  # polling the job as a client does
                await trio.sleep(0.1)
                job = (await client.get(f"/v1/videos/jobs/{video_id}")).json()
            assert job["object"] == "video.job" and job["kind"] == "video"
            cancelled = await client.post(f"/v1/videos/jobs/{video_id}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
            final = await until_done(client, video_id)
            assert final["status"] == "cancelled", final
            content = await client.get(f"/v1/videos/{video_id}/content")
            assert content.status_code == 404 and "cancelled" in content.json()["error"]["message"]


async def test_a_video_job_is_admitted_once_for_a_key_with_one_concurrent_request(nursery, video_home):
    """A job's unit of work is admitted once per model, however often it polls its engine: a key allowed one
    request at a time renders a video (it used to be refused by its own earlier leases)."""
    from blazar.config import ConfigFile
    from tests.test_tenants import TENANT, auth, issued

    video_home.config.write_text(f'[[keys]]\nname = "painter"\nsecret = "{issued(TENANT)}"\nmodels = ["{MODEL}"]\n'
                                 'max_concurrent = 1\n')
    gateway = await start_gateway(nursery, video_home, keys=ConfigFile(video_home.config).load({}).keys)
    with trio.fail_after(300):
        async with gateway.client(timeout=200, headers=auth(TENANT)) as client:
            created = await client.post("/v1/videos", json={"model": MODEL, "prompt": "a lighthouse", **SMALL,
                                                            "output_format": "avi"})
            assert created.status_code == 200, created.text
            done = await until_done(client, created.json()["id"])
            assert done["status"] == "completed", done.get("error")
