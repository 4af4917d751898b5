"""The remote lane: a peer whose "engine child" is another gateway or server, reached over HTTP.

Pure knowledge, like every lane module: which paths each kind of peer serves, how a request is
addressed to the model's name there, which headers go with it, how a Blazar peer's capacity is read, and
how its answers are counted. (Each kind's health path is `blazar.fabric_config.PROBE_PATHS`: `blazar doctor`
reads the same paths.) The supervisor (`supervisors/remotes.py`) owns the connections,
the breaker and the capacity cache.

Kinds:
- `blazar`: another Blazar gateway. Every text route is served as it is here (the llama.cpp-native
  routes carry the model in `X-Blazar-Model`); its `/api/capacity` and `/api/ps` feed the capacity cache,
  and it has `/api/warm`.
- `openai`: an OpenAI-compatible server: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
  and the three `/v1/audio/...` routes.
- `ollama`: an Ollama server, through its OpenAI-compatible `/v1/...` routes (the three text ones).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .llamacpp import LlamaCppLane, engine_error_text

KINDS = ("blazar", "openai", "ollama")
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
AUDIO_PATHS = frozenset({"/v1/audio/speech", "/v1/audio/transcriptions", "/v1/audio/translations"})
SERVED_PATHS = {"openai": OPENAI_PATHS | AUDIO_PATHS, "ollama": OPENAI_PATHS}
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/completion"})
# Forwarded to the peer as they came: the trace spans the hop, the priority keeps its tier there.
PASSED_HEADERS = ("x-blazar-trace-id", "x-blazar-priority", "x-blazar-deadline-ms")
HOPS_HEADER = "x-blazar-hops"
MAX_HOPS = 4  # A -> B -> A loops end here with a 508

_COUNTER = LlamaCppLane()  # OpenAI-shaped answers carry the usage the llama.cpp lane already reads


class NotServed(Exception):
    """The peer's kind has no such route; the message teaches what it does serve."""


def peer_path(kind: str, path: str) -> str:
    if kind == "blazar" or path in SERVED_PATHS[kind]:
        return path
    raise NotServed(f"{path} is not served by an {kind} peer (it speaks {', '.join(sorted(SERVED_PATHS[kind]))})")


def addressed(path: str, body: bytes, model: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The request body and extra headers that name `model` on the peer: OpenAI-style routes carry it in
    the body, llama.cpp-native ones (no model field upstream) in X-Blazar-Model."""
    if not path.startswith("/v1/"):
        return body, [(b"x-blazar-model", model.encode())]
    try:
        payload = msgspec.json.decode(body) if body else {}
    except msgspec.DecodeError:
        return body, []
    if isinstance(payload, dict):
        payload["model"] = model
        return msgspec.json.encode(payload), []
    return body, []


def metered(kind: str, path: str, body: bytes) -> bytes:
    """A streamed generation's body for the peer: a Blazar peer relays it to its llama-server, which then
    reports running token counts in every event (so a cut stream is charged what was generated there); other
    kinds may refuse an unknown field, so their cut streams are charged the estimate."""
    return _COUNTER.metered(body) if kind == "blazar" and path in GENERATION_PATHS else body


def usage_total(path: str, body: bytes | None = None, tail: bytes | None = None) -> int:
    """Prompt + completion tokens the peer reported (0 when it reported none)."""
    if path not in GENERATION_PATHS:
        return 0
    payload = _COUNTER.decode(body) if body is not None else _COUNTER.final_event(tail or b"")
    return _COUNTER.usage(payload).total


def error_text(body: bytes) -> str:
    return engine_error_text(body)


def capacity_summary(capacity: dict[str, Any]) -> dict[str, Any]:
    """A Blazar peer's /api/capacity, cut to what the remotes lines show."""
    gpus = [d for d in capacity.get("gpus") or [] if isinstance(d, dict)]
    residents = [r.get("model") for r in capacity.get("residents") or [] if isinstance(r, dict)]
    return {"devices": len(gpus), "vram_total_bytes": sum(int(d.get("vram_total_bytes") or 0) for d in gpus),
            "vram_free_bytes": sum(int(d.get("vram_free_bytes") or 0) for d in gpus),
            "residents": [r for r in residents if r], "note": capacity.get("note")}
