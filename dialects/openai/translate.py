"""Pure functions of the OpenAI dialect: request checks, reasoning bridging, think stripping, SSE."""

from __future__ import annotations

from typing import Any

from dialects.wire import RequestError


def check_chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty array of {role, content} objects, e.g. "
                           "[{\"role\": \"user\", \"content\": \"Hello\"}]", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"`messages[{index}]` needs a string `role` (system, user, assistant or tool)",
                               param=f"messages[{index}]")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"`stream` must be true or false, got {stream!r}", param="stream")


def check_metadata(body: dict[str, Any], *, required: bool = False) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string keys (≤ 64 chars) with string values (≤ 512 chars)."""
    metadata = body.get("metadata")
    if metadata is None:
        if required:
            raise RequestError("`metadata` is required: an object of up to 16 string keys and string values",
                               param="metadata")
        return None
    if not isinstance(metadata, dict):
        raise RequestError("`metadata` must be an object of string keys and string values", param="metadata")
    if len(metadata) > 16:
        raise RequestError(f"`metadata` has {len(metadata)} keys; at most 16 are allowed", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise RequestError(f"`metadata` key {key[:20]!r}… is longer than 64 characters", param="metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise RequestError(f"`metadata.{key}` must be a string of at most 512 characters", param="metadata")
    return metadata


def structured_output_receipt(body: dict[str, Any]) -> str | None:
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        return response_format["type"]
    if body.get("grammar"):
        return "gbnf"
    return None


