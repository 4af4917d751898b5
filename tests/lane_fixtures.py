"""Homes with an engine and a model registered without copying: the shared engine binary and the
shared SmolLM2 blob (hardlinked), or the labelled FakeLlamaServer for fault injection."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from blazar.engines import EngineEntry, Roster
from blazar.paths import Paths
from blazar.procs import pid_alive  # noqa: F401 - re-exported for the lane tests
from blazar.store import Store

FAKE_ENGINE = Path(__file__).parent / "engines" / "fake_llama_server.py"


def register_engine(home: Paths, binary: Path, tag: str, tools: dict[str, str] | None = None) -> None:
    Roster(home).add(EngineEntry(tag=tag, binary=str(binary), sha256="0" * 64, created_at=time.time(), pseudo=True,
                                 tools=tools or {}))


def add_shared_model(home: Paths, shared_home: Paths, name: str = "smollm2:135m") -> None:
    shared = Store(shared_home)
    manifest = shared.get("smollm2:135m")
    store = Store(home)
    target = store.blob_path(manifest.blob)
    if not target.exists():
        os.link(shared.blob_of(manifest), target)
    manifest.name = name
    store.put(manifest)


def add_shared_diffusion(home: Paths, shared_home: Paths, name: str = "sd-noise") -> None:
    """Hardlink a diffusion model of the shared home (scripts/fixtures made it) into a test home (no copy)."""
    source = shared_home.home / "diffusion" / name
    if not (source / "blazar.json").exists():
        raise AssertionError(f"{name} is not installed in {shared_home.home}: run ./scripts/fixtures")
    target = home.home / "diffusion" / name
    target.mkdir(parents=True)
    for file in source.iterdir():
        os.link(file, target / file.name)


async def ps(client: httpx.AsyncClient) -> list[dict]:
    return (await client.get("/api/ps")).json()["models"]


def chat_body(model: str = "smollm2:135m", text: str = "Say hello.", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def add_shared_audio(home: Paths, shared_home: Paths) -> None:
    """Hardlink the shared home's whisper models (tiny.en, base) and piper voice into a test home (no copy)."""
    from blazar import audio_models

    for source in (audio_models.whisper_dir(shared_home, "tiny.en"), audio_models.whisper_dir(shared_home, "base"),
                   audio_models.voice_file(shared_home, audio_models.DEFAULT_VOICE).parent):
        target = audio_models.audio_root(home) / source.relative_to(audio_models.audio_root(shared_home))
        target.mkdir(parents=True, exist_ok=True)
        for file in source.iterdir():
            if file.is_file() and not (target / file.name).exists():
                os.link(file, target / file.name)
