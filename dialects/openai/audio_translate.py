"""Pure pieces of the audio routes: the transcription form's checks (a whitelist of knobs, each mapped to
the whisper child's options or refused with a teaching 400), the response formats (json, text, srt, vtt,
verbose_json, diarized_json), and the speech request's checks. No Quart, no actors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dialects.wire import RequestError

FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
GRANULARITIES = ("word", "segment")
CLOUD_ONLY = ("include", "keywords", "chunking_strategy", "known_speaker_names", "known_speaker_references")
BOOL_FIELDS = ("stream", "async", "diarize", "no_language_probabilities", "token_timestamps", "vad", "vad_filter",
               "suppress_non_speech", "suppress_nst")
VAD_FIELDS = {
    "vad_threshold": ("threshold", float, 0.0, 1.0),
    "vad_min_speech_duration_ms": ("min_speech_duration_ms", int, 0, 60_000),
    "vad_min_silence_duration_ms": ("min_silence_duration_ms", int, 0, 60_000),
    "vad_max_speech_duration_s": ("max_speech_duration_s", float, 1.0, 3600.0),
    "vad_speech_pad_ms": ("speech_pad_ms", int, 0, 10_000),
}
ACCEPTED = ("file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
            "timestamp_granularities", "beam_size", "best_of", *BOOL_FIELDS, *VAD_FIELDS)
LANGUAGES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian", "pt": "portuguese",
             "nl": "dutch", "ru": "russian", "zh": "chinese", "ja": "japanese", "ko": "korean", "ar": "arabic",
             "hi": "hindi", "pl": "polish", "tr": "turkish", "uk": "ukrainian", "sv": "swedish"}


@dataclass
class TranscriptionRequest:
    model: str  # as asked ("whisper-1" and "" mean the pinned model)
    task: str  # transcribe | translate
    response_format: str
    words: bool  # word granularity asked for
    stream: bool
    run_async: bool
    diarize: bool
    language_probabilities: bool
    options: dict[str, Any] = field(default_factory=dict)  # for the whisper child


def _bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off", ""):
        return False
    raise RequestError(f"`{name}` must be true or false, got {value!r}", param=name)


def _number(name: str, value: str, kind: type, low: float, high: float) -> Any:
    try:
        number = kind(value)
    except ValueError:
        raise RequestError(f"`{name}` must be a {'whole ' if kind is int else ''}number from {low:g} to {high:g}, "
                           f"got {value!r}", param=name) from None
    if not low <= number <= high:
        raise RequestError(f"`{name}` must be from {low:g} to {high:g}, got {number:g}", param=name)
    return number


def check_transcription(form: dict[str, list[str]], task: str) -> TranscriptionRequest:
    """The multipart form of /v1/audio/transcriptions or /translations, checked and mapped."""
    for name in form:
        if name in CLOUD_ONLY:
            raise RequestError(f"`{name}` is a hosted-service field; a local whisper has none of it. Local knobs: "
                               f"{', '.join(a for a in ACCEPTED if a != 'file')}", param=name)
        if name not in ACCEPTED:
            raise RequestError(f"unknown field `{name}`; accepted: {', '.join(ACCEPTED)}", param=name)
    one = {name: values[-1] for name, values in form.items() if values}
    flags = {name: _bool(name, one[name]) for name in BOOL_FIELDS if name in one}
    granularities: list[str] = []
    for raw in [*form.get("timestamp_granularities[]", []), *form.get("timestamp_granularities", [])]:
        granularities += [g.strip() for g in raw.split(",") if g.strip()]
    for value in granularities:
        if value not in GRANULARITIES:
            raise RequestError(f"`timestamp_granularities[]` takes word and/or segment, got {value!r}",
                               param="timestamp_granularities[]")
    response_format = one.get("response_format", "")
    if granularities:
        if response_format not in ("", "verbose_json"):
            raise RequestError(f"`timestamp_granularities[]` needs response_format verbose_json (the timings live "
                               f"there), but response_format is {response_format!r}; drop one of the two",
                               param="timestamp_granularities[]")
        response_format = "verbose_json"
    response_format = response_format or "json"
    if response_format not in FORMATS:
        raise RequestError(f"`response_format` must be one of {', '.join(FORMATS)}, got {response_format!r}",
                           param="response_format")
    stream, run_async = flags.get("stream", False), flags.get("async", False)
    if stream and run_async:
        raise RequestError("`stream` and `async` cannot both be true: stream the transcript now, or get a job "
                           "handle to poll (GET /v1/audio/jobs/{id})", param="stream")
    diarize = flags.get("diarize", False) or response_format == "diarized_json"
    if stream and diarize:
        raise RequestError("diarized_json is not available on the stream lane: send stream=false", param="stream")
    options: dict[str, Any] = {"task": task}
    if one.get("language"):
        options["language"] = one["language"].strip().lower()
    if one.get("prompt"):
        options["initial_prompt"] = one["prompt"]
    if "temperature" in one:
        options["temperature"] = _number("temperature", one["temperature"], float, 0.0, 1.0)
    for name in ("beam_size", "best_of"):
        if name in one:
            options[name] = _number(name, one[name], int, 1, 16)
    words = "word" in granularities or flags.get("token_timestamps", False)
    if words:
        options["word_timestamps"] = True
    vad = {target: _number(name, one[name], kind, low, high)
           for name, (target, kind, low, high) in VAD_FIELDS.items() if name in one}
    if flags.get("vad") or flags.get("vad_filter") or vad:
        options["vad_filter"] = True
        if vad:
            options["vad"] = vad
    for name in ("suppress_non_speech", "suppress_nst"):
        if name in flags:
            options["suppress_tokens"] = [-1] if flags[name] else []
    return TranscriptionRequest(model=one.get("model", ""), task=task, response_format=response_format, words=words,
                                stream=stream, run_async=run_async, diarize=diarize,
                                language_probabilities=not flags.get("no_language_probabilities", False),
                                options=options)


def text_of(result: dict[str, Any]) -> str:
    return "".join(s["text"] for s in result["segments"]).strip()


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt(result: dict[str, Any]) -> str:
    return "".join(f"{index}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n\n"
                   for index, s in enumerate(result["segments"], start=1))


def vtt(result: dict[str, Any]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                  for s in result["segments"])


def usage(result: dict[str, Any]) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(result["duration"])}


def verbose(result: dict[str, Any], request: TranscriptionRequest) -> dict[str, Any]:
    segments = []
    for segment in result["segments"]:
        kept = {k: v for k, v in segment.items() if k != "words"}
        if request.words:
            kept["words"] = segment["words"]
        segments.append(kept)
    payload: dict[str, Any] = {"task": request.task, "language": LANGUAGES.get(result["language"], result["language"]),
                               "duration": result["duration"], "text": text_of(result), "segments": segments,
                               "usage": usage(result)}
    if request.words:
        payload["words"] = [w for s in result["segments"] for w in s["words"]]
    if request.language_probabilities:
        payload["language_probabilities"] = {result["language"]: result["language_probability"]}
    return payload


def diarized(result: dict[str, Any]) -> dict[str, Any]:
    """One voice per channel of a stereo file, merged in time order."""
    rows = []
    for speaker, channel in enumerate(result["channels"]):
        for segment in channel["segments"]:
            text = segment["text"].strip()
            if text.startswith(f"(speaker {speaker})"):
                text = text.removeprefix(f"(speaker {speaker})").strip()
            if text:
                rows.append({"start": segment["start"], "end": segment["end"], "text": text,
                             "speaker": f"speaker_{speaker}"})
    rows.sort(key=lambda r: (r["start"], r["speaker"]))
    for index, row in enumerate(rows):
        row["id"] = index
    return {"duration": result["duration"], "text": " ".join(r["text"] for r in rows), "segments": rows}


SPEECH_FORMATS = ("wav", "pcm", "pcm16", "mp3", "opus", "aac", "flac")
LOSSY = ("mp3", "opus", "aac", "flac")
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "speaker", "noise_scale", "noise_w",
                 "sentence_silence", "stream", "stream_format", "instructions")


def check_speech(body: dict[str, Any]) -> dict[str, Any]:
    """The speech request as the piper child's options, plus the format and whether to stream."""
    for name in body:
        if name not in SPEECH_FIELDS:
            raise RequestError(f"unknown field `{name}`; accepted: {', '.join(SPEECH_FIELDS)}", param=name)
    if body.get("instructions"):
        raise RequestError("`instructions` cannot steer a piper voice: each voice is a fixed personality; pick a "
                           "different voice (GET /v1/audio/voices lists them)", param="instructions")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise RequestError("`input` is required: the text to speak", param="input")
    if len(text) > 20_000:
        raise RequestError(f"`input` is {len(text)} characters; send at most 20000 per request", param="input")
    fmt = body.get("response_format") or "wav"
    if fmt not in SPEECH_FORMATS:
        raise RequestError(f"`response_format` must be one of {', '.join(SPEECH_FORMATS)}, got {fmt!r}",
                           param="response_format")
    stream = body.get("stream") is True or body.get("stream_format") == "audio"
    if stream and fmt == "wav":
        raise RequestError("a WAV cannot be streamed (its header needs the total length up front): use "
                           "response_format pcm for streamed audio, or drop stream", param="stream")
    options: dict[str, Any] = {"text": text}
    for name, low, high in (("speed", 0.25, 4.0), ("noise_scale", 0.0, 2.0), ("noise_w", 0.0, 2.0),
                            ("sentence_silence", 0.0, 10.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise RequestError(f"`{name}` must be a number from {low:g} to {high:g}, got {value!r}", param=name)
        if name == "speed":
            options["length_scale"] = 1.0 / value
        elif name == "noise_w":
            options["noise_w_scale"] = value
        else:
            options[name] = value
    speaker = body.get("speaker")
    if speaker is not None:
        if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
            raise RequestError(f"`speaker` must be a speaker index ≥ 0 of a multi-speaker voice, got {speaker!r}",
                               param="speaker")
        options["speaker_id"] = speaker
    return {"options": options, "format": "pcm" if fmt == "pcm16" else fmt, "stream": stream}
