"""The whisper lane: speech to text with faster-whisper (CTranslate2) in a child process
(lanes/engines/whisper_server.py), one child per whisper model, loaded on first use, evicted when idle."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from blazar import audio_models

from .base import PlanRefused
from .speech import SpeechLane, SpeechPlan, folder_size, package_version


class WhisperLane(SpeechLane):
    kind = "whisper"

    def plan(self, paths: Any, config: Any, query: str, num_ctx: int | None,
             spawn_options: tuple[tuple[str, Any], ...] = ()) -> SpeechPlan:
        name = audio_models.whisper_name(query)
        installed = audio_models.installed_whisper(paths)
        # Only a name from the installed list reaches a file path: a request's `../x` names no folder.
        folder = audio_models.whisper_dir(paths, name) if name in installed else None
        if folder is None:
            raise PlanRefused(f"whisper model {name!r} is not installed"
                              + (f"; installed: {', '.join(installed)}" if installed else ""),
                              fix=f"blazar whisper --pull --model {name}", status=404)
        version = package_version("faster-whisper")
        if not version:
            raise PlanRefused("the faster-whisper engine is not installed in Blazar's environment",
                              fix="run ./scripts/setup (it installs Blazar with its speech engines)", status=503)
        return SpeechPlan(model=f"whisper:{name}", model_path=folder, binary=Path(sys.executable),
                          engine_tag=f"faster-whisper-{version}", size_bytes=folder_size(folder),
                          threads=os.cpu_count())

    catalog_kind = audio_models.WHISPER

    def installed(self, paths: Any) -> list[str]:
        return audio_models.installed_whisper(paths)

    def served_name(self, name: str) -> str:
        return f"whisper:{name}"

    def catalog_name(self, name: str) -> str:
        return audio_models.whisper_name(name)

    def model_files(self, paths: Any, name: str) -> list[Path]:
        return [audio_models.whisper_dir(paths, name)]

    engine_module = "lanes.engines.whisper_server"
    model_flag = "--model"

    def engine_flags(self, plan: SpeechPlan) -> list[str]:
        return ["--threads", str(plan.threads or 0)]

    def list_models(self, paths: Any) -> list[dict[str, Any]]:
        engine = f"faster-whisper-{package_version('faster-whisper')}"
        return [{"id": f"whisper:{name}", "object": "model", "owned_by": "blazar", "lane": self.kind, "engine": engine,
                 "capabilities": self.capabilities(audio_models.CATALOG.get(name))}
                for name in audio_models.installed_whisper(paths)]

    def capabilities(self, manifest: Any) -> list[str]:
        return ["transcription"] + (["translation"] if getattr(manifest, "language", "") == "multi" else [])
