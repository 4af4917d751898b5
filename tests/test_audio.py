"""The speech lanes with their real engines: piper (en_US-joe-medium) speaks, faster-whisper (tiny.en)
listens, both as children of the gateway, driven through the official openai client and plain HTTP."""

from __future__ import annotations

import io
import json
import re
import wave
from pathlib import Path

import httpx
import openai
import pytest
import trio

from blazar import audio_models
from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_audio, ps

pytestmark = pytest.mark.engine

VOICE = "en_US-joe-medium"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "voice_client.py"
SENTENCE = "The quick brown fox jumps over the lazy dog."
THREE = ("The weather is sunny today. We are going to the park after lunch. "
         "Please bring a warm jacket and some water.")


def words_of(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def word_error_rate(reference: str, heard: str) -> float:
    ref, hyp = words_of(reference), words_of(heard)
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, other in enumerate(hyp, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != other))
    return row[-1] / len(ref)


@pytest.fixture(scope="session")
def shared_audio(shared_home: Paths) -> Paths:
    missing = [name for name, installed in (("tiny.en", audio_models.installed_whisper(shared_home)),
                                            ("base", audio_models.installed_whisper(shared_home)),
                                            (VOICE, audio_models.installed_voices(shared_home)))
               if name not in installed]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed in {shared_home.home}: run ./scripts/test (its setup "
                    "installs whisper tiny.en and the en_US-joe-medium voice)")
    return shared_home


@pytest.fixture
def audio_home(home: Paths, shared_audio: Paths) -> Paths:
    add_shared_audio(home, shared_audio)
    return home


def run(function):
    return trio.to_thread.run_sync(function)


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_piper_speaks_and_whisper_hears_it_through_the_openai_client(nursery, audio_home):
    gateway = await start_gateway(nursery, audio_home)
    client = client_for(gateway.url)
    with trio.fail_after(180):
        spoken = await run(lambda: client.audio.speech.create(model=VOICE, voice="alloy", input=SENTENCE))
        again = await run(lambda: client.audio.speech.create(model=VOICE, voice="alloy", input=SENTENCE))
        audio = spoken.content
        assert audio[:4] == b"RIFF" and audio == again.content  # WAV by default, byte-identical
        with wave.open(io.BytesIO(audio)) as wav:
            duration = wav.getnframes() / wav.getframerate()
        assert 1.5 < duration < 6

        heard = await run(lambda: client.audio.transcriptions.create(
            model="whisper-1", file=("fox.wav", audio), response_format="verbose_json",
            timestamp_granularities=["word", "segment"]))
        assert word_error_rate(SENTENCE, heard.text) <= 0.2, heard.text
        assert heard.language == "english" and abs(heard.duration - duration) < 0.1
        starts = [w.start for w in heard.words]
        assert starts == sorted(starts) and all(0 <= w.start <= w.end <= duration + 0.05 for w in heard.words)
        assert len(heard.words) >= 7

        plain = await run(lambda: client.audio.transcriptions.create(model="whisper:tiny.en", file=("f.wav", audio)))
        assert word_error_rate(SENTENCE, plain.text) <= 0.2
        async with gateway.client(timeout=60) as http:
            form = {"model": "tiny.en"}
            files = {"file": ("f.wav", audio)}
            srt = await http.post("/v1/audio/transcriptions", data={**form, "response_format": "srt"}, files=files)
            vtt = await http.post("/v1/audio/transcriptions", data={**form, "response_format": "vtt"}, files=files)
            text = await http.post("/v1/audio/transcriptions", data={**form, "response_format": "text"}, files=files)
            comma = await http.post("/v1/audio/transcriptions", files=files, data={
                **form, "timestamp_granularities": "word,segment"})
            rows = await ps(http)
    assert re.match(r"^1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n\S", srt.text)
    assert vtt.text.startswith("WEBVTT\n\n") and re.search(r"\d\d:\d\d:\d\d\.\d{3} --> ", vtt.text)
    assert word_error_rate(SENTENCE, text.text) <= 0.2 and text.headers["content-type"].startswith("text/plain")
    assert comma.json()["words"] and comma.headers["x-blazar-word-timestamps"] == "derived"
    assert plain_header(srt) == "unavailable"
    lanes = {row["model"]: row["lane"] for row in rows}
    assert lanes == {"whisper:tiny.en": "whisper", VOICE: "piper"}  # audio children show like text ones


def plain_header(response: httpx.Response) -> str:
    return response.headers["x-blazar-word-timestamps"]


async def test_pcm_streams_sentence_by_sentence(nursery, audio_home):
    gateway = await start_gateway(nursery, audio_home)
    client = client_for(gateway.url)
    with trio.fail_after(120):
        def stream() -> tuple[list[int], dict]:
            sizes = []
            with client.audio.speech.with_streaming_response.create(
                    model=VOICE, voice="alloy", input=THREE, response_format="pcm") as response:
                for chunk in response.iter_bytes():
                    sizes.append(len(chunk))
                return sizes, dict(response.headers)

        sizes, headers = await run(stream)
    rate = int(headers["x-sample-rate"])
    assert headers["content-type"] == "audio/pcm" and rate == 22050
    seconds = sum(sizes) / 2 / rate
    assert sum(sizes) % 2 == 0 and 4 < seconds < 15  # PCM16 of three sentences
    assert len(sizes) >= 3  # it arrived in pieces, not as one body


async def test_lossy_formats_go_through_ffmpeg_or_teach_without_it(nursery, audio_home, monkeypatch):
    gateway = await start_gateway(nursery, audio_home)
    body = {"model": VOICE, "input": SENTENCE}
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as http:
            mp3 = await http.post("/v1/audio/speech", json={**body, "response_format": "mp3"})
            async with http.stream("POST", "/v1/audio/speech", json={**body, "response_format": "opus",
                                                                     "stream": True}) as streamed:
                opus = b"".join([chunk async for chunk in streamed.aiter_bytes()])
            flac = await http.post("/v1/audio/speech", json={**body, "response_format": "flac"})
            monkeypatch.setattr("dialects.openai.audio_routes.shutil.which", lambda name: None)
            missing = await http.post("/v1/audio/speech", json={**body, "response_format": "mp3"})
    assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg"
    assert mp3.content[:3] == b"ID3" or mp3.content[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")
    assert opus[:4] == b"OggS" and len(opus) > 2000
    assert flac.content[:4] == b"fLaC"
    assert missing.status_code == 400
    message = missing.json()["error"]["message"]
    assert "ffmpeg" in message and "wav or pcm" in message and "apt-get install ffmpeg" in message


async def test_a_streamed_transcription_arrives_window_by_window(nursery, audio_home):
    gateway = await start_gateway(nursery, audio_home, whisper_stream_chunk_ms=2500)
    with trio.fail_after(180):
        async with gateway.client(timeout=120) as http:
            audio = (await http.post("/v1/audio/speech", json={"model": VOICE, "input": THREE})).content
            events = []
            async with http.stream("POST", "/v1/audio/transcriptions", data={"model": "tiny.en", "stream": "true"},
                                   files={"file": ("three.wav", audio)}) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
    chunks = [e for e in events if e["type"] == "chunk.completed"]
    final = events[-1]
    assert final["type"] == "transcript.completed" and len(chunks) == final["chunks"] >= 3
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert [c["offset_ms"] for c in chunks] == [2500 * i for i in range(len(chunks))]
    starts = [s["start"] for s in final["segments"]]
    assert starts == sorted(starts) and final["segments"][-1]["end"] > 5.0  # rebased to whole-file time
    assert word_error_rate(THREE, final["text"]) <= 0.35, final["text"]  # windows cut words at their edges


async def test_an_async_transcription_is_a_job_served_after_a_restart(nursery, audio_home):
    async with trio.open_nursery() as first_run:
        gateway = await start_gateway(first_run, audio_home)
        with trio.fail_after(120):
            async with gateway.client(timeout=60) as http:
                audio = (await http.post("/v1/audio/speech", json={"model": VOICE, "input": SENTENCE})).content
                handle = (await http.post("/v1/audio/transcriptions", data={"model": "tiny.en", "async": "true"},
                                          files={"file": ("f.wav", audio)})).json()
                assert handle["status"] == "queued" and handle["poll_url"] == f"/v1/audio/jobs/{handle['id']}"
                while (job := (await http.get(handle["poll_url"])).json())["status"] != "completed":
                    assert job["status"] in ("queued", "running"), job
                    await trio.sleep(0.1)
        gateway.shutdown.set()
    second = await start_gateway(nursery, audio_home)
    with trio.fail_after(30):
        async with second.client() as http:
            record = (await http.get(f"/v1/audio/jobs/{handle['id']}")).json()
    assert record["status"] == "completed" and word_error_rate(SENTENCE, record["result"]["text"]) <= 0.2


@pytest.mark.parametrize(("path", "fields", "needle"), [
    ("/v1/audio/transcriptions", {"include": "logprobs"}, "hosted-service field"),
    ("/v1/audio/transcriptions", {"timestamp_granularities[]": "word", "response_format": "json"},
     "needs response_format verbose_json"),
    ("/v1/audio/transcriptions", {"stream": "true", "async": "true"}, "cannot both be true"),
    ("/v1/audio/transcriptions", {"stream": "true", "response_format": "diarized_json"}, "not available on the stream"),
    ("/v1/audio/transcriptions", {"temperature": "hot"}, "`temperature` must be a number"),
    ("/v1/audio/transcriptions", {"vad_threshold": "2"}, "`vad_threshold` must be from 0 to 1"),
    ("/v1/audio/transcriptions", {"frobnicate": "1"}, "unknown field `frobnicate`"),
    ("/v1/audio/translations", {}, "English-only"),
    ("/v1/audio/transcriptions", {"model": "large-v3"}, "blazar whisper --pull --model large-v3"),
    ("/v1/audio/transcriptions", {"response_format": "diarized_json"}, "mono"),
])
async def test_transcription_fields_teach(nursery, audio_home, path, fields, needle):
    gateway = await start_gateway(nursery, audio_home)
    with trio.fail_after(60):
        async with gateway.client(timeout=30) as http:
            audio = (await http.post("/v1/audio/speech", json={"model": VOICE, "input": "Hello."})).content
            response = await http.post(path, data={"model": "tiny.en", **fields}, files={"file": ("a.wav", audio)})
    assert 400 <= response.status_code < 500, response.text
    assert needle in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(("body", "needle"), [
    ({"instructions": "whisper it"}, "fixed personality"),
    ({"response_format": "wav", "stream": True}, "use response_format pcm"),
    ({"speed": 5}, "`speed` must be a number from 0.25 to 4"),
    ({"model": "en_GB-nobody-low", "voice": "alloy"}, "blazar pull en_US-joe-medium"),
    ({"response_format": "ogg"}, "`response_format` must be one of"),
])
async def test_speech_fields_teach(nursery, audio_home, body, needle):
    gateway = await start_gateway(nursery, audio_home)
    with trio.fail_after(30):
        async with gateway.client() as http:
            response = await http.post("/v1/audio/speech", json={"model": VOICE, "input": "Hi.", **body})
    assert 400 <= response.status_code < 500 and needle in response.json()["error"]["message"], response.text


async def test_capabilities_and_voices_boot_nothing(nursery, audio_home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no hub here: the search must fail softly
    gateway = await start_gateway(nursery, audio_home)
    with trio.fail_after(60):
        async with gateway.client(timeout=40) as http:
            card = (await http.get("/v1/audio/capabilities")).json()
            voices = (await http.get("/v1/audio/voices")).json()
            searched = (await http.get("/v1/audio/voices", params={"search": "joe"})).json()
            listed = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
            assert await ps(http) == []
    assert card["engines"]["faster-whisper"] and card["engines"]["piper"]
    assert card["models"]["whisper"] == [{"id": "whisper:base", "pinned": False, "multilingual": True},
                                         {"id": "whisper:tiny.en", "pinned": True, "multilingual": False}]
    assert card["models"]["voices"] == [VOICE] and card["live"] == []
    assert "timestamp_granularities[]" in card["transcription"]["knobs"]
    assert [v["id"] for v in voices["data"]] == [VOICE] and voices["data"][0]["sample_rate"] == 22050
    assert "search_error" in searched and [v["id"] for v in searched["data"]] == [VOICE]
    assert listed["whisper:base"]["capabilities"] == ["transcription", "translation"]
    assert listed["whisper:tiny.en"]["capabilities"] == ["transcription"] and listed[VOICE]["lane"] == "piper"


async def test_speech_requests_are_charged_per_request_and_scoped_by_voice(nursery, audio_home):
    from blazar.config import ConfigFile
    from tests.conftest import issued

    talker, chatter = "plm_" + "c3" * 16, "plm_" + "d4" * 16
    audio_home.config.write_text(
        f'[[keys]]\nname = "talker"\nsecret = "{issued(talker)}"\nmodels = ["{VOICE}"]\nrpm = 1\n\n'
        f'[[keys]]\nname = "chatter"\nsecret = "{issued(chatter)}"\nmodels = ["smollm2:135m"]\n')
    gateway = await start_gateway(nursery, audio_home, keys=ConfigFile(audio_home.config).load({}).keys)
    body = {"model": VOICE, "input": "Hi."}
    with trio.fail_after(60):
        async with gateway.client(timeout=30) as http:
            first = await http.post("/v1/audio/speech", json=body, headers={"authorization": f"Bearer {talker}"})
            second = await http.post("/v1/audio/speech", json=body, headers={"authorization": f"Bearer {talker}"})
            outside = await http.post("/v1/audio/speech", json=body, headers={"authorization": f"Bearer {chatter}"})
    assert first.status_code == 200 and second.status_code == 429 and "rpm" in second.text
    assert outside.status_code == 403 and "smollm2:135m" in outside.json()["error"]["message"]


async def test_translations_use_a_multilingual_model(nursery, audio_home):
    """whisper:base translates to English; spoken English comes back as the same English text."""
    gateway = await start_gateway(nursery, audio_home)
    client = client_for(gateway.url)
    with trio.fail_after(180):
        audio = (await run(lambda: client.audio.speech.create(model=VOICE, voice="alloy", input=SENTENCE))).content
        translated = await run(lambda: client.audio.translations.create(model="base", file=("f.wav", audio)))
        verbose = await run(lambda: client.audio.translations.create(model="whisper:base", file=("f.wav", audio),
                                                                     response_format="verbose_json"))
    assert word_error_rate(SENTENCE, translated.text) <= 0.25, translated.text
    assert verbose.task == "translate" and verbose.segments


async def test_the_example_voice_client_answers_a_spoken_question(live, audio_home, tmp_path):
    """examples/voice_client.py as a person runs it: a spoken question in, the transcript, SmolLM2's answer and
    the answer as a WAV out."""
    import sys

    answer = tmp_path / "answer.wav"
    with trio.fail_after(180):
        done = await trio.run_process([sys.executable, str(EXAMPLE), "--say", "What is the capital of France?",
                                       str(answer), "--url", live.url], capture_stdout=True, capture_stderr=True,
                                      check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "you said:" in out and "france" in out.lower() and "answer:" in out
    with wave.open(str(answer)) as wav:
        assert wav.getnframes() / wav.getframerate() > 0.5
