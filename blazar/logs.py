"""Logging goes to stderr, always: stdout belongs to command output.

One record is one line: control characters in a message (a client's `%0A` in a path, an escape
sequence in a model name) are written escaped (`\\n`, `\\x1b`), so no request can forge a log line or
drive the terminal that shows the log. A traceback attached to a record keeps its lines, each indented
with `  | ` (an exception's message may hold client text), so only a record starts at column 0.
"""

from __future__ import annotations

import logging
import re
import sys

_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
# C0 controls, DEL, C1 controls and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """`a\\nb` -> `a\\\\nb`: every control character as a visible escape."""
    def one(match: re.Match[str]) -> str:
        char = match.group()
        return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")

    return _CONTROL.sub(one, text)


class OneLineFormatter(logging.Formatter):
    """A Formatter whose message part never spans lines (see the module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return escape_controls(line)

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("  | " + escape_controls(line.rstrip("\r")) for line in text.split("\n"))


def setup_logging(level: str = "info") -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_blazar", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(OneLineFormatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._blazar = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Client libraries log every request at INFO; the access log already says what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    # Its retry chatter would bury the one teaching line Blazar prints.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
