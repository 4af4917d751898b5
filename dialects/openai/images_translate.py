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

import base64
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


def check_generation(body: dict[str, Any], *, installed: list[str], prompt_optional: bool = False) -> ImageRequest:
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
        raise RequestError(f"`model` must name an image model; installed: {menu}", param="model")
    prompt = body.get("prompt")
    if prompt_optional and (prompt is None or prompt == ""):
        prompt = " "  # neutral conditioning (sd-server refuses an empty prompt)
    if not isinstance(prompt, str) or not (prompt.strip() or prompt_optional):
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


# ----- edits and variations (multipart): one input image as sd-server's init image

INPUT_FORMATS = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpeg", b"RIFF": "webp"}
MAX_INPUT_BYTES = 20 * 1024 * 1024
EDIT_FIELDS = {"model", "prompt", "n", "size", "steps", "quality", "seed", "negative_prompt", "cfg_scale", "sampler",
               "scheduler", "clip_skip", "strength", "response_format", "output_format", "output_compression", "user",
               "stream", "async", *REFUSED}
VARIATION_FIELDS = EDIT_FIELDS - {"quality"}
NUMBERS = {"n": int, "steps": int, "seed": int, "clip_skip": int, "output_compression": int, "cfg_scale": float,
           "strength": float}


def image_size(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) of a PNG, JPEG or WebP from its header; RequestError for anything else."""
    kind = next((name for magic, name in INPUT_FORMATS.items() if data.startswith(magic)), None)
    try:
        if kind == "png" and data[12:16] == b"IHDR":
            width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
            return kind, width, height
        if kind == "jpeg":
            at = 2
            while at + 9 < len(data):
                if data[at] != 0xFF:
                    break
                marker, length = data[at + 1], int.from_bytes(data[at + 2:at + 4], "big")
                if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
                    return kind, int.from_bytes(data[at + 7:at + 9], "big"), int.from_bytes(data[at + 5:at + 7], "big")
                at += 2 + length
        if kind == "webp" and data[8:12] == b"WEBP":
            chunk = data[12:16]
            if chunk == b"VP8X":
                return kind, 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
            if chunk == b"VP8 ":
                width, height = int.from_bytes(data[26:28], "little"), int.from_bytes(data[28:30], "little")
                return kind, width & 0x3FFF, height & 0x3FFF
            if chunk == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return kind, (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    except IndexError:
        pass
    raise RequestError("`image` must be a PNG, JPEG or WebP file (its header was not one)", param="image")


def _coerced(fields: dict[str, list[str]], allowed: set[str], route: str) -> dict[str, Any]:
    """A multipart form's text fields as the JSON body generations checks: one value each, numbers parsed."""
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for {route}; "
                           f"accepted: image, {', '.join(sorted(allowed - set(REFUSED)))}", param=unknown[0])
    body: dict[str, Any] = {}
    for name, values in fields.items():
        if len(values) != 1:
            raise RequestError(f"`{name}` was sent {len(values)} times; send it once", param=name)
        value = values[0]
        if name in NUMBERS:
            try:
                body[name] = NUMBERS[name](value)
            except ValueError:
                kind = "a whole number" if NUMBERS[name] is int else "a number"
                raise RequestError(f"`{name}` must be {kind}, got {value!r}", param=name) from None
        elif name == "stream":
            if value not in ("true", "false"):
                raise RequestError(f"`stream` must be true or false, got {value!r}", param="stream")
            body[name] = value == "true"
        else:
            body[name] = value  # a prompt of digits stays a string
    return body


def check_edit(fields: dict[str, list[str]], files: dict[str, list[bytes]], *, installed: list[str],
               variation: bool) -> tuple[ImageRequest, bool]:
    """An edit (prompt + image + optional mask) or a variation (image, prompt optional) as an ImageRequest with
    sd-server's init image (and mask); returns it with the stream flag. The output has the input's size unless
    `size` says otherwise (sd-server scales the init image to the size it renders)."""
    route = "/v1/images/variations" if variation else "/v1/images/edits"
    images = files.get("image", []) + files.get("image[]", [])
    masks = files.get("mask", [])
    others = sorted(set(files) - {"image", "image[]", "mask"})
    if others:
        raise RequestError(f"file part{'s' if len(others) > 1 else ''} {', '.join(others)} cannot be used by {route}; "
                           "send the picture as `image`", param=others[0])
    if variation and (masks or "mask" in fields):
        raise RequestError("a variation takes no `mask`: to repaint a region, send the image, the mask and a prompt "
                           "to /v1/images/edits", param="mask")
    if len(images) != 1:
        raise RequestError(f"{route} takes exactly one `image` file here (the model family installed uses one input "
                           f"image), got {len(images)}", param="image")
    if len(masks) > 1:
        raise RequestError("send one `mask` file", param="mask")
    allowed = VARIATION_FIELDS if variation else EDIT_FIELDS
    body = _coerced(fields, allowed, route)
    stream = bool(body.pop("stream", False))
    if body.pop("async", None) is not None:
        raise RequestError(f"`async` is not built for {route} yet (its upload would have to be kept for the job); "
                           "send it without async (it is answered when done) or with stream=true", param="async")
    data = images[0]
    if len(data) > MAX_INPUT_BYTES:
        raise RequestError(f"`image` is {len(data):,} bytes; at most {MAX_INPUT_BYTES:,}", param="image")
    _, width, height = image_size(data)
    strength = body.pop("strength", None)
    if strength is not None and not 0 < strength <= 1:
        raise RequestError(f"`strength` must be above 0 and at most 1 (how much of the image is redrawn), got "
                           f"{strength!r}", param="strength")
    if "size" not in body:
        if width % 64 or height % 64 or not 64 <= width <= MAX_SIDE or not 64 <= height <= MAX_SIDE:
            near = f"{max(64, min(MAX_SIDE, width // 64 * 64))}x{max(64, min(MAX_SIDE, height // 64 * 64))}"
            raise RequestError(f"the image is {width}x{height}, and diffusion models here render sides that are "
                               f"multiples of 64 from 64 to {MAX_SIDE}: send `size` (e.g. \"{near}\") and the image is "
                               "scaled to it", param="size")
        body["size"] = f"{width}x{height}"
    request = check_generation(body, installed=installed, prompt_optional=variation)
    native = {**request.native, "init_image": base64.b64encode(data).decode()}
    if strength is not None:
        native["strength"] = strength
    if masks:
        image_size(masks[0])  # a picture too
        native["mask_image"] = base64.b64encode(masks[0]).decode()
    return msgspec.structs.replace(request, native=native), stream
