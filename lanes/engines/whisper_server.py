"""The whisper engine child: one faster-whisper (CTranslate2) model served over loopback HTTP.

    python -m lanes.engines.whisper_server --model DIR --port N [--threads T]

- GET /health: 200 once the model is loaded.
- POST /transcribe?options=<json>: the body is the audio file (any format PyAV decodes: wav, mp3, flac,
  ogg, m4a…). Options: task (transcribe|translate), language, temperature, initial_prompt, beam_size,
  best_of, word_timestamps, vad_filter, vad (VadOptions fields), split_stereo (one transcription per
  channel), offset_secs/clip (a window of the file, for streaming). Answers JSON: language,
  language_probability, duration, and segments with their words (from the model's token timings).
- Errors answer {"error": {"message": …}} with 400 (undecodable audio, bad option) or 500.

One request at a time (the model serializes inference anyway); the gateway's instance queues the rest.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import threading
import urllib.parse
from typing import Any

from lanes.engines.http_child import JsonHandler, QuietServer

log = logging.getLogger("whisper_server")

MODEL: Any = None
LOCK = threading.Lock()


def _segments(segments: Any, offset: float = 0.0) -> list[dict[str, Any]]:
    out = []
    for segment in segments:
        words = [{"word": w.word, "start": round(w.start + offset, 3), "end": round(w.end + offset, 3),
                  "probability": round(w.probability, 4)} for w in (segment.words or [])]
        out.append({"id": segment.id, "seek": segment.seek, "start": round(segment.start + offset, 3),
                    "end": round(segment.end + offset, 3), "text": segment.text, "tokens": list(segment.tokens),
                    "temperature": segment.temperature, "avg_logprob": segment.avg_logprob,
                    "compression_ratio": segment.compression_ratio, "no_speech_prob": segment.no_speech_prob,
                    "words": words})
    return out


def transcribe(audio: bytes, options: dict[str, Any]) -> dict[str, Any]:
    from faster_whisper.audio import decode_audio
    from faster_whisper.vad import VadOptions

    split = bool(options.pop("split_stereo", False))
    try:
        decoded = decode_audio(io.BytesIO(audio), sampling_rate=16000, split_stereo=split)
    except Exception as error:
        raise ValueError(f"the audio could not be decoded ({type(error).__name__}: {error})") from None
    vad = options.pop("vad", None)
    if vad:
        options["vad_parameters"] = VadOptions(**vad)
    channels = list(decoded) if split else [decoded]
    if split:
        import numpy as np

        if np.array_equal(channels[0], channels[1]):
            raise ValueError("the audio is mono (or both channels are the same): diarization maps one voice per "
                             "channel of a stereo recording")
    results = []
    for samples in channels:
        with LOCK:
            segments, info = MODEL.transcribe(samples, **options)
            segments = _segments(list(segments))
        results.append({"language": info.language, "language_probability": round(info.language_probability, 4),
                        "duration": round(info.duration, 3), "segments": segments})
    if split:
        return {"channels": results, "duration": max(r["duration"] for r in results)}
    return results[0]


class Handler(JsonHandler):

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200 if MODEL is not None else 503, {"status": "ok" if MODEL is not None else "loading"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("content-length", 0))
        audio = self.rfile.read(length)
        if url.path != "/transcribe":
            self._json(404, {"error": {"message": f"no route {url.path}"}})
            return
        try:
            options = json.loads(urllib.parse.parse_qs(url.query).get("options", ["{}"])[0])
            self._json(200, transcribe(audio, options))
        except (ValueError, TypeError) as error:
            self._json(400, {"error": {"message": str(error)}})
        except Exception as error:
            log.exception("transcription failed")
            self._json(500, {"error": {"message": f"{type(error).__name__}: {error}"}})


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    server = QuietServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from faster_whisper import WhisperModel

    MODEL = WhisperModel(args.model, device="cpu", compute_type="int8", cpu_threads=args.threads)
    print(f"whisper_server: {args.model} ready on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
