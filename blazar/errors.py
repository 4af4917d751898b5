"""The one teaching-error type, error bodies in each dialect's own shape, and which dialect a path belongs to."""

from __future__ import annotations

from typing import Any

import msgspec

OPENAI, OLLAMA, ANTHROPIC, NATIVE = "openai", "ollama", "anthropic", "native"


class TeachingError(Exception):
    """What went wrong (`message`), the one field for what to do about it (`fix`), and the HTTP status a route
    answers with. Every refusal Blazar raises is one (a route's Refusal, a lane's PlanRefused, the store's,
    the config's, a key change's, a job's failure), so one renderer (dialects.edge.refuse) shows them all."""

    def __init__(self, message: str, fix: str = "", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.status = status

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 499: "request_cancelled", 502: "engine_error",
                 503: "all_slots_busy", 507: "insufficient_memory"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 502: "api_error", 503: "overloaded_error",
                    507: "api_error"}


def dialect_for_path(path: str) -> str:
    if path.startswith("/api/"):
        return OLLAMA
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith("/v1/"):
        return OPENAI
    return NATIVE


def error_body(dialect: str, status: int, message: str, *, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    if dialect == OLLAMA:
        return {"error": message, **extra}
    if dialect == ANTHROPIC:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                           "message": message, **extra}}
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "blazar_error"),
                      "code": code if code is not None else status, **extra}}


def error_bytes(path: str, status: int, message: str, **extra: Any) -> bytes:
    return msgspec.json.encode(error_body(dialect_for_path(path), status, message, **extra))
