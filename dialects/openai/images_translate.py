"""OpenAI's image generation request, checked and shallow-translated for sd-server (pure: no I/O).

What the OpenAI API spells one way and sd-server another:
- `size` "WxH" → width/height (sd-server renders multiples of 64, so other sizes are refused, not rounded);
- `quality` (low/medium/high/xhigh/max/auto, standard/hd) scales the model's own default step count;
  `steps` sets it outright, and both together are a teaching 400 (two dials for one knob);
- `seed`, `negative_prompt`, `cfg_scale`, `sampler`, `scheduler`, `clip_skip` are native fields, passed in
  sd-server's `<sd_cpp_extra_args>` block (its OpenAI route reads only prompt, n, size and output format);
- `async` (a job to poll) or `stream` (SSE), not both;
- `response_format` b64_json only (Blazar hosts no image files: `url` teaches); `output_format` png, jpeg,
  webp and `output_compression` pass through.
Fields OpenAI defines that a local diffusion model cannot honour are refused with the reason, never ignored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from dialects.wire import RequestError

MAX_IMAGES = 8  # sd-server's batch limit
MAX_SIDE = 2048
QUALITY_SCALE = {"low": 0.5, "medium": 1.0, "standard": 1.0, "auto": 1.0, "high": 1.5, "hd": 1.5, "xhigh": 2.0,
                 "max": 2.5}
OUTPUT_FORMATS = ("png", "jpeg", "webp")
MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# OpenAI fields this lane cannot honour, with the reason and what to do instead.
REFUSED = {
    "moderation": "Blazar runs no image moderation model, so no moderation level can be honoured; drop it",
    "partial_images": "sd-server renders the whole image at once and sends no partial images; drop it",
    "background": "diffusion models here render opaque images only (no transparent background); drop it",
    "input_fidelity": "input_fidelity belongs to image edits of OpenAI's own models; drop it",
}
KNOWN = {"model", "prompt", "n", "size", "quality", "steps", "seed", "negative_prompt", "cfg_scale", "sampler",
         "scheduler", "clip_skip", "response_format", "output_format", "output_compression", "style", "user",
         "async", "stream", *REFUSED}
SIZE = re.compile(r"^(\d{2,4})x(\d{2,4})$")


class ImageRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt: str
    n: int
    width: int | None  # None: the model's default (auto)
    height: int | None
    steps: int | None  # set outright by `steps`
    quality: str | None  # scales the model's default steps (needs the child's live default)
    output_format: str
    output_compression: int | None
    native: dict[str, Any]  # seed, negative_prompt, cfg … as sd-server's extra args (without sample_steps)


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"`{name}` must be a whole number from {low} to {high}, got {value!r}", param=name)
    return value


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"`{name}` must be a string, got {type(value).__name__}", param=name)
    return value


def check_generation(body: dict[str, Any], *, installed: list[str]) -> ImageRequest:
    """Raises RequestError (a teaching 400 naming the field) for what cannot be served as sent."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                           f"/v1/images/generations; accepted: {', '.join(sorted(KNOWN - set(REFUSED)))}",
                           param=unknown[0])
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise RequestError(f"`{name}` cannot be honoured: {why}", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        menu = ", ".join(installed) or "none installed (./scripts/fixtures installs sd-noise)"
        raise RequestError(f"`model` must name a diffusion model; installed: {menu}", param="model")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("`prompt` must be a non-empty string", param="prompt")
    if "<sd_cpp_extra_args>" in prompt:
        raise RequestError("`prompt` may not carry sd-server's <sd_cpp_extra_args> block; send seed, steps, "
                           "negative_prompt, cfg_scale, sampler, scheduler and clip_skip as fields", param="prompt")
    n = _int(body, "n", 1, MAX_IMAGES) or 1
    width = height = None
    size = body.get("size")
    if size is not None and size != "auto":
        match = SIZE.match(size) if isinstance(size, str) else None
        if match is None:
            raise RequestError(f"`size` must be \"WIDTHxHEIGHT\" (e.g. \"512x512\") or \"auto\", got {size!r}",
                               param="size")
        width, height = int(match.group(1)), int(match.group(2))
        for side in (width, height):
            if not 64 <= side <= MAX_SIDE or side % 64:
                raise RequestError(f"`size` {size} cannot be rendered as asked: diffusion models here render sides "
                                   f"that are multiples of 64 from 64 to {MAX_SIDE} (e.g. 512x512, 768x512)",
                                   param="size")
    steps = _int(body, "steps", 1, 100)
    quality = _text(body, "quality")
    if quality is not None and quality not in QUALITY_SCALE:
        raise RequestError(f"`quality` must be one of {', '.join(QUALITY_SCALE)}, got {quality!r}", param="quality")
    if steps is not None and quality is not None:
        raise RequestError("`steps` and `quality` are two dials for one knob (the number of sampling steps); "
                           "send one of them", param="quality")
    style = _text(body, "style")
    if style is not None:
        raise RequestError(f"`style` {style!r} is a preset of curated model families, and no installed diffusion "
                           "model here is one; set `cfg_scale` (the guidance scale, e.g. 7) instead", param="style")
    response_format = _text(body, "response_format") or "b64_json"
    if response_format != "b64_json":
        raise RequestError(f"`response_format` {response_format!r} is not served: Blazar hosts no image files, so "
                           "images come back inline; use \"b64_json\"", param="response_format")
    output_format = _text(body, "output_format") or "png"
    if output_format not in OUTPUT_FORMATS:
        raise RequestError(f"`output_format` must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}",
                           param="output_format")
    compression = _int(body, "output_compression", 0, 100)
    if compression is not None and output_format == "png":
        raise RequestError("`output_compression` applies to jpeg and webp only; drop it or set output_format",
                           param="output_compression")
    native: dict[str, Any] = {}
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed < 2**63:
            raise RequestError(f"`seed` must be a whole number (-1 or absent: random), got {seed!r}", param="seed")
        native["seed"] = seed
    negative = _text(body, "negative_prompt")
    if negative:
        native["negative_prompt"] = negative
    cfg = body.get("cfg_scale")
    if cfg is not None:
        if isinstance(cfg, bool) or not isinstance(cfg, int | float) or not math.isfinite(cfg) or not 0 <= cfg <= 30:
            raise RequestError(f"`cfg_scale` must be a number from 0 to 30, got {cfg!r}", param="cfg_scale")
        native.setdefault("sample_params", {})["guidance"] = {"txt_cfg": float(cfg)}
    for name, native_name in (("sampler", "sample_method"), ("scheduler", "scheduler")):
        value = _text(body, name)
        if value is not None:
            native.setdefault("sample_params", {})[native_name] = value
    clip_skip = _int(body, "clip_skip", 1, 12)
    if clip_skip is not None:
        native["clip_skip"] = clip_skip
    return ImageRequest(model=model, prompt=prompt, n=n, width=width, height=height, steps=steps, quality=quality,
                        output_format=output_format, output_compression=compression, native=native)


def check_modes(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`async`, `stream`): each true or false; not both (a job is polled, a stream is read)."""
    modes = []
    for name in ("async", "stream"):
        value = body.get(name, False)
        if not isinstance(value, bool):
            raise RequestError(f"`{name}` must be true or false, got {value!r}", param=name)
        modes.append(value)
    if modes[0] and modes[1]:
        raise RequestError("`async` and `stream` are two ways to wait for one image: poll a job (async) or read "
                           "the answer as it comes (stream); send one", param="stream")
    return modes[0], modes[1]


def scaled_steps(quality: str, default_steps: int) -> int:
    """`quality` as a step count: the model's own default scaled, within sd-server's 1..100."""
    return max(1, min(100, round(default_steps * QUALITY_SCALE[quality])))


def engine_body(request: ImageRequest, steps: int | None) -> bytes:
    """The JSON body for sd-server's POST /v1/images/generations."""
    native = {**request.native}
    if steps is not None:
        native["sample_params"] = {**native.get("sample_params", {}), "sample_steps": steps}
    prompt = request.prompt
    if native:
        prompt += f"<sd_cpp_extra_args>{json.dumps(native)}</sd_cpp_extra_args>"
    body: dict[str, Any] = {"prompt": prompt, "n": request.n, "output_format": request.output_format}
    if request.width is not None and request.height is not None:
        body["size"] = f"{request.width}x{request.height}"
    if request.output_compression is not None:
        body["output_compression"] = request.output_compression
    return msgspec.json.encode(body)
