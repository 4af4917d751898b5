"""The lanes Blazar serves, by kind. Adding a lane is one module (see lanes/base.py) and one line here."""

from __future__ import annotations

from .base import Lane
from .llamacpp import LlamaCppLane
from .piper import PiperLane
from .whisper import WhisperLane

LANES: dict[str, Lane] = {
    "llamacpp": LlamaCppLane(),
    "whisper": WhisperLane(),
    "piper": PiperLane(),
}


def lane_for(manifest: object) -> Lane:
    """The lane that serves an installed model (every GGUF is llama.cpp's today)."""
    return LANES["llamacpp"]
