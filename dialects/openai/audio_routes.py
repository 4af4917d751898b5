"""OpenAI audio routes on the whisper and piper lanes: transcriptions and translations (buffered, streamed
as SSE window by window, or async as a job), speech (WAV, streamed PCM, lossy formats through the system
ffmpeg in supervisors.transcode), the voice menu and the capabilities card. Mailboxes: decode, check, one
call into a lane."""

from __future__ import annotations

import io
import json
import logging
import secrets
import shutil
import urllib.parse
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, request

from blazar import audio_models
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, owner, refuse, viewer
from dialects.roles import Role, role
from dialects.wire import RequestError
from supervisors import transcode
from supervisors.caller import Caller
from supervisors.instance import StreamFailure, UpstreamCall, UpstreamReply, UpstreamStream
from supervisors.jobs import JobContext, JobFailed
from supervisors.refusal import Refusal
from supervisors.relay import acting_for, admit_work, buffered, engine_failure, forward, remote_of, residents
from supervisors.services import Services

from . import audio_translate as t

blueprint = Blueprint("audio", __name__)
log = logging.getLogger("blazar.audio")

KEEPALIVE_SECS = 15.0
SEARCH_SECS = 20.0
MIME = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac",
        "flac": "audio/flac"}


# ------------------------------------------------------------------ speech to text


def whisper_model(services: Services, asked: str) -> str:
    """The whisper model a request names; `whisper-1` (the OpenAI SDK's name) and none mean the pinned one."""
    if asked in ("", "whisper-1"):
        return services.config.whisper_model or audio_models.DEFAULT_WHISPER
    return audio_models.whisper_name(asked)


async def _transcribe_once(services: Services, model: str, audio: bytes, options: dict[str, Any],
                           who: Caller) -> dict[str, Any]:
    path = "/transcribe?options=" + urllib.parse.quote(json.dumps(options))
    reply = await forward(services, f"whisper:{model}", UpstreamCall(
        method="POST", path=path, body=audio, stream=False, content_type="application/octet-stream"), who,
        lane_kind="whisper")
    assert isinstance(reply, UpstreamReply)
    if reply.status >= 400:
        status = 400 if reply.status < 500 else 502
        raise Refusal(status, f"whisper could not transcribe this file: {reply.engine_message}",
                      fix="send audio in a format ffmpeg/PyAV reads (wav, mp3, flac, ogg, m4a)")
    return msgspec.json.decode(reply.body)


def render(result: dict[str, Any], transcription: t.TranscriptionRequest) -> Response:
    fmt = transcription.response_format
    if fmt == "diarized_json":
        payload = t.diarized(result)
        if not payload["segments"]:
            raise Refusal(502, "whisper heard no speech on either channel, so there is nothing to diarize",
                          fix="check the recording, or ask for response_format json")
        return json_response(payload)
    headers = {"x-blazar-word-timestamps": "derived" if transcription.words else "unavailable"}
    if fmt == "text":
        return Response(t.text_of(result) + "\n", content_type="text/plain; charset=utf-8", headers=headers)
    if fmt == "srt":
        return Response(t.srt(result), content_type="application/x-subrip; charset=utf-8", headers=headers)
    if fmt == "vtt":
        return Response(t.vtt(result), content_type="text/vtt; charset=utf-8", headers=headers)
    if fmt == "verbose_json":
        return json_response(t.verbose(result, transcription), headers=headers)
    return json_response({"text": t.text_of(result), "usage": t.usage(result)}, headers=headers)


async def _form() -> tuple[dict[str, list[str]], bytes, str]:
    form = await request.form
    files = await request.files
    upload = files.get("file")
    if upload is None:
        raise RequestError("`file` is required: send multipart/form-data with the audio in a `file` part",
                           param="file")
    fields = {name: form.getlist(name) for name in form}
    fields.pop("file", None)
    return fields, upload.read(), upload.filename or "audio"


async def _speech_to_text(task: str):
    services = current_services()
    try:
        fields, audio, filename = await _form()
        transcription = t.check_transcription(fields, task)
        if transcription.model and remote_of(services, transcription.model) is not None:
            return await _remote_speech_to_text(services, task, transcription, fields, audio, filename)
        model = whisper_model(services, transcription.model)
        entry = audio_models.CATALOG.get(model)
        if task == "translate" and entry is not None and entry.language == "en":
            raise Refusal(400, f"whisper:{model} is English-only, so it cannot translate",
                          fix="use a multilingual model: blazar whisper --pull --model base, then model=base")
        options = dict(transcription.options)
        if transcription.diarize:
            options["split_stereo"] = True
        if transcription.run_async:
            return await _submit_async(services, model, audio, filename, transcription, options)
        if transcription.stream:
            return await _streamed(services, model, audio, options, transcription)
        return render(await _transcribe_once(services, model, audio, options, caller()), transcription)
    except (RequestError, Refusal) as error:
        return refuse(error)


@blueprint.post("/v1/audio/transcriptions")
@blueprint.post("/audio/transcriptions")
@role(Role.KEY)
async def transcriptions():
    return await _speech_to_text("transcribe")


@blueprint.post("/v1/audio/translations")
@blueprint.post("/audio/translations")
@role(Role.KEY)
async def translations():
    return await _speech_to_text("translate")


# ----- streamed (SSE, window by window)


def windows(audio: bytes, window_ms: int) -> list[tuple[int, bytes]]:
    """A WAV split at PCM frame boundaries into windows of `window_ms` (offset ms, WAV bytes); anything else
    is one window (no progressive split is possible without decoding it here)."""
    try:
        with wave.open(io.BytesIO(audio)) as source:
            params = source.getparams()
            frames_per_window = max(1, int(params.framerate * window_ms / 1000))
            pieces = []
            offset = 0
            while True:
                frames = source.readframes(frames_per_window)
                if not frames:
                    break
                out = io.BytesIO()
                with wave.open(out, "wb") as piece:
                    piece.setparams(params)
                    piece.writeframes(frames)
                pieces.append((offset, out.getvalue()))
                offset += window_ms
            return pieces or [(0, audio)]
    except (wave.Error, EOFError):
        return [(0, audio)]


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + msgspec.json.encode(payload) + b"\n\n"


async def _streamed(services: Services, model: str, audio: bytes, options: dict[str, Any],
              transcription: t.TranscriptionRequest) -> Response:
    """Window by window: a task under the session supervisor transcribes each window in order and hands the
    results over a bounded channel; the response relays them, with a keep-alive comment every 15 s while a
    window decodes. A client that hangs up closes the channel, and decoding stops at the next window."""
    pieces = windows(audio, services.config.whisper_stream_chunk_ms)
    options = {**options, "word_timestamps": False}
    who = caller()
    send, receive = trio.open_memory_channel[tuple[int, dict[str, Any]] | Refusal](1)

    async def decode() -> None:
        async with send:
            for offset_ms, piece in pieces:
                try:
                    result: tuple[int, dict[str, Any]] | Refusal = (
                        offset_ms, await _transcribe_once(services, model, piece, options, who))
                except Refusal as refusal:
                    result = refusal
                except Exception as error:  # the client gets a teaching error frame, not a cut stream
                    log.exception("streamed transcription failed")
                    result = Refusal(502, f"transcription failed: {type(error).__name__}: {error}")
                try:
                    await send.send(result)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the client left: no further window is decoded
                if isinstance(result, Refusal):
                    return

    await required(services.sessions).run_task("transcription", who.key, decode,
                                               lambda: {"model": f"whisper:{model}", "windows": len(pieces)})

    async def events() -> AsyncIterator[bytes]:
        segments: list[dict[str, Any]] = []
        texts: list[str] = []
        language = ""
        with receive:
            for index in range(len(pieces)):
                item = None
                while item is None:
                    with trio.move_on_after(KEEPALIVE_SECS):
                        item = await receive.receive()
                    if item is None:
                        yield b": keep-alive\n\n"
                if isinstance(item, Refusal):
                    yield _sse("error", {"type": "error", "message": item.message, "fix": item.fix})
                    return
                offset_ms, result = item
                language = result["language"]
                rebased = [{k: v for k, v in s.items() if k != "words"} | {
                    "start": round(s["start"] + offset_ms / 1000, 3), "end": round(s["end"] + offset_ms / 1000, 3)}
                    for s in result["segments"]]
                text = t.text_of(result)
                segments += rebased
                texts.append(text)
                yield _sse("chunk.completed", {"type": "chunk.completed", "index": index, "offset_ms": offset_ms,
                                               "text": text, "segments": rebased})
        yield _sse("transcript.completed", {"type": "transcript.completed", "duration_ms": duration_ms(audio, segments),
                                            "language": language, "text": " ".join(x for x in texts if x),
                                            "segments": segments, "chunks": len(pieces)})

    response = Response(events(), content_type="text/event-stream", headers={"cache-control": "no-cache"})
    response.timeout = None
    return response


def duration_ms(audio: bytes, segments: list[dict[str, Any]]) -> int:
    try:
        with wave.open(io.BytesIO(audio)) as source:
            return round(source.getnframes() * 1000 / source.getframerate())
    except (wave.Error, EOFError):
        return round(segments[-1]["end"] * 1000) if segments else 0


# ----- async (a job of kind audio)


async def _submit_async(services: Services, model: str, audio: bytes, filename: str,
                        transcription: t.TranscriptionRequest, options: dict[str, Any]) -> Response:
    await admit_work(services, caller(), f"whisper:{model}")
    uploads = services.paths.home / "jobs" / "inputs"
    job_id = f"audiojob_{secrets.token_hex(12)}"
    path = uploads / job_id

    def store() -> None:
        uploads.mkdir(parents=True, exist_ok=True)
        path.write_bytes(audio)

    await trio.to_thread.run_sync(store)
    await required(services.jobs).create("audio", model=f"whisper:{model}", key=owner(), job_id=job_id, request={
        "input": str(path), "filename": filename, "options": options, "task": transcription.task,
        "format": transcription.response_format, "words": transcription.words,
        "language_probabilities": transcription.language_probabilities})
    return json_response({"id": job_id, "object": "audio.job", "status": "queued",
                          "poll_url": f"/v1/audio/jobs/{job_id}", "cancel_url": f"/v1/audio/jobs/{job_id}/cancel"},
                         status=202)


async def run_audio_job(services: Services, ctx: JobContext) -> dict[str, Any]:
    spec = ctx.request
    from pathlib import Path

    audio = await trio.to_thread.run_sync(Path(spec["input"]).read_bytes)
    transcription = t.TranscriptionRequest(model=ctx.model or "", task=spec["task"], response_format=spec["format"],
                                           words=spec["words"], stream=False, run_async=True,
                                           diarize=spec["format"] == "diarized_json",
                                           language_probabilities=spec["language_probabilities"])
    try:
        async with acting_for(services, ctx.key, trace_id=ctx.id) as who:
            result = await _transcribe_once(services, (ctx.model or "").removeprefix("whisper:"), audio,
                                            spec["options"], who)
    except Refusal as refusal:
        raise JobFailed(refusal.message, fix=refusal.fix or "submit it again") from None
    rendered = render(result, transcription)
    body = await rendered.get_data(as_text=False)
    content_type = rendered.content_type or ""
    return {"content_type": content_type,
            "body": json.loads(body) if "json" in content_type else body.decode()}


def _audio_job_view(row: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(row["result"]) if row.get("result") else None
    error = json.loads(row["error"]) if row.get("error") else None
    return {"id": row["id"], "object": "audio.job", "status": row["state"], "model": row["model"],
            "created_at": row["created"], "finished_at": row["finished"],
            "result": result["body"] if result else None, "error": error}


@blueprint.get("/v1/audio/jobs/<job_id>")
@role(Role.KEY)
async def audio_job(job_id: str):
    row = await required(current_services().jobs).get(job_id, viewer())
    if row is None or row["kind"] != "audio":
        return refuse(Refusal(404, f"no audio job {job_id}", fix="GET /v1/jobs?kind=audio lists yours"))
    return json_response(_audio_job_view(row))


@blueprint.post("/v1/audio/jobs/<job_id>/cancel")
@role(Role.KEY)
async def cancel_audio_job(job_id: str):
    services = current_services()
    row = await required(services.jobs).get(job_id, viewer())
    if row is None or row["kind"] != "audio":
        return refuse(Refusal(404, f"no audio job {job_id}", fix="GET /v1/jobs?kind=audio lists yours"))
    state, row = await required(services.jobs).cancel_and_read(job_id, viewer())
    view = _audio_job_view(row)
    if state == "cancelling":
        view["status"] = "cancelling"
    return json_response(view)


# ------------------------------------------------------------------ text to speech


async def speech_voice(services: Services, body: dict[str, Any]) -> str:
    """The piper voice: `model` when it names one, else `voice` (the OpenAI SDK requires both fields)."""
    installed = await trio.to_thread.run_sync(audio_models.installed_voices, services.paths)
    for candidate in (body.get("model"), body.get("voice")):
        if isinstance(candidate, str) and candidate in installed:
            return candidate
    raise Refusal(404 if installed else 400, f"no installed piper voice named {body.get('model')!r} (model) or "
                  f"{body.get('voice')!r} (voice); installed: {', '.join(installed) or 'none'}",
                  fix="model = a piper voice id, e.g. en_US-joe-medium (blazar pull en_US-joe-medium)")


@blueprint.post("/v1/audio/speech")
@role(Role.KEY)
async def speech():
    services = current_services()
    try:
        body = await json_body()
        who = caller()
        speech_request = t.check_speech(body)
        if remote_of(services, str(body.get("model") or "")) is not None:
            return await _remote_speech(services, body)
        voice = await speech_voice(services, body)
        fmt, stream = speech_request["format"], speech_request["stream"]
        if fmt in t.LOSSY:
            transcode.ffmpeg_binary(fmt)  # refused before anything loads when ffmpeg is missing
        raw = fmt != "wav"  # everything but a WAV starts as the voice's raw PCM, sentence by sentence
        result = await forward(services, voice, UpstreamCall(
            method="POST", path="/synthesize", body=msgspec.json.encode({**speech_request["options"], "raw": raw}),
            stream=raw, content_type="application/json"),
            who, lane_kind="piper")
        if isinstance(result, UpstreamReply) and result.status >= 400:
            raise Refusal(400 if result.status < 500 else 502, f"piper refused: {result.engine_message}")
        headers = {"x-blazar-voice": voice}
        if fmt == "wav":
            return Response(buffered(result).body, content_type=MIME["wav"], headers=headers)
        if not isinstance(result, UpstreamStream):  # asked to stream, the engine answered a non-200 without a body
            raise Refusal(502, f"piper answered {result.status} instead of streaming audio")
        rate = await trio.to_thread.run_sync(_voice_rate, services, voice)
        headers["x-sample-rate"] = str(rate)
        children = services.paths.run / "children"  # ffmpeg's pidfile, as an engine's: the boot sweep reads it
        if fmt == "pcm":
            streamed = Response(_pcm_chunks(result), content_type=MIME["pcm"], headers=headers)
        elif stream:
            async def start(pipe: Callable[[], Awaitable[None]]) -> None:
                await required(services.sessions).run_task("transcode", who.key, pipe,
                                                            lambda: {"voice": voice, "format": fmt})

            live = await transcode.live(start, result, rate, fmt, children=children)
            streamed = Response(live, content_type=MIME[fmt], headers=headers)
        else:
            pcm = b"".join([chunk async for chunk in _pcm_chunks(result)])
            encoded = await transcode.encode(pcm, rate, fmt, children=children)
            return Response(encoded, content_type=MIME[fmt], headers=headers)
    except (RequestError, Refusal, transcode.TranscodeFailed) as error:
        return refuse(error)
    streamed.timeout = None
    return streamed


async def _remote_speech_to_text(services: Services, task: str, transcription: t.TranscriptionRequest,
                                 fields: dict[str, list[str]], audio: bytes, filename: str) -> Response:
    """`peer:model`: the upload goes to the peer as a multipart form again (the model renamed, `stream` left
    out: progressive transcription is a local lane feature), and its answer comes back as it is."""
    import httpx

    if transcription.run_async:
        raise Refusal(400, f"async transcription jobs run on this gateway's own whisper; {transcription.model} is on "
                      "a remote", fix="send it without async=true (it is answered when done), or to the peer itself")
    remote = remote_of(services, transcription.model)
    assert remote is not None  # routed here because the model is `peer:model`
    peer, name = remote
    form = {key: values for key, values in fields.items() if key not in ("stream", "model")}
    path = "/v1/audio/transcriptions" if task == "transcribe" else "/v1/audio/translations"
    upload = httpx.Request("POST", f"http://{peer}{path}", data={**form, "model": name},
                           files={"file": (filename, audio)})
    body = await trio.to_thread.run_sync(upload.read)  # the multipart copy of an upload of up to 50 MiB
    result = buffered(await forward(services, transcription.model, UpstreamCall(
        method="POST", path=path, body=body, stream=False, content_type=upload.headers["content-type"]), caller()))
    if result.status >= 400:
        raise engine_failure(result)
    return Response(result.body, status=result.status, content_type=result.content_type)


async def _remote_speech(services: Services, body: dict[str, Any]) -> Response:
    """`peer:voice`: the request goes to the peer's /v1/audio/speech as it came (the voice renamed), and its
    audio comes back as the peer sends it, byte for byte."""
    upstream = UpstreamCall(method="POST", path="/v1/audio/speech", body=msgspec.json.encode(body), stream=True,
                            content_type="application/json")
    result = await forward(services, body["model"], upstream, caller())
    if isinstance(result, UpstreamReply):
        raise engine_failure(result)

    async def relay() -> AsyncIterator[bytes]:
        with result.chunks:
            async for item in result.chunks:
                if isinstance(item, StreamFailure):
                    return  # audio has no error frame: the body ends short
                yield item.data

    response = Response(relay(), content_type=result.content_type)
    response.timeout = None
    return response


async def _pcm_chunks(stream: Any) -> AsyncIterator[bytes]:
    with stream.chunks:
        async for item in stream.chunks:
            if isinstance(item, StreamFailure):
                return
            yield item.data


def _voice_rate(services: Services, voice: str) -> int:
    config = json.loads(audio_models.voice_file(services.paths, voice).with_suffix(".onnx.json").read_text())
    return int((config.get("audio") or {}).get("sample_rate") or 22050)


# ------------------------------------------------------------------ menus


@blueprint.get("/v1/audio/voices")
@role(Role.KEY)
async def voices():
    services = current_services()
    installed = await trio.to_thread.run_sync(
        lambda: [audio_models.voice_info(services.paths, v) for v in audio_models.installed_voices(services.paths)])
    payload: dict[str, Any] = {"object": "list", "data": installed}
    query = request.args.get("search")
    if query is not None:
        query = query.strip()[:64]
        found: list[dict[str, Any]] | None = None
        error = "no answer within 20 s"
        with trio.move_on_after(SEARCH_SECS):
            try:
                found = await trio.to_thread.run_sync(_search_voices, query, abandon_on_cancel=True)
            except Exception as failure:  # any hub trouble: the installed list still answers
                error = f"{type(failure).__name__}: {failure}"
        if found is None:
            payload["search_error"] = f"the voice search on the hub failed ({error}); the installed voices are listed"
        else:
            known = {v["id"] for v in installed}
            payload["search"] = [r for r in found if r["id"] not in known][:50]
            payload["truncated"] = len(found) > 50
    return json_response(payload)


def _search_voices(query: str) -> list[dict[str, Any]]:
    from blazar.pull import _hub_api, _probe_hub

    _probe_hub()
    rows = []
    for path in _hub_api().list_repo_files("rhasspy/piper-voices"):
        if path.endswith(".onnx") and query.lower() in path.lower():
            voice = path.rsplit("/", 1)[-1].removesuffix(".onnx")
            rows.append({"object": "voice", "id": voice, "language": voice.split("-")[0],
                         "name": voice.split("-")[1] if voice.count("-") >= 2 else voice,
                         "quality": voice.rsplit("-", 1)[-1], "installed": False})
    return rows


@blueprint.get("/v1/audio/capabilities")
@role(Role.KEY)
async def capabilities():
    """What the audio lanes can do here; boots nothing."""
    services = current_services()
    from lanes.speech import package_version

    whisper = await trio.to_thread.run_sync(audio_models.installed_whisper, services.paths)
    voices_installed = await trio.to_thread.run_sync(audio_models.installed_voices, services.paths)
    pinned = services.config.whisper_model or audio_models.DEFAULT_WHISPER
    live = [r for r in await residents(services) if r.get("lane") in ("whisper", "piper")]
    return json_response({
        "object": "audio.capabilities",
        "engines": await trio.to_thread.run_sync(lambda: {
            "faster-whisper": package_version("faster-whisper") or None,
            "piper": package_version("piper-tts") or None, "ffmpeg": shutil.which("ffmpeg")}),
        "models": {"whisper": [{"id": f"whisper:{m}", "pinned": m == pinned,
                                "multilingual": audio_models.CATALOG[m].language == "multi"
                                if m in audio_models.CATALOG else None} for m in whisper],
                   "voices": voices_installed},
        "live": [{"model": r["model"], "lane": r["lane"], "state": r["state"], "pid": r.get("pid"),
                  "size_bytes": r.get("size_bytes")} for r in live],
        "endpoints": ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech", "/v1/audio/voices",
                      "/v1/audio/jobs/{id}", "/v1/audio/capabilities"],
        "transcription": {"formats": list(t.FORMATS), "knobs": [a for a in t.ACCEPTED if a != "file"],
                          "async": True, "stream": True, "stream_chunk_ms": services.config.whisper_stream_chunk_ms},
        "speech": {"formats": list(t.SPEECH_FORMATS), "stream_formats": ["pcm", *t.LOSSY],
                   "knobs": [f for f in t.SPEECH_FIELDS if f != "instructions"]},
        "idle_timeout_secs": services.config.audio_idle_secs,
    })
