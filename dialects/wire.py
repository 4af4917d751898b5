"""Pure pieces every dialect shares: the body decoder's error, think stripping, SSE framing.

No Quart, no actors: translation functions only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from blazar.errors import TeachingError

THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)\s*", re.DOTALL)


class RequestError(TeachingError, ValueError):
    """A request body that cannot be served as sent; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message, status=status)
        self.param = param


def decode_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", param=None)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise RequestError(f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("`model` is required: name an installed model, e.g. \"model\": \"smollm2:135m\" "
                           "(GET /v1/models lists them)", param="model")
    return model.strip()


def thinking_requested(body: dict[str, Any]) -> bool:
    """The explicit opt-ins: think, enable_thinking (top level or chat_template_kwargs), reasoning_effort."""
    if body.get("think") is True or body.get("enable_thinking") is True:
        return True
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True:
        return True
    effort = body.get("reasoning_effort")
    return isinstance(effort, str) and effort.lower() not in ("off", "none", "")


def bridge_reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """`reasoning_effort` -> `chat_template_kwargs.reasoning_effort` (an explicit request value wins)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return body
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs["reasoning_effort"] = effort
    return {**body, "chat_template_kwargs": kwargs}


def strip_think_text(text: str) -> str:
    return THINK_BLOCK.sub("", text)


def strip_think_buffered(payload: dict[str, Any]) -> dict[str, Any]:
    for choice in payload.get("choices") or []:
        message = choice.get("message") or {}
        if isinstance(message.get("content"), str):
            message["content"] = strip_think_text(message["content"])
        if isinstance(choice.get("text"), str):
            choice["text"] = strip_think_text(choice["text"])
    return payload


class ThinkFilter:
    """Streaming `<think>…</think>` removal across arbitrary chunk boundaries."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self) -> None:
        self.inside = False
        self.pending = ""
        self.after_close = False

    def feed(self, text: str) -> str:
        data = self.pending + text
        self.pending = ""
        out: list[str] = []
        while data:
            if self.inside:
                end = data.find(self.CLOSE)
                if end < 0:
                    self.pending = self._partial_suffix(data, self.CLOSE)
                    return "".join(out)
                data = data[end + len(self.CLOSE):]
                self.inside = False
                self.after_close = True
                continue
            if self.after_close:
                data = data.lstrip()
                if not data:
                    return "".join(out)
                self.after_close = False
            start = data.find(self.OPEN)
            if start < 0:
                keep = self._partial_suffix(data, self.OPEN)
                out.append(data[: len(data) - len(keep)])
                self.pending = keep
                return "".join(out)
            out.append(data[:start])
            data = data[start + len(self.OPEN):]
            self.inside = True
        return "".join(out)

    def flush(self) -> str:
        text, self.pending = ("" if self.inside else self.pending), ""
        return text

    @staticmethod
    def _partial_suffix(data: str, tag: str) -> str:
        for size in range(min(len(tag) - 1, len(data)), 0, -1):
            if data.endswith(tag[:size]):
                return data[-size:]
        return ""


class SSEParser:
    """Splits an SSE byte stream into events (each a list of `data:` payloads) across chunks."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n\n", 1)
            events.append(raw)
        return events


def data_of(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class ChatStreamRewriter:
    """Per-request SSE rewriter: strips think blocks from `delta.content` of every choice, and hands each
    piece of text (chat `delta.content` or completion `text`) to `on_text`."""

    def __init__(self, strip_think: bool, on_text: Callable[[str], None] | None = None) -> None:
        self.strip_think = strip_think
        self.filters: dict[int, ThinkFilter] = {}
        self.parser = SSEParser()
        self.on_text = on_text or (lambda _piece: None)

    def feed(self, chunk: bytes) -> bytes:
        out = []
        for event in self.parser.feed(chunk):
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = data_of(event)
        if data is None or data == b"[DONE]":
            return event + b"\n\n"
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return event + b"\n\n"
        changed = False
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if isinstance(content, str):
                if self.strip_think:
                    visible = self.filters.setdefault(choice.get("index", 0), ThinkFilter()).feed(content)
                    if visible != content:
                        delta["content"] = visible
                        changed = True
                    content = visible
                if content:
                    self.on_text(content)
            elif isinstance(choice.get("text"), str) and choice["text"]:
                self.on_text(choice["text"])
        if not changed:
            return event + b"\n\n"
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"


MAX_CHOICES = 8  # the API contract


def check_choices(body: dict[str, Any], *, lane: str | None = None, ceiling: int = MAX_CHOICES) -> int:
    """`n` within the API contract, and within what the lane serves once the model's lane is known
    (the forwarder checks that against the instance's lane)."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"`n` must be an integer from 1 to {MAX_CHOICES}, got {n!r}", param="n")
    if n > ceiling:
        raise RequestError(f"`n` is {n}, but the {lane} lane serves at most {ceiling} choices per request; "
                           f"ask for n ≤ {ceiling} and send more requests for more choices", param="n")
    return n
