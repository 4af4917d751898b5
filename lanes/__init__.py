"""The lanes Blazar serves, by kind. Adding a lane is one module (see lanes/base.py) and one line here: the
composition root starts one supervisor per entry (with the settings its module gives), and `GET /v1/models`
lists every entry's installed models."""

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
