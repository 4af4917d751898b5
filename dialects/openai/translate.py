"""Pure functions of the OpenAI dialect: request checks, reasoning bridging, think stripping, SSE."""

from __future__ import annotations

from typing import Any

from dialects.wire import RequestError

MAX_CHOICES = 8  # the API contract
LANE_MAX_CHOICES = {"llamacpp": 2}  # what the engine really serves (llama-server caps n at 2)

def check_choices(body: dict[str, Any], lane: str = "llamacpp") -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"`n` must be an integer from 1 to {MAX_CHOICES}, got {n!r}", param="n")
    ceiling = LANE_MAX_CHOICES.get(lane, MAX_CHOICES)
    if n > ceiling:
        raise RequestError(f"`n` is {n}, but the {lane} lane serves at most {ceiling} choices per request; "
                           f"ask for n ≤ {ceiling} and send more requests for more choices", param="n")
    return n


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


