"""A realtime voice turn's latency by stage, through Blazar, against the three engines called directly one
after another, in one run.

    .venv/bin/python bench/realtime.py [--turns 8] [--write docs/benchmarks.md]

A throwaway BLAZAR_HOME borrows the engine, SmolLM2, whisper tiny.en and the voice from your own home.
Through Blazar (/v1/realtime): commit -> transcript (STT), -> first transcript delta (first chat token),
-> first audio delta (the first sentence spoken). Directly, on the same children: the transcription, the
chat's first token, and the first PCM byte of the answer's first sentence, each timed alone; their sum is
what a client that called the engines itself in sequence would wait.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from audio import link_audio
from latency import blazar_serve, prepare_home, publish

from blazar.paths import Paths
from blazar.pcm import pcm_to_wav, resample
from supervisors.realtime import Settings

QUESTION = "What is the capital of France?"
VOICE = "en_US-joe-medium"


async def realtime_turn(url: str, pcm: bytes) -> dict[str, float | str]:
    marks: dict[str, float | str] = {}
    async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/realtime") as ws:
        await ws.get_message()
        for start in range(0, len(pcm), 48_000):
            await ws.send_message(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[start:start + 48_000]).decode()}))
        started = time.perf_counter()
        await ws.send_message(json.dumps({"type": "input_audio_buffer.commit"}))
        reply = []
        while True:
            event = json.loads(await ws.get_message())
            now = time.perf_counter() - started
            if event["type"].endswith("input_audio_transcription.completed"):
                marks["stt"], marks["heard"] = now, event["transcript"]
            elif event["type"] == "response.audio_transcript.delta":
                marks.setdefault("first_token", now)
                reply.append(event["delta"])
            elif event["type"] == "response.audio.delta":
                marks.setdefault("first_audio", now)
            elif event["type"] == "response.done":
                marks["reply"] = "".join(reply)
                return marks


def direct_turn(client: httpx.Client, ports: dict[str, int], wav: bytes, heard: str, reply: str) -> dict[str, float]:
    started = time.perf_counter()
    client.post(f"http://127.0.0.1:{ports['whisper']}/transcribe?options=%7B%7D", content=wav).raise_for_status()
    stt = time.perf_counter() - started
    messages = [{"role": "system", "content": Settings(model="", voice="", stt_model="").instructions},
                {"role": "user", "content": heard}]
    started = time.perf_counter()
    with client.stream("POST", f"http://127.0.0.1:{ports['llamacpp']}/v1/chat/completions", json={
            "messages": messages, "stream": True, "max_tokens": 200, "repeat_penalty": 1.1}) as response:
        for line in response.iter_lines():
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                break
    first_token = time.perf_counter() - started
    sentence = re.split(r"(?<=[.!?])\s+", reply.strip())[0] or reply
    started = time.perf_counter()
    with client.stream("POST", f"http://127.0.0.1:{ports['piper']}/synthesize",
                       json={"text": f"{sentence} ({time.time_ns()})", "raw": True}) as response:
        next(response.iter_raw())
    first_audio = time.perf_counter() - started
    return {"stt": stt, "first_token": first_token, "first_audio": first_audio}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    source = Paths.from_env()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    home = Paths(workdir / "home").ensure()
    prepare_home(source, home)
    link_audio(source, home)
    through: list[dict] = []
    direct: list[dict] = []
    try:
        with blazar_serve(home, workdir) as url, httpx.Client(timeout=120) as client:
            spoken = client.post(f"{url}/v1/audio/speech", json={"model": VOICE, "input": QUESTION,
                                                                 "response_format": "pcm"})
            pcm = resample(spoken.content, int(spoken.headers["x-sample-rate"]))
            trio.run(realtime_turn, url, pcm)  # every child resident and warm
            ports = {row["lane"]: row["port"] for row in client.get(f"{url}/api/ps").json()["models"]}
            marks = trio.run(realtime_turn, url, pcm)
            wav = pcm_to_wav(pcm, 24_000)
            for turn in range(args.turns):
                # A pause before each side lets the engines' spinning thread pools settle (on 2 cores they would
                # slow whichever side runs next), and the order alternates.
                sides = [lambda: through.append(trio.run(realtime_turn, url, pcm)),
                         lambda: direct.append(direct_turn(client, ports, wav, str(marks["heard"]),
                                                           str(marks["reply"])))]
                for side in sides if turn % 2 == 0 else reversed(sides):
                    time.sleep(1.0)
                    side()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(float(r[key]) for r in rows) * 1000

    stt, token, audio = med(through, "stt"), med(through, "first_token"), med(through, "first_audio")
    d_stt, d_token, d_audio = med(direct, "stt"), med(direct, "first_token"), med(direct, "first_audio")
    lines = [
        f"Command: `.venv/bin/python bench/realtime.py --turns {args.turns}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; whisper tiny.en, "
        f"SmolLM2-135M, piper {VOICE}; the same children behind both columns. Medians in ms.", "",
        "| stage | through /v1/realtime (time from commit) | the engine alone |",
        "|---|---|---|",
        f"| STT: the transcript | {stt:.0f} | {d_stt:.0f} |",
        f"| chat: first token | {token:.0f} ({token - stt:.0f} after the transcript) | {d_token:.0f} |",
        f"| TTS: first audio (the first sentence spoken) | {audio:.0f} ({audio - token:.0f} after the first token) | "
        f"{d_audio:.0f} |",
        f"| **commit → first audio delta** | **{audio:.0f}** | **{d_stt + d_token + d_audio:.0f}** (the three in "
        "sequence, the sentence's text known up front) |",
    ]
    publish("\n".join(lines), args.write, "realtime", "A realtime voice turn by stage")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
