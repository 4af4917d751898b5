"""What the two speech lanes share: their engine is a Python library run as a loopback HTTP child
(lanes/engines/), their model is a file or folder of the audio store, and a request is charged as one
request (not tokens) against the key's limits, with the model as the scope target."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .base import PlanRefused, Usage

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
