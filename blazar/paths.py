"""Where Blazar keeps its state: `$BLAZAR_HOME` (default `~/.blazar`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


class RelativeHome(ValueError):
    """BLAZAR_HOME must be absolute: a relative one would scatter state into whatever folder a
    command happens to run in."""


@dataclass(frozen=True)
class Paths:
    home: Path

    def __post_init__(self) -> None:
        if not Path(self.home).is_absolute():
            raise RelativeHome(f"BLAZAR_HOME must be an absolute path, got {str(self.home)!r}; e.g. "
                               f"BLAZAR_HOME=$PWD/{self.home} or BLAZAR_HOME=~/.blazar")

    @classmethod
    def from_env(cls) -> Paths:
        raw = os.environ.get("BLAZAR_HOME") or "~/.blazar"
        return cls(Path(raw).expanduser())

    @property
    def config(self) -> Path:
        return self.home / "config.toml"

    @property
    def ledger(self) -> Path:
        return self.home / "ledger.sqlite"

    @property
    def models(self) -> Path:
        return self.home / "models"

    @property
    def engines(self) -> Path:
        return self.home / "engines"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def sessions(self) -> Path:
        return self.home / "sessions"

    @property
    def run(self) -> Path:
        """Runtime files of a live daemon (its address, child pidfiles)."""
        return self.home / "run"

    @property
    def daemon_file(self) -> Path:
        return self.run / "serve.json"

    def ensure(self) -> Paths:
        for directory in (self.home, self.models, self.engines, self.logs, self.sessions, self.run):
            directory.mkdir(parents=True, exist_ok=True)
        return self


def read_daemon_file(paths: Paths) -> dict | None:
    """The live daemon's address, or None when none is running for this BLAZAR_HOME."""
    try:
        info = json.loads(paths.daemon_file.read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return info
