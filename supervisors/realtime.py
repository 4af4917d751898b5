"""A realtime voice session: one WebSocket connection, three tasks in one nursery, typed events between them.

    reader  (socket -> inbox)      decodes each client event into a msgspec Struct, or an error event
    session (inbox -> outbox)      this actor's loop: the only code that changes the session's state
    turn    (a child task)         STT -> chat (streamed) -> TTS sentence by sentence, reporting by message
    writer  (outbox -> socket)     encodes server events

Session states (only the loop changes them):

    idle --commit / response.create--> in_turn --(turn done | failed | cancelled)--> idle
    idle|in_turn --idle TTL (120 s without a client event) | hard TTL (600 s)--> closing (socket closed, reason)
    idle|in_turn --stop (the session supervisor drains: the gateway shuts down)--> closing, after an `error`
                   event with code `gateway_shutdown`

- The audio buffer holds PCM16 mono at 24 kHz (OpenAI's realtime default), up to 20 MiB; an append past
  that is an error event and the buffer keeps what fits. `input_audio_buffer.clear` empties it.
- `session.update` (voice, input_audio_transcription.model, instructions) applies from the next turn.
- `conversation.item.create` text items feed later turns: at most 16 items / 8192 characters, oldest first
  out (each eviction is a `conversation.item.deleted` event).
- During a turn, `input_audio_buffer.commit` and `response.create` are out of band: a teaching error event,
  the turn goes on. `response.cancel` stops the turn between its stages (after STT, between sentences).
- A dropped socket cancels this session's nursery and nothing else: the turn's engine requests close
  with it.

The session runs as a task of the Session supervisor (supervisors/sessions.py), which lists it, counts it
against its key and stops it at drain. The engines are reached through a `Pipeline` the composition root
gives (the dialect layer's canonical calls), so this actor holds no HTTP or engine knowledge.
"""

from __future__ import annotations

import base64
import re
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import trio

from blazar.pcm import pcm_to_wav

BUFFER_LIMIT = 20 * 1024 * 1024
IDLE_TTL_SECS = 120.0
HARD_TTL_SECS = 600.0
CONTEXT_ITEMS = 16
CONTEXT_CHARS = 8192
INPUT_RATE = 24_000
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "response.create", "response.cancel", "conversation.item.create")


Sink = Callable[[Any], Awaitable[None]]


class Pipeline(Protocol):
    """The three engines a turn reaches, each under the session's key. Streamed results go to `sink` as
    they come (text pieces; PCM16 mono at 24 kHz)."""

    async def transcribe(self, wav: bytes, model: str) -> str: ...

    async def chat(self, messages: list[dict[str, Any]], sink: Sink) -> None: ...

    async def speak(self, text: str, voice: str, sink: Sink) -> None: ...


@dataclass
class Settings:
    model: str
    voice: str
    stt_model: str
    instructions: str = "You are a helpful voice assistant. Answer briefly, in one or two sentences."


class _TurnEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What the turn task reports to the session loop: a server event to send, or its end."""

    event: dict | None
    finished: bool


@dataclass
class _Turn:
    id: str
    cancel_requested: bool = False
    reply: list[str] = field(default_factory=list)


def sentences(buffer: str) -> tuple[list[str], str]:
    """Complete sentences in `buffer`, and the rest still being written."""
    parts = SENTENCE_END.split(buffer)
    return [p.strip() for p in parts[:-1] if p.strip()], parts[-1]


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class RealtimeSession:
    def __init__(self, settings: Settings, pipeline: Pipeline, *, idle_ttl: float = IDLE_TTL_SECS,
                 hard_ttl: float = HARD_TTL_SECS) -> None:
        self.id = f"sess_{secrets.token_hex(10)}"
        self.settings = settings
        self.pending: dict[str, Any] = {}  # session.update fields waiting for the next turn
        self.pipeline = pipeline
        self.buffer = bytearray()
        self.context: deque[dict[str, Any]] = deque()
        self.turn: _Turn | None = None
        self.idle_ttl = idle_ttl
        self.hard_ttl = hard_ttl
        self.close_reason = ""

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.session", "model": self.settings.model,
                "voice": self.settings.voice, "instructions": self.settings.instructions,
                "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                "input_audio_transcription": {"model": self.settings.stt_model}, "turn_detection": None}

    async def run(self, receive: Callable[[], Awaitable[str | bytes]], send: Callable[[str], Awaitable[None]],
                  stop: trio.Event | None = None) -> str:
        """Serve the connection until the client leaves, a TTL ends it or `stop` is set (the gateway drains: the
        client gets an `error` event with code `gateway_shutdown` first); returns the close reason."""
        inbox_send, inbox = trio.open_memory_channel[dict[str, Any] | _TurnEvent](64)
        outbox_send, outbox = trio.open_memory_channel[dict[str, Any]](256)
        self.inbox_send = inbox_send
        self.out = outbox_send
        flushed = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._reader, receive, inbox_send.clone())
            nursery.start_soon(self._writer, send, outbox, flushed)
            await self._emit({"type": "session.created", "session": self.describe()})
            with trio.move_on_after(self.hard_ttl) as hard, trio.CancelScope() as serving:
                if stop is not None:
                    nursery.start_soon(_cancel_when, stop, serving)
                await self._loop(inbox)
            if hard.cancelled_caught:
                self.close_reason = f"session reached its {self.hard_ttl:g} s limit; reconnect to go on"
            elif serving.cancelled_caught:
                self.close_reason = "the gateway is shutting down; reconnect when it is back"
                await self._emit({"type": "error", "error": {"type": "server_error", "code": "gateway_shutdown",
                                                             "message": self.close_reason, "param": None,
                                                             "event_id": None}})
            await self.out.aclose()  # the writer sends what is queued, then stops
            with trio.move_on_after(2):
                await flushed.wait()
            nursery.cancel_scope.cancel()  # the reader, and a turn still running
        return self.close_reason

    async def _reader(self, receive: Callable[[], Awaitable[str | bytes]], inbox: trio.MemorySendChannel) -> None:
        async with inbox:
            while True:
                raw = await receive()
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                try:
                    event = msgspec.json.decode(text)
                    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                        raise ValueError("an event is a JSON object with a string `type`")
                except (msgspec.DecodeError, ValueError) as error:
                    event = {"type": "_invalid", "message": f"the event is not valid JSON ({error})"}
                await inbox.send(event)

    async def _writer(self, send: Callable[[str], Awaitable[None]], outbox: trio.MemoryReceiveChannel,
                      flushed: trio.Event) -> None:
        async with outbox:
            async for event in outbox:
                await send(msgspec.json.encode(event).decode())
        flushed.set()

    async def _emit(self, event: dict[str, Any]) -> None:
        event.setdefault("event_id", f"event_{secrets.token_hex(8)}")
        await self.out.send(event)

    async def _error(self, message: str, *, code: str = "invalid_request_error", param: str | None = None,
                     event_id: str | None = None) -> None:
        await self._emit({"type": "error", "error": {"type": "invalid_request_error", "code": code,
                                                     "message": message, "param": param, "event_id": event_id}})

    async def _loop(self, inbox: trio.MemoryReceiveChannel) -> None:
        while True:
            with trio.move_on_after(self.idle_ttl) as idle:
                message = await inbox.receive()
            if idle.cancelled_caught:
                if self.turn is not None:
                    continue  # a turn in progress is not idleness
                self.close_reason = f"no client event for {self.idle_ttl:g} s; reconnect to go on"
                return
            if isinstance(message, _TurnEvent):
                if message.event is not None:
                    await self._emit(message.event)
                if message.finished:
                    self.turn = None
                continue
            await self._handle(message)

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        client_id = event.get("event_id")
        if kind == "_invalid":
            await self._error(event["message"], code="invalid_json")
        elif kind not in CLIENT_EVENTS:
            await self._error(f"unknown event type {kind!r}; this gateway takes {', '.join(CLIENT_EVENTS)}",
                              code="unknown_event", param="type", event_id=client_id)
        elif kind == "input_audio_buffer.append":
            await self._append(event, client_id)
        elif kind == "input_audio_buffer.clear":
            self.buffer.clear()
            await self._emit({"type": "input_audio_buffer.cleared"})
        elif kind == "session.update":
            await self._update(event.get("session"), client_id)
        elif kind == "conversation.item.create":
            await self._add_item(event.get("item"), client_id)
        elif kind == "response.cancel":
            if self.turn is None:
                await self._error("no response is running to cancel", code="response_cancel_not_active",
                                  event_id=client_id)
            else:
                self.turn.cancel_requested = True
        elif self.turn is not None:  # commit or response.create during a turn
            await self._error(f"{kind} while a response is running: wait for response.done, or send "
                              "response.cancel first", code="conversation_already_has_active_response",
                              event_id=client_id)
        elif not self.buffer:
            await self._error("the audio buffer is empty: send input_audio_buffer.append events first",
                              code="input_audio_buffer_commit_empty", event_id=client_id)
        else:
            await self._start_turn()

    async def _append(self, event: dict[str, Any], client_id: str | None) -> None:
        try:
            audio = base64.b64decode(event.get("audio") or "", validate=True)
        except ValueError:
            await self._error("`audio` must be base64 of PCM16 mono at 24 kHz", code="invalid_audio", param="audio",
                              event_id=client_id)
            return
        room = BUFFER_LIMIT - len(self.buffer)
        if len(audio) > room:
            self.buffer += audio[:max(0, room) - max(0, room) % 2]
            await self._error(f"the audio buffer is full ({BUFFER_LIMIT // (1024 * 1024)} MiB, about 7 minutes); "
                              "it kept what fit: commit it, or clear it", code="input_audio_buffer_full",
                              event_id=client_id)
            return
        self.buffer += audio

    async def _update(self, session: Any, client_id: str | None) -> None:
        if not isinstance(session, dict):
            await self._error("`session` must be an object", param="session", event_id=client_id)
            return
        changes: dict[str, Any] = {}
        for name in session:
            if name == "voice" and isinstance(session[name], str):
                changes["voice"] = session[name]
            elif name == "instructions" and isinstance(session[name], str):
                changes["instructions"] = session[name]
            elif name == "input_audio_transcription" and isinstance(session[name], dict) and \
                    isinstance(session[name].get("model"), str):
                changes["stt_model"] = session[name]["model"]
            elif name not in ("modalities", "input_audio_format", "output_audio_format", "turn_detection"):
                await self._error(f"session.{name} cannot be changed here; this gateway takes voice, instructions "
                                  "and input_audio_transcription.model", param=f"session.{name}",
                                  event_id=client_id)
                return
        self.pending.update(changes)
        preview = Settings(**{**self.settings.__dict__, **self.pending})
        saved, self.settings = self.settings, preview
        described = self.describe()
        self.settings = saved
        await self._emit({"type": "session.updated", "session": described, "applies_from": "next_turn"})

    async def _add_item(self, item: Any, client_id: str | None) -> None:
        content = item.get("content") if isinstance(item, dict) else None
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ("user", "assistant", "system") or not isinstance(content, list):
            await self._error("`item` must be {\"type\": \"message\", \"role\": user|assistant|system, \"content\": "
                              "[{\"type\": \"input_text\", \"text\": …}]}", param="item", event_id=client_id)
            return
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not text:
            await self._error("the item has no text: content parts need {\"type\": \"input_text\", \"text\": …}",
                              param="item.content", event_id=client_id)
            return
        stored = {"id": item.get("id") or f"item_{secrets.token_hex(8)}", "role": role, "text": text[:CONTEXT_CHARS]}
        self.context.append(stored)
        await self._emit({"type": "conversation.item.created", "item": {
            "id": stored["id"], "type": "message", "role": role,
            "content": [{"type": "input_text", "text": stored["text"]}]}})
        while len(self.context) > CONTEXT_ITEMS or sum(len(i["text"]) for i in self.context) > CONTEXT_CHARS:
            evicted = self.context.popleft()
            await self._emit({"type": "conversation.item.deleted", "item_id": evicted["id"]})

    async def _start_turn(self) -> None:
        if self.pending:
            self.settings = Settings(**{**self.settings.__dict__, **self.pending})
            self.pending.clear()
        audio = bytes(self.buffer)
        self.buffer.clear()
        turn = _Turn(id=f"resp_{secrets.token_hex(10)}")
        self.turn = turn
        item_id = f"item_{secrets.token_hex(8)}"
        await self._emit({"type": "input_audio_buffer.committed", "item_id": item_id, "previous_item_id": None})
        context = [{"role": i["role"], "content": i["text"]} for i in self.context]
        self.nursery.start_soon(self._run_turn, turn, item_id, audio, context, Settings(**self.settings.__dict__))

    async def _run_turn(self, turn: _Turn, item_id: str, audio: bytes, context: list[dict[str, Any]],
                        settings: Settings) -> None:
        """The turn: its events go to the loop by message; it ends with exactly one `finished`."""
        status = "completed"
        async with self.inbox_send.clone() as report:
            async def emit(event: dict[str, Any]) -> None:
                await report.send(_TurnEvent(event=event, finished=False))

            status = await self._stages(turn, item_id, audio, context, settings, emit)
            await report.send(_TurnEvent(event={"type": "response.done", "response": {
                "id": turn.id, "object": "realtime.response", "status": status,
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "audio", "transcript": "".join(turn.reply)}]}]}}, finished=True))

    async def _stages(self, turn: _Turn, item_id: str, audio: bytes, context: list[dict[str, Any]],
                      settings: Settings, emit: Callable[[dict[str, Any]], Awaitable[None]]) -> str:
        try:
            heard = await self.pipeline.transcribe(pcm_to_wav(audio, INPUT_RATE), settings.stt_model)
        except Exception as error:  # the engine's teaching refusal, for the client
            await emit({"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                        "content_index": 0, "error": {"type": "transcription_error",
                                                       "message": getattr(error, "message", str(error))}})
            return "failed"
        await emit({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                    "content_index": 0, "transcript": heard, "model": settings.stt_model})
        if turn.cancel_requested:
            return "cancelled"
        await emit({"type": "response.created", "response": {"id": turn.id, "object": "realtime.response",
                                                              "status": "in_progress"}})
        messages = [{"role": "system", "content": settings.instructions}, *context, {"role": "user", "content": heard}]
        speech_send, speech_receive = trio.open_memory_channel[str](16)
        audio_item = f"item_{secrets.token_hex(8)}"
        pending = ""

        async def on_piece(piece: str) -> None:
            nonlocal pending
            turn.reply.append(piece)
            await emit({"type": "response.audio_transcript.delta", "response_id": turn.id, "item_id": audio_item,
                        "output_index": 0, "content_index": 0, "delta": piece})
            done, pending = sentences(pending + piece)
            for sentence in done:
                await speech_send.send(sentence)

        failure: BaseException | None = None
        try:
            async with trio.open_nursery() as stages:
                stages.start_soon(self._speak, turn, speech_receive, settings.voice, audio_item, emit)
                async with speech_send:
                    await self.pipeline.chat(messages, on_piece)
                    if pending.strip():
                        await speech_send.send(pending.strip())
        except* Exception as group:  # an engine's refusal ends this turn, never the session
            failure = group.exceptions[0]
        if failure is not None:
            await emit({"type": "error", "error": {"type": "server_error", "code": "response_failed",
                                                   "message": getattr(failure, "message", str(failure)),
                                                   "param": None, "event_id": None}})
            return "failed"
        await emit({"type": "response.audio_transcript.done", "response_id": turn.id, "item_id": audio_item,
                    "output_index": 0, "content_index": 0, "transcript": "".join(turn.reply)})
        await emit({"type": "response.audio.done", "response_id": turn.id, "item_id": audio_item,
                    "output_index": 0, "content_index": 0})
        return "cancelled" if turn.cancel_requested else "completed"

    async def _speak(self, turn: _Turn, sentences_in: trio.MemoryReceiveChannel, voice: str, item_id: str,
                     emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Each complete sentence is spoken as soon as the chat has written it (a cancel stops between them)."""

        async def on_pcm(pcm: bytes) -> None:
            await emit({"type": "response.audio.delta", "response_id": turn.id, "item_id": item_id,
                        "output_index": 0, "content_index": 0, "delta": base64.b64encode(pcm).decode()})

        async with sentences_in:
            async for sentence in sentences_in:
                if turn.cancel_requested:
                    continue  # the chat stream is not cancellable mid-way: its remaining sentences are dropped
                await self.pipeline.speak(sentence, voice, on_pcm)
