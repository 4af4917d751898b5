"""The llama.cpp lane: how to spawn `llama-server`, when it is ready, how to read its errors.

Pure functions: no trio state. Facts about this engine (measured on b11434):
- `/health` answers 503 while the model loads and 200 once it can serve.
- `--ctx-size` is the total context, shared by `--parallel` slots: each slot gets ctx/parallel.
- `/v1/embeddings` needs the server started with `--embeddings` and a pooling type for models without
  pooling metadata (`--pooling mean`); chat keeps working on such an instance.
- Errors come as JSON `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HEALTH_PATH = "/health"
DEFAULT_CONTEXT = 4096
DEFAULT_SLOTS = 2


@dataclass(frozen=True)
class SpawnPlan:
    """Everything that shapes one engine child. Two requests with equal plans share a child."""

    model: str
    model_path: Path
    binary: Path
    engine_tag: str
    context: int = DEFAULT_CONTEXT  # per slot
    slots: int = DEFAULT_SLOTS
    threads: int | None = None
    embeddings: bool = True
    pooling: str | None = "mean"  # forced pooling for models without pooling metadata
    rerank: bool = False
    props: bool = False
    mmproj: Path | None = None
    extra_flags: tuple[str, ...] = ()
    context_source: str = "default"
    size_bytes: int = 0

    def argv(self, port: int) -> list[str]:
        command = [
            str(self.binary), "--model", str(self.model_path), "--alias", self.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(self.context * self.slots), "--parallel", str(self.slots),
            "--jinja", "--no-webui", "--metrics", "--slots",
        ]
        if self.threads:
            command += ["--threads", str(self.threads)]
        if self.rerank:
            command += ["--reranking"]
        elif self.embeddings:
            command += ["--embeddings"] + (["--pooling", self.pooling] if self.pooling else [])
        if self.props:
            command += ["--props"]
        if self.mmproj:
            command += ["--mmproj", str(self.mmproj)]
        command += list(self.extra_flags)
        return command


def plan_context(requested: int | None, configured: int | None, overlay: int | None,
                 trained: int | None) -> tuple[int, str]:
    """Effective per-slot context and where it came from: request > config > Modelfile > default."""
    for value, source in ((requested, "request header X-Blazar-Num-Ctx"), (configured, "config num_ctx"),
                          (overlay, "Modelfile num_ctx")):
        if value:
            return int(value), source
    if trained:
        return min(int(trained), DEFAULT_CONTEXT), "default (min of trained context and 4096)"
    return DEFAULT_CONTEXT, "default"


def engine_error_text(body: bytes) -> str:
    """The engine's own message from an error body."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body.decode(errors="replace").strip()[:2000]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return json.dumps(payload)[:2000]


_HELP_CACHE: dict[tuple[str, float], str] = {}


def engine_help(binary: Path) -> str:
    """`llama-server --help` text, cached per binary and mtime (blocking: call from a worker thread)."""
    import subprocess

    key = (str(binary), binary.stat().st_mtime)
    if key not in _HELP_CACHE:
        try:
            result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
            _HELP_CACHE[key] = result.stdout + result.stderr
        except (OSError, subprocess.TimeoutExpired):
            _HELP_CACHE[key] = ""
    return _HELP_CACHE[key]
