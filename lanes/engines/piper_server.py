"""The piper engine child: one piper voice kept loaded, served over loopback HTTP.

    python -m lanes.engines.piper_server --voice VOICE.onnx --port N

- GET /health: 200 once the voice is loaded; GET /info: sample rate, speakers.
- POST /synthesize with JSON {text, speaker_id, length_scale, noise_scale, noise_w_scale, sentence_silence,
  raw}: raw=true streams PCM16 mono at the voice's own rate sentence by sentence (chunked, first bytes
  after the first sentence); raw=false answers one WAV.

Piper's VITS model draws its noise inside the ONNX graph, unseeded, so two syntheses of one text differ by
a few samples. The last answers (bounded, 64 MiB) are kept per input, so the same request gets the same
bytes for as long as the voice stays loaded.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import wave
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from lanes.engines.http_child import JsonHandler, QuietServer

VOICE: Any = None
LOCK = threading.Lock()
CACHE: OrderedDict[str, list[bytes]] = OrderedDict()
CACHE_BYTES = 64 * 1024 * 1024


def _config(options: dict[str, Any]) -> Any:
    from piper import SynthesisConfig

    return SynthesisConfig(speaker_id=options.get("speaker_id"), length_scale=options.get("length_scale"),
                           noise_scale=options.get("noise_scale"), noise_w_scale=options.get("noise_w_scale"))


def pcm_sentences(options: dict[str, Any]) -> Iterator[bytes]:
    """PCM16 per sentence, each followed by `sentence_silence` seconds of silence."""
    key = json.dumps({k: v for k, v in options.items() if k != "raw"}, sort_keys=True)
    with LOCK:
        cached = CACHE.get(key)
        if cached is not None:
            CACHE.move_to_end(key)
    if cached is not None:
        yield from cached
        return
    rate = VOICE.config.sample_rate
    silence = b"\0\0" * int(rate * float(options.get("sentence_silence") or 0.0))
    produced = []
    for chunk in VOICE.synthesize(options["text"], _config(options)):
        pcm = chunk.audio_int16_bytes + silence
        produced.append(pcm)
        yield pcm
    with LOCK:
        CACHE[key] = produced
        while sum(len(p) for parts in CACHE.values() for p in parts) > CACHE_BYTES and len(CACHE) > 1:
            CACHE.popitem(last=False)


class Handler(JsonHandler):

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200 if VOICE is not None else 503, {"status": "ok" if VOICE is not None else "loading"})
        elif self.path == "/info" and VOICE is not None:
            self._json(200, {"sample_rate": VOICE.config.sample_rate, "speakers": VOICE.config.num_speakers})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path != "/synthesize":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            options = json.loads(body)
            if not isinstance(options.get("text"), str) or not options["text"].strip():
                raise ValueError("`text` must be a non-empty string")
            rate = VOICE.config.sample_rate
            if options.get("raw"):
                self.send_response(200)
                self.send_header("content-type", "audio/pcm")
                self.send_header("x-sample-rate", str(rate))
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for pcm in pcm_sentences(options):
                    self.wfile.write(f"{len(pcm):x}\r\n".encode() + pcm + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            out = io.BytesIO()
            with wave.open(out, "wb") as wav:
                wav.setnchannels(1)
                wav.setsampwidth(2)
                wav.setframerate(rate)
                for pcm in pcm_sentences(options):
                    wav.writeframes(pcm)
            data = out.getvalue()
            self.send_response(200)
            self.send_header("content-type", "audio/wav")
            self.send_header("x-sample-rate", str(rate))
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (ValueError, TypeError, KeyError) as error:
            self._json(400, {"error": {"message": str(error)}})


def main() -> None:
    global VOICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--voice", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = QuietServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from piper import PiperVoice

    VOICE = PiperVoice.load(args.voice)
    print(f"piper_server: {args.voice} ready on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
