"""Output discipline: data on stdout (JSONL with --json), everything else on stderr."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import msgspec

EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: the capability is not there
EXIT_CONFIG = 78  # sysexits EX_CONFIG: config.toml is unusable

_encoder = msgspec.json.Encoder()


def emit_json(payload: Any) -> None:
    """One JSON document on one stdout line."""
    sys.stdout.buffer.write(_encoder.encode(payload) + b"\n")
    sys.stdout.flush()


def say(text: str) -> None:
    print(text, flush=True)


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fail(message: str, *, fix: str = "", code: int = 1) -> NoReturn:
    print(message if message.startswith("blazar") else f"blazar: {message}", file=sys.stderr)
    if fix:
        print(f"  fix: {fix}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(code)
