"""The web console in a real headless Chromium against a live gateway (real llama-server)."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
import trio

from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_diffusion, add_shared_model, chat_body, register_engine

pytestmark = pytest.mark.engine
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1280,900"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: ./scripts/test installs it (apt-get install chromium)")
    return found


async def test_the_console_renders_live_data_in_chromium(nursery, home: Paths, shared_home: Paths, shared_engine,
                                                         tmp_path):
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    add_shared_diffusion(home, shared_home)
    gateway = await start_gateway(nursery, home)
    browser = chromium()
    with trio.fail_after(120):
        async with gateway.client() as client:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            job = (await client.post("/v1/responses", json={"model": "smollm2:135m", "input": "Hi.",
                                                            "background": True, "max_output_tokens": 2})).json()
            page = await client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "http://" not in page.text and "https://" not in page.text  # offline: no external references
        profile = tmp_path / "profile"
        dom = await trio.run_process(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom",
             f"{gateway.url}/ui"], capture_stdout=True, capture_stderr=True, check=False)
        html = dom.stdout.decode()
        assert 'data-loaded="yes"' in html, dom.stderr.decode()[-2000:]
        for tab in ("Dashboard", "Models", "Engines", "Compute", "Benchmarks", "Jobs", "Sessions"):
            assert f">{tab}</button>" in html
        assert "smollm2:135m" in html and shared_engine.tag in html and "state-ready" in html
        assert job["id"] in html  # the Jobs tab lists the background response
        # Every lane's installed models, the image lane's random-weight fixture labelled as such.
        assert "sd-noise" in html and "(test fixture: random weights)" in html and ">sdcpp<" in html
        shot = tmp_path / "console-dashboard.png"  # a fresh path: no earlier run's image can stand in for it
        taken = await trio.run_process([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                        "--virtual-time-budget=8000", f"--screenshot={shot}",
                                        f"{gateway.url}/ui#dashboard"], capture_stdout=True, capture_stderr=True,
                                       check=False)
    assert taken.returncode == 0, taken.stderr.decode()[-2000:]
    width, height, pixels = read_png(shot.read_bytes())
    assert (width, height) == (1280, 900)  # --window-size
    assert len(set(pixels)) > 16  # drawn: not a blank page in one colour
    OUTPUT.mkdir(exist_ok=True)  # kept for a person to look at, copied only once checked
    shutil.copyfile(shot, OUTPUT / "console-dashboard.png")


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """A PNG's size and its decompressed scanlines (enough to tell a drawn page from an empty one)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, size, image = 8, None, b""
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 4], "big")
        kind = data[offset + 4:offset + 8]
        chunk = data[offset + 8:offset + 8 + length]
        if kind == b"IHDR":
            size = (int.from_bytes(chunk[:4], "big"), int.from_bytes(chunk[4:8], "big"))
        elif kind == b"IDAT":
            image += chunk
        offset += 12 + length
    assert size is not None and image, "a PNG without IHDR or IDAT"
    return size[0], size[1], zlib.decompress(image)
