"""The engine roster: `$BLAZAR_HOME/engines/<tag>/` entries, recorded in roster.json: one active llama.cpp engine
(with a history to roll back through), and one active engine of each other lane kind that has a built engine
(`sd-server` for the sdcpp lane) in `active_by_kind`.

Blocking module (file I/O under a lock); async callers go through `trio.to_thread`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from blazar.errors import TeachingError
from blazar.paths import Paths


class EngineEntry(msgspec.Struct, kw_only=True):
    tag: str
    kind: str = "llamacpp"
    backend: str = "cpu"
    binary: str  # absolute path of llama-server
    sha256: str
    version_text: str = ""
    source: dict[str, Any] = {}
    flags: list[str] = []
    tools: dict[str, str] = {}  # other binaries built beside it: llama-quantize, rpc-server
    created_at: float = 0.0
    pseudo: bool = False  # registered with `engine local`, not built by Blazar


class RosterFile(msgspec.Struct, kw_only=True):
    active: str | None = None  # the llama.cpp engine
    history: list[str] = []  # previously active llama.cpp tags, newest last (for rollback)
    engines: dict[str, EngineEntry] = {}
    active_by_kind: dict[str, str] = {}  # the active engine of every other kind: {"sdcpp": "sd-0.4.7-cpu"}


class EngineError(TeachingError):
    """An engine that is missing, broken or cannot be built."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


LLAMA_VERSION = re.compile(r"version: \S+ \(build \d+")


def probe_version(binary: Path, timeout: float = 20) -> str:
    """`llama-server --version` text (it prints to stderr). Raises EngineError when it does not run."""
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EngineError(f"{binary} does not run: {error}",
                          fix="point at a llama-server binary built for this machine") from None
    text = (result.stdout + result.stderr).strip()
    if result.returncode != 0 or not LLAMA_VERSION.search(text):
        raise EngineError(f"{binary} is not a llama.cpp server: --version exited {result.returncode} and said "
                          f"{text[-300:]!r}", fix="point at a llama-server binary (blazar engine build cpu makes one)")
    return text


def live_children(paths: Paths) -> list[dict[str, Any]]:
    """Engine children the daemon has running (its pidfiles), dropping stale ones."""
    children = []
    folder = paths.run / "children"
    for pidfile in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            info = json.loads(pidfile.read_text())
            os.kill(int(info["pid"]), 0)
        except (OSError, ValueError, KeyError):
            continue
        children.append(info)
    return children


class Roster:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.file = paths.engines / "roster.json"

    # ------------------------------------------------------------ persistence

    def read(self) -> RosterFile:
        try:
            return msgspec.json.decode(self.file.read_bytes(), type=RosterFile)
        except FileNotFoundError:
            return RosterFile()

    @contextmanager
    def editing(self) -> Iterator[RosterFile]:
        self.paths.engines.mkdir(parents=True, exist_ok=True)
        with open(self.paths.engines / ".roster.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            roster = self.read()
            yield roster
            temp = self.file.with_suffix(".tmp")
            temp.write_bytes(msgspec.json.format(msgspec.json.encode(roster)))
            os.replace(temp, self.file)

    # ------------------------------------------------------------ queries

    def active(self) -> EngineEntry | None:
        """The active llama.cpp engine."""
        roster = self.read()
        return roster.engines.get(roster.active) if roster.active else None

    def active_of(self, kind: str) -> EngineEntry | None:
        """The active engine of a lane kind (llamacpp: the same as `active()`)."""
        if kind == "llamacpp":
            return self.active()
        roster = self.read()
        tag = roster.active_by_kind.get(kind)
        return roster.engines.get(tag) if tag else None

    def require_active(self) -> EngineEntry:
        entry = self.active()
        if entry is None:
            raise EngineError("no engine is installed", fix="blazar engine build cpu (about 10 minutes, once)")
        return entry

    def entries(self) -> list[EngineEntry]:
        return sorted(self.read().engines.values(), key=lambda e: e.created_at, reverse=True)

    def identity(self) -> dict[str, Any] | None:
        entry = self.active()
        if entry is None:
            return None
        return {"kind": entry.kind, "tag": entry.tag, "backend": entry.backend, "sha256": entry.sha256,
                "version": entry.version_text.splitlines()[0] if entry.version_text else ""}

    # ------------------------------------------------------------ changes

    def add(self, entry: EngineEntry, *, activate: bool = True) -> None:
        with self.editing() as roster:
            roster.engines[entry.tag] = entry
            if entry.kind != "llamacpp":
                if activate or entry.kind not in roster.active_by_kind:
                    roster.active_by_kind[entry.kind] = entry.tag
            elif activate or roster.active is None:
                self._activate(roster, entry.tag)

    def use(self, tag: str) -> EngineEntry:
        """Make `tag` the active engine of its own kind (an sd-server never becomes the llama.cpp engine)."""
        with self.editing() as roster:
            tag = self._resolve(roster, tag)
            entry = roster.engines[tag]
            if entry.kind != "llamacpp":
                roster.active_by_kind[entry.kind] = tag
            else:
                self._activate(roster, tag)
            return entry

    def rollback(self) -> EngineEntry:
        with self.editing() as roster:
            history = [t for t in roster.history if t in roster.engines and t != roster.active]
            if not history:
                raise EngineError("there is no previously active engine to roll back to",
                                  fix="blazar engine list, then blazar engine use TAG")
            previous = history[-1]
            roster.history = [t for t in roster.history if t != previous]
            current = roster.active
            roster.active = previous
            if current:
                roster.history.append(current)
            return roster.engines[previous]

    def remove(self, tag: str) -> EngineEntry:
        with self.editing() as roster:
            tag = self._resolve(roster, tag)
            if tag == roster.active or tag in roster.active_by_kind.values():
                raise EngineError(f"{tag} is the active engine",
                                  fix="activate another first: blazar engine use TAG (or engine rollback)")
            users = [c for c in live_children(self.paths) if c.get("engine_tag") == tag]
            if users:
                models = ", ".join(sorted({c.get("model", "?") for c in users}))
                raise EngineError(f"{tag} has live children serving {models}",
                                  fix=" && ".join(f"blazar stop {m}" for m in sorted({c.get('model', '?')
                                                                                      for c in users})))
            entry = roster.engines.pop(tag)
            roster.history = [t for t in roster.history if t != tag]
        if not entry.pseudo:
            shutil.rmtree(self.paths.engines / tag, ignore_errors=True)
        return entry

    def prune(self, keep: int) -> list[str]:
        """Remove all but the `keep` newest engines; the active one always stays."""
        roster = self.read()
        ordered = sorted((e for e in roster.engines.values() if e.kind == "llamacpp"), key=lambda e: e.created_at,
                         reverse=True)  # other kinds keep their one active engine
        kept = {e.tag for e in ordered[:keep]} | ({roster.active} if roster.active else set())
        busy = {c.get("engine_tag") for c in live_children(self.paths)}
        removed = []
        for entry in ordered:
            if entry.tag in kept or entry.tag in busy:
                continue
            self.remove(entry.tag)
            removed.append(entry.tag)
        return removed

    def register_local(self, binary: Path, tag: str | None = None) -> EngineEntry:
        binary = binary.expanduser().resolve()
        if not binary.is_file():
            raise EngineError(f"{binary} is not a file", fix="give the path of a llama-server binary")
        version = probe_version(binary)
        digest = sha256_file(binary)
        entry = EngineEntry(tag=tag or f"local-{digest[:8]}", backend="local", binary=str(binary),
                            sha256=digest, version_text=version, source={"local": str(binary)},
                            created_at=time.time(), pseudo=True)
        self.add(entry)
        return entry

    @staticmethod
    def _activate(roster: RosterFile, tag: str) -> None:
        if roster.active and roster.active != tag:
            roster.history = [t for t in roster.history if t != roster.active] + [roster.active]
        roster.active = tag

    @staticmethod
    def _resolve(roster: RosterFile, tag: str) -> str:
        if tag in roster.engines:
            return tag
        matches = [t for t in roster.engines if t.startswith(tag)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise EngineError(f"{tag!r} matches several engines: {', '.join(sorted(matches))}",
                              fix="give more of the tag")
        known = ", ".join(sorted(roster.engines)) or "none"
        raise EngineError(f"no engine {tag!r} (installed: {known})", fix="blazar engine list")
