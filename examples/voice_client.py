"""A voice turn against `blazar serve`: a WAV in, the transcript and the spoken answer out as a WAV.

    python examples/voice_client.py question.wav answer.wav
    python examples/voice_client.py --say "What is the capital of France?" answer.wav   # no microphone
    python examples/voice_client.py --realtime question.wav answer.wav                  # one WebSocket turn

Over HTTP it uses only the official OpenAI SDK: whisper transcribes the question, the chat model answers,
and the piper voice speaks the answer. With --realtime the same turn goes over /v1/realtime (trio-websocket):
the question's audio is sent as PCM16 at 24 kHz, and the answer streams back as transcript and audio
deltas while it is being spoken. Options: --url (default http://127.0.0.1:11434), --model (smollm2:135m),
--voice (en_US-joe-medium), --key (an API key, when the gateway has keys).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", type=Path, help="a WAV (or any audio file) with the question")
    parser.add_argument("answer", type=Path, help="where to write the spoken answer (WAV)")
    parser.add_argument("--say", help="speak this text with the voice first, and use that as the question")
    parser.add_argument("--url", default="http://127.0.0.1:11434")
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--voice", default="en_US-joe-medium")
    parser.add_argument("--key", default="unused")
    parser.add_argument("--realtime", action="store_true", help="one turn over the /v1/realtime WebSocket")
    args = parser.parse_args()
    if args.question is None and args.say is None:
        parser.error("give a question WAV, or --say TEXT")
    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.key)
    if args.say is not None:
        audio = client.audio.speech.create(model=args.voice, voice="alloy", input=args.say).content
        name = "question.wav"
    else:
        audio, name = args.question.read_bytes(), args.question.name
    if args.realtime:
        import trio

        return trio.run(realtime_turn, args, audio)
    heard = client.audio.transcriptions.create(model="whisper-1", file=(name, audio)).text.strip()
    print(f"you said: {heard}")
    reply = client.chat.completions.create(model=args.model, max_tokens=60, messages=[
        {"role": "system", "content": "Answer in one or two short sentences."},
        {"role": "user", "content": heard}]).choices[0].message.content.strip()
    print(f"answer:   {reply}")
    with client.audio.speech.with_streaming_response.create(model=args.voice, voice="alloy", input=reply,
                                                            response_format="wav") as spoken:
        spoken.stream_to_file(args.answer)
    print(f"spoken answer written to {args.answer}", file=sys.stderr)
    return 0


def pcm24(wav_bytes: bytes) -> bytes:
    """A WAV's PCM16 as mono at 24 kHz, what the realtime API takes (linear resampling with numpy)."""
    import io
    import wave

    import numpy as np

    with wave.open(io.BytesIO(wav_bytes)) as source:
        rate, channels = source.getframerate(), source.getnchannels()
        samples = np.frombuffer(source.readframes(source.getnframes()), dtype=np.int16).astype(np.float32)
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    positions = np.linspace(0, len(samples) - 1, num=round(len(samples) * 24_000 / rate))
    return np.interp(positions, np.arange(len(samples)), samples).round().astype(np.int16).tobytes()


async def realtime_turn(args: argparse.Namespace, wav_bytes: bytes) -> int:
    import base64
    import json
    import wave

    import trio_websocket

    url = args.url.replace("http", "ws", 1) + f"/v1/realtime?model={args.model}&voice={args.voice}"
    headers = [(b"authorization", f"Bearer {args.key}".encode())]
    pcm = pcm24(wav_bytes)
    answer: list[bytes] = []
    async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
        for start in range(0, len(pcm), 48_000):
            await ws.send_message(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[start:start + 48_000]).decode()}))
        await ws.send_message(json.dumps({"type": "input_audio_buffer.commit"}))
        while True:
            event = json.loads(await ws.get_message())
            if event["type"].endswith("input_audio_transcription.completed"):
                print(f"you said: {event['transcript'].strip()}")
                print("answer:   ", end="", flush=True)
            elif event["type"] == "response.audio_transcript.delta":
                print(event["delta"], end="", flush=True)
            elif event["type"] == "response.audio.delta":
                answer.append(base64.b64decode(event["delta"]))
            elif event["type"] == "error":
                print(f"\nerror: {event['error']['message']}", file=sys.stderr)
            elif event["type"] == "response.done":
                print()
                break
    with wave.open(str(args.answer), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24_000)
        out.writeframes(b"".join(answer))
    print(f"spoken answer written to {args.answer}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
