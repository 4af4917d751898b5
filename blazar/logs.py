"""Logging goes to stderr, always: stdout belongs to command output."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_blazar", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._blazar = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Client libraries log every request at INFO; the access log already says what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    # Its retry chatter would bury the one teaching line Blazar prints.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
