"""Pure Anthropic Messages <-> canonical (OpenAI chat) translations."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from dialects.wire import RequestError


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"`{where}` must be a string or an array of text blocks")
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise RequestError(f"`{where}[{index}]` must be a text block {{\"type\": \"text\", \"text\": ...}}")
        texts.append(block["text"])
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") or "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise RequestError(f"`{where}.source` must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or a url source")


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return "" if content is None else msgspec.json.encode(content).decode()


def messages_to_openai(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty array of {role, content} objects")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise RequestError(f"`{where}.role` must be \"user\" or \"assistant\"")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"`{where}.content` must be a string or an array of content blocks")
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for number, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            spot = f"{where}.content[{number}]"
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                parts.append(_image_part(block, spot))
            elif kind == "tool_use" and role == "assistant":
                tool_calls.append({"id": block.get("id") or f"toolu_{secrets.token_hex(8)}", "type": "function",
                                   "function": {"name": block.get("name"),
                                                "arguments": msgspec.json.encode(block.get("input") or {}).decode()}})
            elif kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _tool_result_text(block.get("content"))})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking.append(block.get("thinking", ""))
            else:
                raise RequestError(f"`{spot}.type` {kind!r} is not supported here; use text, image, tool_use "
                                   "(assistant), tool_result (user) or thinking (assistant)")
        if not parts and not tool_calls and not thinking:
            continue
        converted: dict[str, Any] = {"role": role}
        only_text = all(p["type"] == "text" for p in parts)
        converted["content"] = "\n".join(p["text"] for p in parts) if only_text else parts
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if thinking:
            converted["reasoning_content"] = "\n".join(thinking)  # prior-turn thinking is preserved
        out.append(converted)
    return out


def tools_to_openai(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("`tools` must be an array of {name, description, input_schema}")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"`tools[{index}].name` is required")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                     "parameters": tool.get("input_schema") or {"type": "object"}}})
    return out


def tool_choice_to_openai(choice: Any) -> Any:
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError("`tool_choice.type` must be auto, any, tool or none")
    kind = choice["type"]
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RequestError("`tool_choice.name` is required and must be non-empty when tool_choice.type is "
                               "\"tool\", e.g. {\"type\": \"tool\", \"name\": \"get_weather\"}")
        return {"type": "function", "function": {"name": name}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def to_openai(body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("`model` is required, e.g. \"smollm2:135m\"")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError("`max_tokens` is required: a whole number ≥ 1")
    messages = messages_to_openai(body.get("messages"))
    system = body.get("system")
    if system:
        messages.insert(0, {"role": "system", "content": _text_of(system, "system")})
    request: dict[str, Any] = {"model": model.strip(), "messages": messages, "max_tokens": max_tokens,
                               "stream": body.get("stream") is True}
    for field in ("temperature", "top_p", "top_k"):
        if field in body:
            request[field] = body[field]
    if body.get("stop_sequences"):
        if not isinstance(body["stop_sequences"], list):
            raise RequestError("`stop_sequences` must be an array of strings")
        request["stop"] = body["stop_sequences"]
    tools = tools_to_openai(body.get("tools"))
    if tools:
        request["tools"] = tools
        choice = tool_choice_to_openai(body.get("tool_choice"))
        if choice is not None:
            request["tool_choice"] = choice
    elif body.get("tool_choice") is not None:
        tool_choice_to_openai(body["tool_choice"])  # still validated
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise RequestError("`thinking.budget_tokens` is required with thinking enabled: a whole number ≥ 1")
        if max_tokens <= budget:
            raise RequestError(f"`max_tokens` ({max_tokens}) must be greater than `thinking.budget_tokens` ({budget}): "
                               f"the budget is part of max_tokens; raise max_tokens to at least {budget + 1}")
        request["chat_template_kwargs"] = {"enable_thinking": True}
        request["thinking_budget_tokens"] = budget
        request["think"] = True
    elif thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise RequestError("`thinking` must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                           "{\"type\": \"disabled\"}")
    return request


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: "end_turn"}


def usage_of(payload: dict[str, Any]) -> dict[str, int]:
    usage = payload.get("usage") or {}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
              or (payload.get("timings") or {}).get("cache_n") or 0)
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def from_openai(payload: dict[str, Any], model: str, stop_sequences: list[str] | None) -> dict[str, Any]:
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            arguments = msgspec.json.decode(call["function"].get("arguments") or "{}")
        except msgspec.DecodeError:
            arguments = {}
        content.append({"type": "tool_use", "id": _tool_id(call.get("id")), "name": call["function"]["name"],
                        "input": arguments})
    stop_reason = STOP_REASONS.get(choice.get("finish_reason"), "end_turn")
    stop_sequence = None
    if stop_reason == "end_turn" and stop_sequences and message.get("content") is not None:
        stop_sequence = None  # llama-server does not report which stop string matched
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_of(payload)}


def _tool_id(raw: str | None) -> str:
    if raw and raw.startswith("toolu_"):
        return raw
    return f"toolu_{(raw or secrets.token_hex(12)).removeprefix('call_')}"
