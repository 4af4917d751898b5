"""The speech lanes through Blazar vs the same engine children called directly, side by side in one run.

    .venv/bin/python bench/audio.py [--rounds 20] [--write docs/benchmarks.md]

A throwaway BLAZAR_HOME borrows whisper tiny.en and the en_US-joe-medium voice from your own home.
`blazar serve` starts, one request makes each child resident, and then the same work alternates between
the child's own port and Blazar's (which goes first alternates): a transcription of a ~6 s WAV (real-time
factor = processing time / audio length), and the time to the first byte of streamed PCM speech.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import blazar_serve, publish

from blazar import audio_models
from blazar.paths import Paths

TEXT = ("The weather is sunny today. We are going to the park after lunch. "
        "Please bring a warm jacket and some water.")
VOICE = audio_models.DEFAULT_VOICE


def link_audio(source: Paths, target: Paths) -> None:
    for folder in (audio_models.whisper_dir(source, "tiny.en"), audio_models.voice_file(source, VOICE).parent):
        destination = audio_models.audio_root(target) / folder.relative_to(audio_models.audio_root(source))
        destination.mkdir(parents=True, exist_ok=True)
        for file in folder.iterdir():
            if file.is_file():
                os.link(file, destination / file.name)


def first_byte(client: httpx.Client, method: str, url: str, **kwargs) -> float:
    started = time.perf_counter()
    with client.stream(method, url, **kwargs) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            if chunk:
                return time.perf_counter() - started
    raise RuntimeError(f"{url} sent no audio")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    home = Paths(workdir / "home").ensure()
    link_audio(Paths.from_env(), home)
    try:
        with blazar_serve(home, workdir) as url, httpx.Client(timeout=120) as client:
            audio = client.post(f"{url}/v1/audio/speech", json={"model": VOICE, "input": TEXT}).content
            with wave.open(io.BytesIO(audio)) as wav:
                seconds = wav.getnframes() / wav.getframerate()
            client.post(f"{url}/v1/audio/transcriptions", data={"model": "tiny.en"},
                        files={"file": ("q.wav", audio)}).raise_for_status()
            ports = {row["lane"]: row["port"] for row in client.get(f"{url}/api/ps").json()["models"]}
            whisper_url = f"http://127.0.0.1:{ports['whisper']}/transcribe?options=" + "%7B%7D"
            piper_url = f"http://127.0.0.1:{ports['piper']}/synthesize"
            timings: dict[str, list[float]] = {k: [] for k in ("stt_direct", "stt_blazar", "tts_direct", "tts_blazar")}
            def stt_direct(i: int) -> None:
                started = time.perf_counter()
                client.post(whisper_url, content=audio).raise_for_status()
                timings["stt_direct"].append(time.perf_counter() - started)

            def stt_blazar(i: int) -> None:
                started = time.perf_counter()
                client.post(f"{url}/v1/audio/transcriptions", data={"model": "tiny.en"},
                            files={"file": ("q.wav", audio)}).raise_for_status()
                timings["stt_blazar"].append(time.perf_counter() - started)

            def tts_direct(i: int) -> None:  # a new text each time: piper's answer cache must not serve it
                timings["tts_direct"].append(first_byte(client, "POST", piper_url, content=json.dumps(
                    {"text": f"{TEXT} Round {i} alpha.", "raw": True})))

            def tts_blazar(i: int) -> None:
                timings["tts_blazar"].append(first_byte(client, "POST", f"{url}/v1/audio/speech", json={
                    "model": VOICE, "input": f"{TEXT} Round {i} bravo.", "response_format": "pcm"}))

            for i in range(args.rounds):  # alternate which side goes first, so neither always runs warm
                for step in ((stt_direct, stt_blazar, tts_direct, tts_blazar) if i % 2 == 0 else
                             (stt_blazar, stt_direct, tts_blazar, tts_direct)):
                    step(i)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in timings.items()}
    lines = [
        f"Command: `.venv/bin/python bench/audio.py --rounds {args.rounds}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; whisper tiny.en "
        f"(faster-whisper, int8) and piper {VOICE}; the same children behind both columns.", "",
        "| measure (median) | engine child directly | through Blazar | Blazar / direct |",
        "|---|---|---|---|",
        f"| transcription of {seconds:.1f} s of speech: real-time factor | {med['stt_direct'] / seconds:.3f} | "
        f"{med['stt_blazar'] / seconds:.3f} | {med['stt_blazar'] / med['stt_direct']:.2f}× |",
        f"| speech: time to the first PCM byte (3 sentences) | {med['tts_direct'] * 1000:.0f} ms | "
        f"{med['tts_blazar'] * 1000:.0f} ms | {med['tts_blazar'] / med['tts_direct']:.2f}× |",
    ]
    publish("\n".join(lines), args.write, "audio", "Speech lanes through Blazar vs the engines directly")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
