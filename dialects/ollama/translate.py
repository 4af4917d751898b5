"""Pure Ollama <-> canonical (OpenAI chat) translations."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from dialects.wire import RequestError

# Ollama `options` -> OpenAI/llama-server request fields.
OPTION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "typical_p": "typical_p", "mirostat": "mirostat",
    "mirostat_eta": "mirostat_eta", "mirostat_tau": "mirostat_tau", "num_keep": "n_keep",
}
INTEGER_OPTIONS = {"top_k", "seed", "num_predict", "repeat_last_n", "mirostat", "num_keep"}
# Options that shape the engine child, not one request: the lane maps them to spawn flags or refuses them.
SPAWN_OPTIONS = {"num_ctx", "num_thread", "num_gpu", "num_batch", "low_vram", "use_mmap", "use_mlock", "numa",
                 "main_gpu"}
# Options Ollama accepts or once accepted that have no effect on llama-server (tfs_z left llama.cpp's
# samplers; the rest were model-loading switches llama.cpp dropped). Ollama logs and serves them; so do we,
# naming them in x-blazar-ignored-options.
NO_EFFECT_OPTIONS = {"tfs_z", "penalize_newline", "num_gqa", "f16_kv", "vocab_only", "logits_all",
                     "embedding_only", "rope_frequency_base", "rope_frequency_scale"}
# Top-level request fields each route reads (besides `model`); the rest are served and named in
# x-blazar-ignored-fields, like Ollama, which ignores fields it does not know.
ROUTE_FIELDS = {
    "chat": {"model", "messages", "stream", "format", "options", "keep_alive", "tools", "think", "logprobs",
             "top_logprobs"},
    "generate": {"model", "prompt", "system", "images", "stream", "raw", "format", "options", "keep_alive", "think",
                 "logprobs", "top_logprobs"},
    "embed": {"model", "input", "options", "keep_alive"},
    "embeddings": {"model", "prompt", "options", "keep_alive"},
}


class OptionsRead(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's `options` mean here: request fields, the spawn shape, and what was not used."""

    fields: dict[str, Any]
    num_ctx: int | None
    spawn: dict[str, Any] | None
    ignored: list[str]  # known to Ollama but without effect here, or known to no Ollama version


def _check_option_type(key: str, value: Any) -> None:
    if key == "stop":
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return
        raise RequestError(f"options.stop must be a string or an array of strings, got {value!r}",
                           param="options.stop")
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "a whole number" if key in INTEGER_OPTIONS else "a number"
        raise RequestError(f"options.{key} must be {kind}, got {value!r}", param=f"options.{key}")
    if key in INTEGER_OPTIONS and not float(value).is_integer():
        raise RequestError(f"options.{key} must be a whole number, got {value!r}", param=f"options.{key}")


def read_options(options: Any, *, strict: bool = False, sampling: bool = True) -> OptionsRead:
    """Ollama `options`, the way Ollama treats them: an option that maps acts, one without effect or one no
    Ollama version knows is served and reported (refused when `strict`), a value of the wrong type is a 400.
    Without `sampling` (embeddings) the sampling options have no effect either."""
    if options is None:
        return OptionsRead(fields={}, num_ctx=None, spawn=None, ignored=[])
    if not isinstance(options, dict):
        raise RequestError("`options` must be an object, e.g. {\"temperature\": 0.2, \"num_ctx\": 4096}",
                           param="options")
    fields: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in options.items():
        if value is None:
            continue  # unset: clients send every option they know, null when the user set none
        if key in OPTION_FIELDS:
            _check_option_type(key, value)
            fields[OPTION_FIELDS[key]] = int(value) if key in INTEGER_OPTIONS else value
            if not sampling:
                ignored.append(key)
        elif key not in SPAWN_OPTIONS:
            ignored.append(key)
    if ignored and strict:
        unknown = [k for k in ignored if k not in NO_EFFECT_OPTIONS and k not in OPTION_FIELDS]
        what = (f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}" if unknown
                else f"option{'s' if len(ignored) > 1 else ''} {', '.join(map(repr, ignored))} "
                     "(no effect on llama-server)")
        accepted = ", ".join(sorted([*OPTION_FIELDS, *SPAWN_OPTIONS]))
        raise RequestError(f"{what}; this gateway refuses options it does not use (ollama_strict_options = true). "
                           f"Accepted: {accepted}. Remove them, or serve them like Ollama does with "
                           "`blazar config set ollama_strict_options false`", param="options")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 128):
        raise RequestError(f"options.num_ctx must be a whole number ≥ 128, got {num_ctx!r}", param="options.num_ctx")
    spawn = {k: v for k, v in options.items() if k in SPAWN_OPTIONS and k != "num_ctx"}
    return OptionsRead(fields=fields if sampling else {}, num_ctx=num_ctx, spawn=spawn or None, ignored=ignored)


def ignored_fields(route: str, body: dict[str, Any], *, strict: bool = False) -> list[str]:
    """Top-level fields the route does not read: served and reported, or refused when `strict`. A null is the
    same as an absent field (clients send unset fields as null)."""
    known = ROUTE_FIELDS[route]
    unread = [key for key, value in body.items() if key not in known and key != "name" and value is not None]
    if unread and strict:
        raise RequestError(f"unknown field{'s' if len(unread) > 1 else ''} {', '.join(map(repr, unread))} on "
                           f"/api/{route}; accepted: {', '.join(sorted(ROUTE_FIELDS[route]))}. Remove "
                           f"{'them' if len(unread) > 1 else 'it'}, or serve them like Ollama does with "
                           "`blazar config set ollama_strict_options false`", param=unread[0])
    return unread


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("`model` is required, e.g. {\"model\": \"smollm2:135m\"} (GET /api/tags lists them)")
    return model.strip()


def format_to_response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise RequestError(f"`format` must be \"json\" or a JSON schema object, got {fmt!r}")


def _images_to_parts(text: str, images: list[str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for image in images:
        url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise RequestError("`messages` must be an array of {role, content} objects")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"`messages[{index}]` needs a string `role`")
        content = message.get("content") or ""
        converted: dict[str, Any] = {"role": message["role"]}
        images = message.get("images") or []
        converted["content"] = _images_to_parts(content, images) if images else content
        if message.get("tool_calls"):
            converted["tool_calls"] = [
                {"id": f"call_{index}_{n}", "type": "function",
                 "function": {"name": call["function"]["name"],
                              "arguments": msgspec.json.encode(call["function"].get("arguments") or {}).decode()}}
                for n, call in enumerate(message["tool_calls"])]
        if message["role"] == "tool":
            name = message.get("name") or message.get("tool_name")  # an explicit name wins
            if name:
                converted["name"] = name
        out.append(converted)
    return out


def thinking_fields(think: Any) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"think": think, "chat_template_kwargs": {"enable_thinking": think}}
    if isinstance(think, str) and think in ("low", "medium", "high"):
        return {"reasoning_effort": think, "think": True}
    raise RequestError(f"`think` must be true, false, or \"low\"/\"medium\"/\"high\", got {think!r}")


def canonical_chat(body: dict[str, Any], options: OptionsRead) -> dict[str, Any]:
    model = require_model(body)
    request: dict[str, Any] = {"model": model, "messages": chat_messages(body.get("messages", [])),
                               **options.fields, "stream": body.get("stream", True) is not False}
    response_format = format_to_response_format(body.get("format"))
    if response_format:
        request["response_format"] = response_format
    if body.get("tools"):
        request["tools"] = body["tools"]
    request.update(thinking_fields(body.get("think")))
    if body.get("logprobs"):
        request["logprobs"] = True
        if body.get("top_logprobs"):
            request["top_logprobs"] = body["top_logprobs"]
    return request


def canonical_generate(body: dict[str, Any], options: OptionsRead) -> dict[str, Any]:
    model = require_model(body)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise RequestError("`prompt` must be a string")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("system"), str) and body["system"]:
        messages.append({"role": "system", "content": body["system"]})
    images = body.get("images") or []
    messages.append({"role": "user", "content": _images_to_parts(prompt, images) if images else prompt})
    request = canonical_chat({**body, "model": model, "messages": [], "tools": None}, options)
    request["messages"] = messages
    return request


def timing_fields(payload: dict[str, Any], started: float, load_secs: float) -> dict[str, Any]:
    usage = payload.get("usage") or {}
    timings = payload.get("timings") or {}
    total_ns = int((time.perf_counter() - started) * 1e9)
    return {
        "total_duration": total_ns,
        "load_duration": int(load_secs * 1e9),
        "prompt_eval_count": usage.get("prompt_tokens", timings.get("prompt_n", 0)),
        "prompt_eval_duration": int(timings.get("prompt_ms", 0) * 1e6),
        "eval_count": usage.get("completion_tokens", timings.get("predicted_n", 0)),
        "eval_duration": int(timings.get("predicted_ms", 0) * 1e6),
    }


def ollama_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        function = call.get("function") or call
        raw = function.get("arguments") or "{}"
        try:
            arguments = msgspec.json.decode(raw) if isinstance(raw, str) else raw
        except msgspec.DecodeError:
            arguments = {"_raw": raw}
        out.append({"function": {"name": function.get("name"), "arguments": arguments}})
    return out


def done_reason(finish_reason: str | None) -> str:
    return {"length": "length", "tool_calls": "stop", None: "stop"}.get(finish_reason, "stop")
