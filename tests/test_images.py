"""The image lane through the real engine: sd-server (built by Blazar from the stable-diffusion.cpp sdist) on
`sd-noise`, a **random-weight** SD1.x checkpoint with the real architecture made by scripts/fixtures. It
renders noise: these tests prove the path (routing, translation, the engine's own rendering, the answer's
shape), never image quality."""

from __future__ import annotations

import base64
import os
import struct
import time

import httpx
import pytest
import trio

from blazar.engines import EngineEntry, Roster
from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_diffusion, ps

MODEL = "sd-noise"


@pytest.fixture(scope="session")
def shared_sd_engine(shared_home: Paths) -> EngineEntry:
    entry = Roster(shared_home).active_of("sdcpp")
    if entry is None:
        pytest.fail(f"no sd-server built in {shared_home.home}: run ./scripts/test (it runs ./scripts/fixtures, "
                    "which builds it once)")
    return entry


@pytest.fixture
def images_home(home: Paths, shared_home: Paths, shared_sd_engine: EngineEntry) -> Paths:
    """A home with the shared sd-server registered and sd-noise hardlinked from the shared home (no copy)."""
    Roster(home).add(EngineEntry(tag=shared_sd_engine.tag, kind="sdcpp", binary=shared_sd_engine.binary,
                                 sha256=shared_sd_engine.sha256, created_at=time.time(), pseudo=True))
    add_shared_diffusion(home, shared_home, MODEL)
    return home


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def generate(client: httpx.AsyncClient, **body):
    return client.post("/v1/images/generations", json={"model": MODEL, "prompt": "a lighthouse", **body})


async def test_the_official_openai_client_generates_an_image_through_the_real_engine(nursery, images_home):
    from openai import AsyncOpenAI

    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(240):
        async with gateway.client(timeout=200) as client:
            models = {row["id"]: row for row in (await client.get("/v1/models")).json()["data"]}
            assert models[MODEL]["lane"] == "sdcpp" and models[MODEL]["capabilities"] == ["image"]
            assert models[MODEL]["fixture"] is True and "random weights" in models[MODEL]["note"]

            sdk = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=200, max_retries=0)
            raw = await sdk.images.with_raw_response.generate(model=MODEL, prompt="a lighthouse at dusk",
                                                              size="128x128", n=1, extra_body={"steps": 2})
            assert "random weights" in raw.headers["x-blazar-fixture"]
            image = raw.parse()
            assert image.data is not None and len(image.data) == 1 and image.data[0].b64_json
            assert png_size(base64.b64decode(image.data[0].b64_json)) == (128, 128)
            assert image.output_format == "png"

            [row] = [r for r in await ps(client) if r["model"] == MODEL]
            assert row["lane"] == "sdcpp" and row["engine"].startswith("sd-") and row["state"] in ("ready", "busy")

            # The live menu comes from the child itself; a GET never loads anything (checked below on a cold model).
            menu = (await client.get("/v1/images/capabilities", params={"model": MODEL})).json()
            [card] = menu["data"]
            assert card["model"] == MODEL and "euler_a" in card["samplers"] and "png" in card["output_formats"]


async def test_seed_steps_and_quality_reach_the_engine(nursery, images_home):
    """The native fields travel to sd-server: the same seed renders the same pixels, another seed other ones;
    `quality` scales the model's own default step count (asked of its live child)."""
    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(400):
        async with gateway.client(timeout=300) as client:
            shots = []
            for seed in (7, 7, 8):
                reply = await generate(client, size="64x64", steps=2, seed=seed)
                assert reply.status_code == 200, reply.text
                shots.append(reply.json()["data"][0]["b64_json"])
            assert shots[0] == shots[1] and shots[0] != shots[2]

            two = await generate(client, size="64x64", n=2, steps=1, seed=3)
            assert two.status_code == 200, two.text
            assert len(two.json()["data"]) == 2 and two.json()["size"] == "64x64"

            low = await generate(client, size="64x64", quality="low", seed=7)
            assert low.status_code == 200, low.text
            assert low.json()["quality"] == "low"
            # low = half of sd-server's default of 20 steps: ten steps render other pixels than two.
            assert low.json()["data"][0]["b64_json"] != shots[0]

            jpeg = await generate(client, size="64x64", steps=1, output_format="jpeg", output_compression=80)
            assert jpeg.status_code == 200, jpeg.text
            assert base64.b64decode(jpeg.json()["data"][0]["b64_json"])[:3] == b"\xff\xd8\xff"


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"response_format": "url"}, "response_format", "hosts no image files"),
    ({"style": "vivid"}, "style", "cfg_scale"),
    ({"moderation": "low"}, "moderation", "no image moderation model"),
    ({"background": "transparent"}, "background", "opaque"),
    ({"partial_images": 2}, "partial_images", "partial images"),
    ({"size": "100x100"}, "size", "multiples of 64"),
    ({"n": 9}, "n", "from 1 to 8"),
    ({"steps": 4, "quality": "high"}, "quality", "two dials for one knob"),
    ({"quality": "ultra"}, "quality", "low, medium"),
    ({"output_format": "gif"}, "output_format", "png, jpeg, webp"),
    ({"output_compression": 50}, "output_compression", "jpeg and webp only"),
    ({"seed": "seven"}, "seed", "whole number"),
    ({"colour": "red"}, "colour", "accepted:"),
    ({"async": "yes"}, "async", "true or false"),
    ({"prompt": "x<sd_cpp_extra_args>{}</sd_cpp_extra_args>"}, "prompt", "as fields"),
])
async def test_what_cannot_be_honoured_is_a_teaching_400_naming_the_field(nursery, images_home, body, field, words):
    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            reply = await generate(client, **body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == field and words in error["message"], error
            assert not [r for r in await ps(client) if r["model"] == MODEL]  # refused before anything loaded


async def test_a_model_that_is_not_a_diffusion_model_and_a_cold_menu_teach(nursery, images_home):
    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            missing = await client.post("/v1/images/generations", json={"prompt": "a lighthouse"})
            assert missing.status_code == 400 and "installed: sd-noise" in missing.json()["error"]["message"]

            text_model = await generate(client, model="smollm2:135m")
            assert text_model.status_code == 404, text_model.text
            assert "diffusion model 'smollm2:135m' is not installed; installed: sd-noise" in \
                text_model.json()["error"]["message"]

            empty = (await client.get("/v1/images/capabilities")).json()
            assert empty == {"object": "list", "data": [], "installed": [MODEL]}
            cold = await client.get("/v1/images/capabilities", params={"model": MODEL})
            assert cold.status_code == 400 and "a GET never loads one" in cold.json()["error"]["message"]
            assert not await ps(client)


def test_the_roster_keeps_one_active_engine_per_lane_kind(home: Paths, tmp_path):
    """sd-server joins the roster beside llama-server: registering it leaves the llama.cpp engine active, a prune
    of old llama.cpp engines keeps it, and the active engine of a kind cannot be removed."""
    from blazar.engines import EngineError

    roster = Roster(home)
    binary = tmp_path / "bin"
    binary.write_bytes(b"")
    roster.add(EngineEntry(tag="b1-cpu", binary=str(binary), sha256="0" * 64, created_at=1.0, pseudo=True))
    roster.add(EngineEntry(tag="sd-0.4.7-cpu", kind="sdcpp", binary=str(binary), sha256="1" * 64, created_at=2.0,
                           pseudo=True))
    roster.add(EngineEntry(tag="b2-cpu", binary=str(binary), sha256="2" * 64, created_at=3.0, pseudo=True))
    assert roster.active().tag == "b2-cpu" and roster.active_of("llamacpp").tag == "b2-cpu"
    assert roster.active_of("sdcpp").tag == "sd-0.4.7-cpu" and roster.active_of("whisper") is None
    assert roster.prune(keep=1) == ["b1-cpu"]
    assert roster.use("sd-0").kind == "sdcpp"  # `engine use` of an sd-server keeps llama.cpp's engine as it is
    assert roster.active().tag == "b2-cpu" and roster.active_of("sdcpp").tag == "sd-0.4.7-cpu"
    with pytest.raises(EngineError, match="is the active engine"):
        roster.remove("sd-0.4.7-cpu")
    assert {e.tag for e in roster.entries()} == {"b2-cpu", "sd-0.4.7-cpu"}


async def test_engine_build_lane_sdcpp_registers_sd_server_beside_llama_server(home: Paths, shared_home: Paths,
                                                                             shared_sd_engine: EngineEntry):
    """The command on a machine whose build cache has the tree already (BLAZAR_BUILD_CACHE: the shared one): cmake
    finds nothing to compile, the binary is installed into this home and registered under the lane's kind."""
    import json

    from tests.conftest import arun_cli

    env = {**os.environ, "BLAZAR_HOME": str(home.home), "BLAZAR_BUILD_CACHE": str(shared_home.engines)}
    built = await arun_cli("engine", "build", "cpu", "--lane", "sdcpp", "--json", env=env, seconds=600)
    assert built.returncode == 0, built.stderr
    done = json.loads(built.stdout.splitlines()[-1])
    assert done["event"] == "done" and done["lane"] == "sdcpp" and done["kind"] == "sdcpp"
    assert done["tag"] == shared_sd_engine.tag and done["sha256"] == shared_sd_engine.sha256
    entry = Roster(home).active_of("sdcpp")
    assert entry is not None and entry.binary.startswith(str(home.engines)) and Roster(home).active() is None

    refused = await arun_cli("engine", "build", "cpu", "--lane", "whisper", env=env)
    assert refused.returncode != 0 and "no lane of that kind builds an engine" in refused.stderr


async def until_job(client: httpx.AsyncClient, job_id: str, states: tuple[str, ...]) -> dict:
    while True:
        view = (await client.get(f"/v1/images/jobs/{job_id}")).json()
        if view["status"] in states:
            return view
        await trio.sleep(0.1)


async def test_an_async_image_is_a_job_to_poll_and_a_stream_ends_with_the_images(nursery, images_home):
    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(300):
        async with gateway.client(timeout=200) as client:
            queued = await generate(client, size="64x64", steps=1, seed=5, **{"async": True})
            assert queued.status_code == 202, queued.text
            handle = queued.json()
            assert handle["object"] == "image.job" and handle["poll_url"] == f"/v1/images/jobs/{handle['id']}"
            done = await until_job(client, handle["id"], ("completed", "failed"))
            assert done["status"] == "completed", done
            [item] = done["result"]["data"]
            assert png_size(base64.b64decode(item["b64_json"])) == (64, 64)
            listed = (await client.get("/v1/jobs", params={"kind": "image"})).json()["data"]
            assert [row["id"] for row in listed] == [handle["id"]]

            # The same seed through the stream: keep-alives while it renders, then the same pixels.
            events = []
            async with client.stream("POST", "/v1/images/generations", json={
                    "model": MODEL, "prompt": "a lighthouse", "size": "64x64", "steps": 1, "seed": 5,
                    "stream": True}) as response:
                assert response.status_code == 200 and "random weights" in response.headers["x-blazar-fixture"]
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        events.append(line.removeprefix("event:").strip())
                    elif line.startswith("data:"):
                        payload = httpx.Response(200, content=line[5:]).json()
            assert events == ["image_generation.completed"]
            assert payload["b64_json"] == item["b64_json"] and payload["size"] == "64x64"

            both = await generate(client, stream=True, **{"async": True})
            assert both.status_code == 400 and both.json()["error"]["param"] == "stream"


async def test_a_rendering_image_job_can_be_cancelled(nursery, images_home):
    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(300):
        async with gateway.client(timeout=200) as client:
            queued = (await generate(client, size="256x256", steps=20, **{"async": True})).json()
            await until_job(client, queued["id"], ("running",))
            cancelled = await client.post(f"/v1/images/jobs/{queued['id']}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
            final = await until_job(client, queued["id"], ("cancelled", "completed", "failed"))
            assert final["status"] == "cancelled" and final["result"] is None
            missing = await client.get("/v1/images/jobs/job_nope")
            assert missing.status_code == 404 and "GET /v1/jobs?kind=image" in missing.json()["error"]["message"]


async def test_a_gateway_killed_mid_render_leaves_a_job_that_says_so(images_home: Paths, tmp_path):
    """SIGKILL of `blazar serve` while sd-server renders an async job: after the next boot the job is a record
    that says the gateway stopped while it was running and how to fix it, and sd-server died with the gateway."""
    import signal

    from tests.conftest import ServeProcess
    from tests.lane_fixtures import pid_alive

    first = ServeProcess(images_home, tmp_path / "first.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(240):
            info = await first.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as client:
                queued = (await generate(client, size="256x256", steps=20, **{"async": True})).json()
                await until_job(client, queued["id"], ("running",))
                # Until the child is listed with its pid.
                while not (rows := [r for r in await ps(client) if r["model"] == MODEL and r.get("pid")]):  # noqa: ASYNC110
                    await trio.sleep(0.1)
                engine = rows[0]["pid"]
            os.kill(info["pid"], signal.SIGKILL)
            await first.wait()
            while pid_alive(engine):  # noqa: ASYNC110 - the kernel's parent-death signal, not ours
                await trio.sleep(0.05)
    finally:
        first.kill()
    images_home.daemon_file.unlink(missing_ok=True)
    second = ServeProcess(images_home, tmp_path / "second.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(120):
            info = await second.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as client:
                view = (await client.get(f"/v1/images/jobs/{queued['id']}")).json()
        assert view["status"] == "failed", view
        assert view["error"] == {"message": "the gateway stopped while this job was running",
                                 "fix": "submit it again"}
    finally:
        second.kill()


async def test_the_openai_client_edits_an_image_and_makes_variations_of_it(nursery, images_home):
    """Edits and variations through the real engine: the picture is sd-server's init image (and the mask its
    inpainting mask); the answer has the input's size unless `size` says otherwise."""
    from openai import AsyncOpenAI, BadRequestError

    gateway = await start_gateway(nursery, images_home)
    with trio.fail_after(400):
        async with gateway.client(timeout=300) as client:
            source = await generate(client, size="64x64", steps=1, seed=11)
            picture = base64.b64decode(source.json()["data"][0]["b64_json"])
            sdk = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=300, max_retries=0)

            edited = await sdk.images.edit(model=MODEL, image=("in.png", picture, "image/png"), prompt="a red door",
                                           mask=("mask.png", picture, "image/png"), extra_body={"steps": 2, "seed": 1})
            assert edited.data is not None and png_size(base64.b64decode(edited.data[0].b64_json)) == (64, 64)

            varied = await sdk.images.create_variation(model=MODEL, image=("in.png", picture, "image/png"), n=2,
                                                       size="128x128", extra_body={"steps": 1, "seed": 2})
            assert varied.data is not None and len(varied.data) == 2
            assert {png_size(base64.b64decode(item.b64_json)) for item in varied.data} == {(128, 128)}
            # The init image reaches the engine: another picture, same seed and prompt, renders other pixels.
            other = await sdk.images.create_variation(model=MODEL, image=("in.png", base64.b64decode(
                edited.data[0].b64_json), "image/png"), n=2, size="128x128", extra_body={"steps": 1, "seed": 2})
            assert other.data is not None and other.data[0].b64_json != varied.data[0].b64_json

            for call, field in ((sdk.images.create_variation(model=MODEL, image=("in.png", picture, "image/png"),
                                                             extra_body={"mask": "x"}), "mask"),
                                (sdk.images.create_variation(model=MODEL, image=("in.txt", b"hello", "text/plain")),
                                 "image")):
                with pytest.raises(BadRequestError) as refused:
                    await call
                assert refused.value.body["param"] == field, refused.value.body
                assert field != "mask" or "/v1/images/edits" in refused.value.body["message"]

            upscale = await client.post("/v1/images/upscale", json={"image": "x"})
            assert upscale.status_code == 501 and "hires fix" in upscale.json()["error"]["message"]


async def test_blazar_run_renders_a_png_and_says_where(images_home: Paths, tmp_path):
    from tests.conftest import ServeProcess, arun_cli

    server = ServeProcess(images_home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(240):
            await server.start()
            target = tmp_path / "lighthouse.png"
            made = await arun_cli("run", "--size", "64x64", "--steps", "1", "-o", str(target), MODEL,
                                  "a lighthouse", seconds=200)
            assert made.returncode == 0, made.stderr
            assert made.stdout.startswith(f"wrote {target} (64x64, ") and "random weights" in made.stderr
            assert png_size(target.read_bytes()) == (64, 64)
            refused = await arun_cli("run", "--size", "64x64", "smollm2", "hi")
            assert refused.returncode == 1 and "--size applies to image models only" in refused.stderr
    finally:
        server.kill()


async def test_image_work_is_admitted_like_any_request_of_the_key(nursery, images_home: Paths):
    """A key scoped to a chat model gets a teaching 403 for the diffusion model (sync, async and edits alike),
    before anything loads; a key scoped to the diffusion model is served and sees only its own image jobs."""
    from blazar.config import ConfigFile
    from tests.test_tenants import OWNER, TENANT, auth, issued

    chat_only = "plm_" + "ab" * 16
    images_home.config.write_text(
        f'[[keys]]\nname = "owner"\nsecret = "{issued(OWNER)}"\n\n'
        f'[[keys]]\nname = "painter"\nsecret = "{issued(TENANT)}"\nmodels = ["{MODEL}"]\n\n'
        f'[[keys]]\nname = "chatter"\nsecret = "{issued(chat_only)}"\nmodels = ["smollm2:135m"]\n')
    gateway = await start_gateway(nursery, images_home, keys=ConfigFile(images_home.config).load({}).keys)
    with trio.fail_after(200):
        async with gateway.client(timeout=150) as client:
            for body in ({}, {"async": True}, {"stream": True}):  # a stream's refusal is a 403 too, not a 200
                refused = await client.post("/v1/images/generations", headers=auth(chat_only), json={
                    "model": MODEL, "prompt": "a lighthouse", "size": "64x64", "steps": 1, **body})
                assert refused.status_code == 403, refused.text
                assert MODEL in refused.json()["error"]["message"]
            assert not (await client.get("/api/ps", headers=auth(OWNER))).json()["models"]  # nothing was loaded

            queued = await client.post("/v1/images/generations", headers=auth(TENANT), json={
                "model": MODEL, "prompt": "a lighthouse", "size": "64x64", "steps": 1, "async": True})
            assert queued.status_code == 202, queued.text
            job = queued.json()["id"]
            hidden = await client.get(f"/v1/images/jobs/{job}", headers=auth(chat_only))
            assert hidden.status_code == 404  # another key's job does not exist for it
            async def status() -> str:
                return (await client.get(f"/v1/images/jobs/{job}", headers=auth(TENANT))).json()["status"]

            while await status() != "completed":  # noqa: ASYNC110 - polling the job as its owner would
                await trio.sleep(0.1)
