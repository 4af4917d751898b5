"""A voice turn against `blazar serve`: a WAV in, the transcript and the spoken answer out as a WAV.

    python examples/voice_client.py question.wav answer.wav
    python examples/voice_client.py --say "What is the capital of France?" answer.wav   # no microphone

It uses only the official OpenAI SDK: whisper transcribes the question, the chat model answers, and the
piper voice speaks the answer. Options: --url (default http://127.0.0.1:11434), --model (smollm2:135m),
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
    args = parser.parse_args()
    if args.question is None and args.say is None:
        parser.error("give a question WAV, or --say TEXT")
    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.key)
    if args.say is not None:
        audio = client.audio.speech.create(model=args.voice, voice="alloy", input=args.say).content
        name = "question.wav"
    else:
        audio, name = args.question.read_bytes(), args.question.name
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


if __name__ == "__main__":
    raise SystemExit(main())
