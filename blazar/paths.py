"""Where Blazar keeps its state: `$BLAZAR_HOME` (default `~/.blazar`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    home: Path

    @classmethod
    def from_env(cls) -> Paths:
        raw = os.environ.get("BLAZAR_HOME") or "~/.blazar"
        return cls(Path(raw).expanduser().resolve())

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
