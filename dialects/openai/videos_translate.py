"""OpenAI's video (Sora) request, checked and translated for sd-server's `/sdcpp/v1/vid_gen` (pure: no I/O).

- `seconds` ("4", "8", "12" or a whole number) becomes frames at the model's effective fps (its live default
  when no `fps` is sent), normalised to Wan's 4n+1 cadence; `video_frames` sets them outright, and both
  together are a 400 (two dials for one knob). The finished job's `frame_count` is the truth.
- `size` "WxH": sides multiples of 16 from 16 to 1280 (Wan's latent grid).
- `input_reference` (image to video) and `remixed_from_video_id` are refused: the installed families render
  text to video only. `vram_overcommit` is refused on a gateway that places video on CPU (nothing to overcommit).
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from dialects.wire import RequestError

OUTPUT_FORMATS = {"webm": "video/webm", "webp": "image/webp", "avi": "video/x-msvideo"}
KNOWN = {"model", "prompt", "seconds", "size", "fps", "video_frames", "steps", "seed", "negative_prompt",
         "cfg_scale", "output_format", "input_reference", "remixed_from_video_id", "vram_overcommit", "user"}
SIZE = re.compile(r"^(\d{2,4})x(\d{2,4})$")
MAX_FRAMES = 129


class VideoRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt: str
    seconds: int | None  # frames follow from the effective fps
    video_frames: int | None
    fps: int | None
    width: int
    height: int
    steps: int | None
    seed: int | None
    negative_prompt: str | None
    cfg_scale: float | None
    output_format: str


def _whole(value: Any, name: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"`{name}` must be a whole number from {low} to {high}, got {value!r}", param=name)
    return value


def check_video(body: dict[str, Any], *, installed: list[str]) -> VideoRequest:
    """A JSON body, or a multipart form's fields as strings. Raises RequestError naming the field."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for /v1/videos; "
                           f"accepted: {', '.join(sorted(KNOWN))}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or model not in installed:
        menu = ", ".join(installed) or "none installed (./scripts/fixtures --video installs vid-noise)"
        raise RequestError(f"`model` must name an installed video model, got {model!r}; installed: {menu}",
                           param="model")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("`prompt` must be a non-empty string", param="prompt")
    if body.get("input_reference") is not None:
        raise RequestError("`input_reference` (image to video) cannot be honoured: the installed video families "
                           "render from text only; drop it", param="input_reference")
    if body.get("remixed_from_video_id") is not None:
        raise RequestError("`remixed_from_video_id` cannot be honoured: there is no local video-to-video; send a "
                           "new prompt instead", param="remixed_from_video_id")
    if body.get("vram_overcommit") is not None:
        raise RequestError("`vram_overcommit` has nothing to act on: this gateway renders video on CPU, with no "
                           "VRAM budget to overcommit; drop it", param="vram_overcommit")
    seconds = _whole(body.get("seconds"), "seconds", 1, 20)
    frames = _whole(body.get("video_frames"), "video_frames", 1, MAX_FRAMES)
    if seconds is not None and frames is not None:
        raise RequestError("`seconds` and `video_frames` are two dials for one knob (the clip's length); send one",
                           param="video_frames")
    if frames is not None and (frames - 1) % 4:
        raise RequestError(f"`video_frames` must be 4n+1 (1, 5, 9, …: the model's frame cadence), got {frames}",
                           param="video_frames")
    fps = _whole(body.get("fps"), "fps", 1, 60)
    width = height = 0
    size = body.get("size") or "480x272"
    match = SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise RequestError(f"`size` must be \"WIDTHxHEIGHT\" (e.g. \"480x272\"), got {size!r}", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    if any(side % 16 or not 16 <= side <= 1280 for side in (width, height)):
        raise RequestError(f"`size` {size} cannot be rendered as asked: video models here render sides that are "
                           "multiples of 16 from 16 to 1280", param="size")
    steps = _whole(body.get("steps"), "steps", 1, 100)
    seed = body.get("seed")
    if seed is not None:
        seed = _whole(seed, "seed", 0, 2**62)
    negative = body.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise RequestError("`negative_prompt` must be a string", param="negative_prompt")
    cfg = body.get("cfg_scale")
    if cfg is not None:
        try:
            cfg = None if isinstance(cfg, bool) else float(cfg)
        except (TypeError, ValueError):
            cfg = None
        if cfg is None or not math.isfinite(cfg) or not 0 <= cfg <= 30:
            raise RequestError(f"`cfg_scale` must be a number from 0 to 30, got {body.get('cfg_scale')!r}",
                               param="cfg_scale")
    output_format = body.get("output_format") or "webm"
    if output_format not in OUTPUT_FORMATS:
        raise RequestError(f"`output_format` must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}",
                           param="output_format")
    return VideoRequest(model=model, prompt=prompt, seconds=seconds, video_frames=frames, fps=fps, width=width,
                        height=height, steps=steps, seed=seed, negative_prompt=negative, cfg_scale=cfg,
                        output_format=output_format)


def frames_for(seconds: int, fps: int) -> int:
    """`seconds` at `fps` as the nearest 4n+1 frame count (Wan's cadence), at least 1."""
    return max(1, 4 * round((seconds * fps - 1) / 4) + 1)


def engine_body(video: VideoRequest, *, default_fps: int) -> bytes:
    """The JSON body of sd-server's POST /sdcpp/v1/vid_gen."""
    fps = video.fps or default_fps
    frames = video.video_frames if video.video_frames is not None else frames_for(video.seconds or 4, fps)
    body: dict[str, Any] = {"prompt": video.prompt, "width": video.width, "height": video.height,
                            "video_frames": frames, "fps": fps, "output_format": video.output_format}
    sample: dict[str, Any] = {}
    if video.steps is not None:
        sample["sample_steps"] = video.steps
    if video.cfg_scale is not None:
        sample["guidance"] = {"txt_cfg": video.cfg_scale}
    if sample:
        body["sample_params"] = sample
    if video.seed is not None:
        body["seed"] = video.seed
    if video.negative_prompt:
        body["negative_prompt"] = video.negative_prompt
    return msgspec.json.encode(body)
