"""/v1/realtime: WebSocket voice turns through the real whisper, SmolLM2 and piper children, driven by a
trio-websocket client; the bounds, the out-of-band rule and both TTLs on an autojump clock."""

from __future__ import annotations

import base64
import json

import pytest
import trio
import trio_websocket

from blazar.pcm import resample
from tests.conftest import start_gateway
from tests.lane_fixtures import ps

pytestmark = pytest.mark.engine

VOICE = "en_US-joe-medium"
QUESTION = "What is the capital of France?"


def ws_url(gateway, query: str = "") -> str:
    return gateway.url.replace("http://", "ws://") + "/v1/realtime" + query


async def spoken_pcm24(gateway, text: str) -> bytes:
    """Piper speaks `text`; the PCM is resampled to the realtime API's 24 kHz."""
    async with gateway.client(timeout=60) as http:
        response = await http.post("/v1/audio/speech", json={"model": VOICE, "input": text, "response_format": "pcm"})
    return resample(response.content, int(response.headers["x-sample-rate"]))


async def send(ws, event: dict) -> None:
    await ws.send_message(json.dumps(event))


async def append_audio(ws, pcm: bytes, chunk: int = 48_000) -> None:
    for start in range(0, len(pcm), chunk):
        piece = base64.b64encode(pcm[start:start + chunk]).decode()
        await send(ws, {"type": "input_audio_buffer.append", "audio": piece})


async def until_type(ws, kind: str, seen: list[dict]) -> dict:
    while True:
        event = json.loads(await ws.get_message())
        seen.append(event)
        if event["type"] == kind:
            return event


async def test_a_voice_turn_hears_answers_and_speaks(nursery, voice_home):
    gateway = await start_gateway(nursery, voice_home)
    with trio.fail_after(240):
        pcm = await spoken_pcm24(gateway, QUESTION)
        async with trio_websocket.open_websocket_url(ws_url(gateway, f"?voice={VOICE}")) as ws:
            created = json.loads(await ws.get_message())
            assert created["type"] == "session.created" and created["session"]["voice"] == VOICE
            await append_audio(ws, pcm)
            await send(ws, {"type": "input_audio_buffer.commit"})
            seen: list[dict] = []
            done = await until_type(ws, "response.done", seen)
    kinds = [e["type"] for e in seen]
    heard = next(e for e in seen if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert "capital of france" in heard["transcript"].lower()
    assert kinds.index("input_audio_buffer.committed") < kinds.index(heard["type"]) < kinds.index("response.created")
    text = "".join(e["delta"] for e in seen if e["type"] == "response.audio_transcript.delta")
    assert text.strip() and next(e for e in seen if e["type"] == "response.audio_transcript.done")["transcript"] == text
    audio = b"".join(base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.audio.delta")
    seconds = len(audio) / 2 / 24_000
    assert len(audio) % 2 == 0 and 0.5 < seconds < 60  # PCM16 at 24 kHz of a spoken answer
    first_audio = kinds.index("response.audio.delta")
    assert first_audio < kinds.index("response.audio_transcript.done")  # speech starts before the chat ends
    assert done["response"]["status"] == "completed" and kinds[-2] == "response.audio.done"


async def test_cancel_between_stages_update_next_turn_and_out_of_band_events(nursery, voice_home):
    gateway = await start_gateway(nursery, voice_home)
    with trio.fail_after(240):
        pcm = await spoken_pcm24(gateway, QUESTION)
        async with trio_websocket.open_websocket_url(ws_url(gateway)) as ws:
            await ws.get_message()  # session.created
            await send(ws, {"type": "session.update", "session": {"input_audio_transcription": {"model": "base"},
                                                                  "instructions": "Reply with one word."}})
            updated = json.loads(await ws.get_message())
            assert updated["type"] == "session.updated" and updated["session"]["input_audio_transcription"] == {
                "model": "base"}
            await append_audio(ws, pcm)
            await send(ws, {"type": "input_audio_buffer.commit"})
            await send(ws, {"type": "response.cancel"})
            await send(ws, {"type": "response.create", "event_id": "evt_oob"})  # out of band: the turn runs
            seen: list[dict] = []
            done = await until_type(ws, "response.done", seen)
            heard = next(e for e in seen if e["type"].endswith("input_audio_transcription.completed"))
            assert heard["model"] == "base"  # the update applied from this (the next) turn
            oob = next(e for e in seen if e["type"] == "error")
            assert oob["error"]["event_id"] == "evt_oob" and "response.cancel" in oob["error"]["message"]
            assert done["response"]["status"] == "cancelled"
            assert not [e for e in seen if e["type"] == "response.audio.delta"]  # stopped after STT

            await send(ws, {"type": "input_audio_buffer.commit"})  # the buffer was used: nothing to commit
            empty = json.loads(await ws.get_message())
            assert empty["error"]["code"] == "input_audio_buffer_commit_empty"
            await send(ws, {"type": "nope.event"})
            await ws.send_message("{not json")
            unknown, malformed = json.loads(await ws.get_message()), json.loads(await ws.get_message())
            assert "unknown event type 'nope.event'" in unknown["error"]["message"]
            assert malformed["error"]["code"] == "invalid_json"
            assert ws.closed is None  # the session goes on after every error


async def test_the_context_is_bounded_and_the_buffer_too(nursery, voice_home):
    gateway = await start_gateway(nursery, voice_home)
    with trio.fail_after(60):
        async with trio_websocket.open_websocket_url(ws_url(gateway)) as ws:
            await ws.get_message()
            ids = []
            for index in range(17):
                await send(ws, {"type": "conversation.item.create", "item": {
                    "id": f"item_{index}", "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": f"note {index}"}]}})
                created = json.loads(await ws.get_message())
                ids.append(created["item"]["id"])
            deleted = json.loads(await ws.get_message())
            assert deleted == {**deleted, "type": "conversation.item.deleted", "item_id": "item_0"}
            await send(ws, {"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 8192}]}})
            await ws.get_message()  # created
            evicted = [json.loads(await ws.get_message())["item_id"] for _ in range(16)]
            assert evicted == [f"item_{i}" for i in range(1, 17)]  # 8192 characters leave room for one item
            big = base64.b64encode(b"\0" * (6 * 1024 * 1024)).decode()
            for _ in range(4):
                await send(ws, {"type": "input_audio_buffer.append", "audio": big})
            full = json.loads(await ws.get_message())
            assert full["error"]["code"] == "input_audio_buffer_full" and ws.closed is None
            await send(ws, {"type": "input_audio_buffer.clear"})
            assert json.loads(await ws.get_message())["type"] == "input_audio_buffer.cleared"


async def test_the_session_ttls_on_an_autojump_clock(autojump_clock):
    """The session actor alone, its socket a pair of memory channels: 120 s without a client event closes it,
    and a client that never idles is closed at 600 s."""
    from supervisors.realtime import RealtimeSession, Settings

    async def run_session(client_events) -> tuple[str, float]:
        to_session, session_inbox = trio.open_memory_channel[str](16)
        session_out, from_session = trio.open_memory_channel[str](256)
        session = RealtimeSession(Settings(model="m", voice="v", stt_model="whisper-1"), pipeline=None)
        started = trio.current_time()
        reason = ""
        async with trio.open_nursery() as inner:
            async def drain():
                async for _ in from_session:
                    pass

            inner.start_soon(drain)
            inner.start_soon(client_events, to_session)

            async def receive() -> str:
                return await session_inbox.receive()

            async def send(text: str) -> None:
                await session_out.send(text)

            reason = await session.run(receive, send)
            inner.cancel_scope.cancel()
        return reason, trio.current_time() - started

    async def silent(channel) -> None:
        await trio.sleep_forever()

    async def chatty(channel) -> None:
        while True:
            await channel.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await trio.sleep(60)

    with trio.fail_after(2000):
        reason, elapsed = await run_session(silent)
        assert reason.startswith("no client event for 120 s") and 120 <= elapsed < 121
        reason, elapsed = await run_session(chatty)
        assert "600 s limit" in reason and 600 <= elapsed < 603


async def test_the_socket_closes_with_the_ttl_reason(nursery, home):
    gateway = await start_gateway(nursery, home, realtime_idle_secs=0.5)
    with trio.fail_after(30):
        async with trio_websocket.open_websocket_url(ws_url(gateway)) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.created"
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason.code == 1000 and "no client event for 0.5 s" in closed.value.reason.reason


async def test_two_sessions_at_once_and_a_vanished_client_leaves_nothing_behind(nursery, voice_home):
    gateway = await start_gateway(nursery, voice_home)
    with trio.fail_after(300):
        pcm = await spoken_pcm24(gateway, QUESTION)

        async def turn() -> dict:
            async with trio_websocket.open_websocket_url(ws_url(gateway)) as ws:
                await ws.get_message()
                await append_audio(ws, pcm)
                await send(ws, {"type": "input_audio_buffer.commit"})
                return await until_type(ws, "response.done", [])

        results = []

        async def collect():
            results.append(await turn())

        async with trio.open_nursery() as both:
            both.start_soon(collect)
            both.start_soon(collect)
        assert [r["response"]["status"] for r in results] == ["completed", "completed"]

        async with trio_websocket.open_websocket_url(ws_url(gateway)) as ws:  # vanish mid-turn
            await ws.get_message()
            await append_audio(ws, pcm)
            await send(ws, {"type": "input_audio_buffer.commit"})
            await until_type(ws, "response.audio_transcript.delta", [])
        async with gateway.client() as http:
            async def settled():
                rows = await ps(http)
                return rows and all(r["in_flight"] == 0 and r["queued"] == 0 for r in rows)

            while not await settled():  # noqa: ASYNC110 - the engines finish the request that was cut off
                await trio.sleep(0.05)


async def test_a_turn_is_admitted_on_every_lane_under_the_connections_key(nursery, voice_home):
    """The key may use whisper and the voice but not the chat model: the turn hears, then fails at the chat
    stage with the scope refusal, and the session goes on."""
    from blazar.config import ConfigFile
    from tests.conftest import issued

    secret = "plm_" + "e5" * 16
    voice_home.config.write_text(f'[[keys]]\nname = "kiosk"\nsecret = "{issued(secret)}"\n'
                                 f'models = ["whisper:tiny.en", "{VOICE}"]\n')
    gateway = await start_gateway(nursery, voice_home, keys=ConfigFile(voice_home.config).load({}).keys)
    headers = {"authorization": f"Bearer {secret}"}
    with trio.fail_after(120):
        async with gateway.client(timeout=60, headers=headers) as http:
            response = await http.post("/v1/audio/speech", json={"model": VOICE, "input": QUESTION,
                                                                 "response_format": "pcm"})
        pcm = resample(response.content, int(response.headers["x-sample-rate"]))
        key_header = [(b"authorization", headers["authorization"].encode())]
        async with trio_websocket.open_websocket_url(ws_url(gateway, "?stt_model=tiny.en"),
                                                     extra_headers=key_header) as ws:
            await ws.get_message()
            await append_audio(ws, pcm)
            await send(ws, {"type": "input_audio_buffer.commit"})
            seen: list[dict] = []
            done = await until_type(ws, "response.done", seen)
    assert any(e["type"].endswith("input_audio_transcription.completed") for e in seen)
    refused = next(e for e in seen if e["type"] == "error")
    assert "smollm2:135m" in refused["error"]["message"] and done["response"]["status"] == "failed"


async def test_the_example_voice_client_takes_a_realtime_turn(live, voice_home, tmp_path):
    import sys
    import wave

    from tests.test_audio import EXAMPLE

    answer = tmp_path / "answer.wav"
    with trio.fail_after(180):
        done = await trio.run_process([sys.executable, str(EXAMPLE), "--realtime", "--say", QUESTION, str(answer),
                                       "--url", live.url], capture_stdout=True, capture_stderr=True, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "you said:" in out and "france" in out.lower()
    with wave.open(str(answer)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnframes() / 24_000 > 0.5
