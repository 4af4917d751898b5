"""The piper lane: text to speech with piper (lanes/engines/piper_server.py), one child per voice, the voice
kept loaded between requests, evicted when idle. The model a request names is the piper voice id."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from blazar import audio_models

from .base import PlanRefused
from .speech import SpeechLane, SpeechPlan, package_version


class PiperLane(SpeechLane):
    kind = "piper"

    def plan(self, paths: Any, config: Any, query: str, num_ctx: int | None,
             spawn_options: tuple[tuple[str, Any], ...] = ()) -> SpeechPlan:
        installed = audio_models.installed_voices(paths)
        # Only a name from the installed list reaches a file path: a request's `../x` names no file.
        voice = audio_models.voice_file(paths, query) if query in installed else None
        if voice is None:
            raise PlanRefused(f"piper voice {query!r} is not installed"
                              + (f"; installed: {', '.join(installed)}" if installed else ""),
                              fix=f"blazar pull {query if query in audio_models.CATALOG else 'en_US-joe-medium'}",
                              status=404)
        version = package_version("piper-tts")
        if not version:
            raise PlanRefused("the piper engine is not installed in Blazar's environment",
                              fix="run ./scripts/setup (it installs Blazar with its speech engines)", status=503)
        return SpeechPlan(model=query, model_path=voice, binary=Path(sys.executable), engine_tag=f"piper-{version}",
                          size_bytes=voice.stat().st_size)

    catalog_kind = audio_models.VOICE

    def installed(self, paths: Any) -> list[str]:
        return audio_models.installed_voices(paths)

    def model_files(self, paths: Any, name: str) -> list[Path]:
        voice = audio_models.voice_file(paths, name)
        return [voice, voice.with_suffix(".onnx.json")]

    engine_module = "lanes.engines.piper_server"
    model_flag = "--voice"

    def list_models(self, paths: Any) -> list[dict[str, Any]]:
        engine = f"piper-{package_version('piper-tts')}"
        return [{"id": voice, "object": "model", "owned_by": "blazar", "lane": self.kind, "engine": engine,
                 "capabilities": ["speech"]} for voice in audio_models.installed_voices(paths)]

    def capabilities(self, manifest: Any) -> list[str]:
        return ["speech"]
