"""What the two speech lanes share: their engine is a Python library run as a loopback HTTP child
(lanes/engines/), their model is a file or folder of the audio store, and a request is charged as one
request (not tokens) against the key's limits, with the model as the scope target."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .base import Installed, PlanRefused, Progress, Usage, human_size

HEALTH_PATH = "/health"
NO_USAGE = Usage(prompt=0, completion=0, cached=0, ttft_secs=None, per_token_secs=None)


@dataclass(frozen=True)
class SpeechPlan:
    """One speech child: a model (whisper folder or voice file) and the Python that runs its engine."""

    model: str
    model_path: Path
    binary: Path  # the Python interpreter that runs lanes.engines.*
    engine_tag: str  # e.g. faster-whisper-1.2.1
    size_bytes: int
    threads: int | None = None
    digest: str = ""
    gpu_engine: bool = False
    context: int = 0
    context_source: str = "not a text model"
    slots: int = 1
    spawn_options: tuple[tuple[str, Any], ...] = field(default=())


class SpeechLane:
    """The part of the Lane protocol both speech lanes answer the same way; each lane's module adds `plan`,
    `list_models`, `capabilities` and what its engine child is (`engine_module`, `model_flag`,
    `engine_flags`)."""

    kind = ""
    health_path = HEALTH_PATH
    generation_paths: frozenset[str] = frozenset()
    max_choices = 1
    charge = "requests"
    mailbox_size = 256
    catch_all = False
    builds_engine = False  # the engine is a Python package of Blazar's environment

    def build_engine(self, paths: Any, progress: Any, *, backend: str, jobs: int | None) -> Any:
        raise PlanRefused(f"the {self.kind} lane's engine is a Python package, installed with Blazar; there is "
                          "nothing to build", fix="./scripts/setup installs it")

    # ----- models: the audio store (blazar.audio_models), one catalog kind per lane

    catalog_kind = ""  # audio_models.WHISPER or audio_models.VOICE

    def installed(self, paths: Any) -> list[str]:
        """The installed models of this lane, by their catalog names (tiny.en, en_US-joe-medium)."""
        return []

    def served_name(self, name: str) -> str:
        """The name requests use for a catalog name (whisper's are `whisper:<name>`)."""
        return name

    def catalog_name(self, name: str) -> str:
        return name

    def model_files(self, paths: Any, name: str) -> list[Path]:
        """What an installed model is on disk (removed together)."""
        return []

    def claims(self, paths: Any, name: str) -> bool:
        from blazar import audio_models

        catalog_name = self.catalog_name(name)
        entry = audio_models.CATALOG.get(catalog_name)
        return (entry is not None and entry.kind == self.catalog_kind) or catalog_name in self.installed(paths)

    def resolve(self, paths: Any, name: str) -> str:
        from blazar.store import StoreError

        catalog_name = self.catalog_name(name)
        if catalog_name not in self.installed(paths):
            raise StoreError(f"no {self.kind} model {name!r} is installed", fix="GET /v1/models lists what is",
                             status=404)
        return self.served_name(catalog_name)

    def install(self, paths: Any, name: str, *, force: bool, progress: Progress,
                notes: Callable[[str], None]) -> Installed:
        from blazar import audio_models

        entry, fetched = audio_models.install(paths, self.catalog_name(name), force=force, progress=progress,
                                              notes=notes)
        summary = f"installed {entry.kind} {entry.name} ({human_size(entry.size)})" if fetched else \
            f"{entry.name} is up to date"
        return Installed(name=self.served_name(entry.name), lane=self.kind, size=entry.size, fetched=fetched,
                         summary=summary, record={"name": entry.name, "kind": entry.kind, "size": entry.size})

    def remove(self, paths: Any, name: str, *, running: set[str]) -> str:
        from blazar.store import StoreError

        catalog_name = self.catalog_name(name)
        installed = self.installed(paths)
        if catalog_name not in installed:  # only a name from the installed list reaches a file path
            raise StoreError(f"no {self.kind} model {name!r} is installed"
                             + (f"; installed: {', '.join(installed)}" if installed else ""),
                             fix="blazar models lists what is installed", status=404)
        served = self.served_name(catalog_name)
        if served in running:
            raise StoreError(f"{served} is running", fix=f"blazar stop {served}, then rm again", status=409)
        for path in self.model_files(paths, catalog_name):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return served

    def settings(self, config: Any) -> Any:
        """Speech children idle out on their own clock (`audio_idle_secs`) and have no per-model settings."""
        return msgspec.structs.replace(config, keep_alive=config.audio_idle_secs, models={})

    def normalize_spawn_options(self, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        if options:
            raise PlanRefused(f"the {self.kind} lane takes no spawn options", fix="drop them")
        return ()

    def usage(self, payload: dict[str, Any]) -> Usage:
        return NO_USAGE

    def metered(self, body: bytes) -> bytes:
        return body  # charged per request: nothing to count

    def final_event(self, tail: bytes) -> dict[str, Any]:
        return {}

    def decode(self, body: bytes) -> dict[str, Any]:
        return {}  # no generation paths: never asked

    # What each speech lane's module declares of its engine child: the module run with `python -m`, the flag
    # that names the model file or folder, and any flags of its own (`engine_flags`).
    engine_module = ""
    model_flag = ""

    def engine_flags(self, plan: SpeechPlan) -> list[str]:
        return []

    def argv(self, plan: SpeechPlan, port: int) -> list[str]:
        return [str(plan.binary), "-m", self.engine_module, self.model_flag, str(plan.model_path),
                "--port", str(port), *self.engine_flags(plan)]

    def error_text(self, body: bytes) -> str:
        try:
            return str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return body.decode(errors="replace").strip()[:2000]

    async def count_prompt_tokens(self, ask: Any, chat: dict[str, Any]) -> int:
        raise PlanRefused(f"the {self.kind} lane has no prompt tokens to count", status=400)

    def describe_plan(self, plan: SpeechPlan) -> dict[str, Any]:
        return {"lane": {"kind": self.kind, "engine": plan.engine_tag, "binary": str(plan.binary),
                         "reason": f"{plan.model} is served by the {self.kind} lane"},
                "model_path": str(plan.model_path), "flags": self.argv(plan, 0)[1:]}


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
