"""Pure Responses API <-> canonical chat translations: request checks, input items to chat messages, the
response object, and the Responses stream event sequence. No Quart, no actors."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dialects.wire import RequestError, require_model

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "input_image")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def conversation_name(body: dict[str, Any]) -> str | None:
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        value = value["id"]
    if not isinstance(value, str) or not value.strip() or len(value) > 256:
        raise RequestError("`conversation` must be a name (a string of 1-256 characters), e.g. \"kitchen\", or "
                           "{\"id\": \"kitchen\"}", param="conversation")
    return value.strip()


def check_request(body: dict[str, Any]) -> None:
    """Teaching 400s for what the Responses API refuses, before anything is loaded."""
    require_model(body)
    if "input" not in body or body["input"] in ("", []):
        raise RequestError("`input` is required: a string, or an array of input items such as "
                           "{\"role\": \"user\", \"content\": \"Hi\"}", param="input")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise RequestError("`store` must be true or false", param="store")
    if body.get("background") is True:
        if body.get("stream") is True:
            raise RequestError("`background: true` cannot stream: a background response is polled with "
                               "GET /v1/responses/{id}; drop `stream`, or drop `background` to stream it now",
                               param="background")
        if store is False:
            raise RequestError("`background: true` needs `store: true`: the result is kept for GET "
                               "/v1/responses/{id} to serve", param="store")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RequestError("`previous_response_id` must be the id of a stored response (resp_…)",
                           param="previous_response_id")
    for name in ("max_output_tokens",):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(f"`{name}` must be a positive integer, got {value!r}", param=name)
    conversation_name(body)
    input_messages(body)  # shape errors surface here, before anything is loaded


def _content(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"`{where}.content` must be a string or an array of content parts", param=where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise RequestError(f"`{where}.content[{index}].image_url` must be a URL or a data: URL "
                                   "(file_id images are not served here)", param=where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RequestError(f"`{where}.content[{index}].type` {kind!r} is not supported; use one of "
                               f"{', '.join(PART_TYPES)}", param=where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`input` (a string or items) as chat messages."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("`input` must be a string or an array of input items", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"`{where}` must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"`{where}.role` must be user, assistant, system or developer, got {role!r}",
                                   param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or new_id("call"), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"`{where}.call_id` is required: the call_id of the function_call it answers",
                                   param="input")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else msgspec.json.encode(output).decode()})
        else:
            raise RequestError(f"`{where}.type` {kind!r} is not supported; use one of {', '.join(INPUT_ITEM_TYPES)}",
                               param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise RequestError(f"`tools[{index}]` must be {{\"type\": \"function\", \"name\": …, \"parameters\": …}}; "
                               "hosted tools (web search, file search, computer use) are not served locally",
                               param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The canonical chat request, and the conversation it continues plus this turn's input (what a stored
    response keeps for chaining; instructions are not carried over, as in OpenAI's API)."""
    turn = [*history, *input_messages(body)]
    messages = list(turn)
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict[str, Any] = {"model": require_model(body), "messages": messages, "stream": body.get("stream") is True}
    for source, target in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("reasoning", "reasoning"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(source) is not None:
            chat[target] = body[source]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                           "schema": fmt.get("schema", {})}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat, turn


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant chat message as Responses output items."""
    items: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        items.append(message_item(new_id("msg"), text, "completed"))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(new_id("fc"), call.get("id") or new_id("call"),
                                        call["function"]["name"], call["function"].get("arguments") or "{}",
                                        "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(response_id: str, body: dict[str, Any], *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, created: float, conversation: str | None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": status,
        "background": body.get("background") is True, "error": error, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"), "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True), "temperature": body.get("temperature"), "text": text,
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage, "user": None,
        "metadata": body.get("metadata") or {},
        "conversation": {"id": conversation} if conversation else None,
    }


def chat_message(payload: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a buffered chat completion, as it goes back into the history."""
    message = ((payload.get("choices") or [{}])[0].get("message") or {})
    kept: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return kept


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class StreamedResponse:
    """OpenAI chat chunks in, the Responses event sequence out; keeps the final object and message."""

    def __init__(self, response_id: str, body: dict[str, Any], conversation: str | None) -> None:
        self.id = response_id
        self.body = body
        self.conversation = conversation
        self.created = time.time()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text = ""
        self.text_index: int | None = None
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.usage: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None
        self.message: dict[str, Any] = {"role": "assistant", "content": None}

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(event)

    def _object(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.id, self.body, status=status, output=self.output, usage=self.usage,
                               created=self.created, conversation=self.conversation, error=error)

    async def events(self, chunks: AsyncIterator[dict[str, Any]], broken: type[Exception]) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self._object("in_progress"))
        yield self._event("response.in_progress", response=self._object("in_progress"))
        try:
            async for chunk in chunks:
                if chunk.get("usage"):
                    self.usage = usage_of(chunk["usage"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if isinstance(delta.get("content"), str) and delta["content"]:
                        for frame in self._text(delta["content"]):
                            yield frame
                    for call in delta.get("tool_calls") or []:
                        for frame in self._call(call):
                            yield frame
        except broken as error:
            yield self._event("response.failed", response=self._object(
                "failed", {"code": "server_error", "message": str(error)}))
            return
        for frame in self._close():
            yield frame
        self.final = self._object("completed")
        yield self._event("response.completed", response=self.final)

    def _text(self, piece: str) -> list[bytes]:
        frames = []
        if self.text_index is None:
            self.text_index = len(self.output)
            self.output.append(message_item(new_id("msg"), "", "in_progress"))
            item = self.output[self.text_index]
            frames.append(self._event("response.output_item.added", output_index=self.text_index,
                                      item={**item, "content": []}))
            frames.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.text_index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.text += piece
        item = self.output[self.text_index]
        frames.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.text_index,
                                  content_index=0, delta=piece, logprobs=[]))
        return frames

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        frames = []
        slot = call.get("index", 0)
        function = call.get("function") or {}
        if slot not in self.calls:
            self.calls[slot] = len(self.output)
            self.output.append(function_call_item(new_id("fc"), call.get("id") or new_id("call"),
                                                  function.get("name") or "", "", "in_progress"))
            frames.append(self._event("response.output_item.added", output_index=self.calls[slot],
                                      item=dict(self.output[self.calls[slot]])))
        item = self.output[self.calls[slot]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            frames.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.calls[slot], delta=function["arguments"]))
        return frames

    def _close(self) -> list[bytes]:
        frames = []
        for index, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
                item["content"] = [part]
                frames.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=self.text, logprobs=[]))
                frames.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                          content_index=0, part=part))
                self.message["content"] = self.text
            else:
                frames.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, arguments=item["arguments"]))
                self.message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
            frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames
