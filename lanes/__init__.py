"""The lanes Blazar serves, by kind. Adding a lane is one module (see lanes/base.py) and one line here: the
composition root starts one supervisor per entry (with the settings its module gives), `GET /v1/models`
lists every entry's installed models, and pull / rm / `/api/pull` / `/api/delete` ask `lane_owning` which
lane a model name belongs to."""

from __future__ import annotations

from typing import Any

from .base import Lane
from .llamacpp import LlamaCppLane
from .piper import PiperLane
from .sdcpp import SdCppLane
from .whisper import WhisperLane

LANES: dict[str, Lane] = {
    "llamacpp": LlamaCppLane(),
    "whisper": WhisperLane(),
    "piper": PiperLane(),
    "sdcpp": SdCppLane(),
}


def lane_owning(paths: Any, name: str) -> Lane:
    """Blocking: the lane whose model `name` is: the first lane that claims it, else the catch-all lane (a
    hub repository name goes to the llama.cpp store, which says so when it is not a GGUF repository)."""
    for lane in LANES.values():
        if not lane.catch_all and lane.claims(paths, name):
            return lane
    return next(lane for lane in LANES.values() if lane.catch_all)
