"""GET /v1/realtime: a WebSocket voice turn (STT -> chat -> TTS) on the whisper, text and piper lanes.

A mailbox like the other routes: it checks the query, admits the connection under its key, and hands one
RealtimeSession (supervisors/realtime.py) to the Session supervisor (supervisors/sessions.py), whose task
accepts the socket and serves it; the route waits for it to end (and ends it if the client vanishes). The
session reaches the engines through `GatewayPipeline`, each stage admitted and charged under the
connection's key like a request.
Quart-Trio's own WebSocket support serves it, so it shares the gateway's one server and one port.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
import trio
from quart import Blueprint, websocket
from quart.wrappers import Websocket
from werkzeug.local import LocalProxy

from blazar import audio_models
from blazar.pcm import resample
from dialects.chat_core import run_chat
from dialects.current import current_services, required
from dialects.edge import caller_of, owner, respond
from dialects.roles import Role, role
from supervisors.actor import ActorError
from supervisors.instance import StreamFailure, UpstreamCall, UpstreamReply
from supervisors.realtime import RealtimeSession, Settings, Sink
from supervisors.refusal import Refusal
from supervisors.relay import acting_for, admit_request, forward
from supervisors.services import Services

from .audio_routes import _transcribe_once, _voice_rate, whisper_model
from .audio_translate import text_of

blueprint = Blueprint("realtime", __name__)

DEFAULT_CHAT = "smollm2:135m"
MAX_REPLY_TOKENS = 200


class GatewayPipeline:
    """The session's engines: the same canonical calls as the HTTP routes, under the connection's key."""

    def __init__(self, services: Services, key: str | None, chat_model: str, trace_id: str) -> None:
        self.services = services
        self.key = key
        self.chat_model = chat_model
        self.trace_id = trace_id

    def _turn(self) -> Any:
        """A stage of a turn acts as the connection's key, at normal priority (someone is listening)."""
        return acting_for(self.services, self.key, trace_id=self.trace_id, priority=None)

    async def transcribe(self, wav: bytes, model: str) -> str:
        async with self._turn() as who:
            result = await _transcribe_once(self.services, whisper_model(self.services, model), wav,
                                            {"task": "transcribe"}, who)
        return text_of(result)

    async def chat(self, messages: list[dict[str, Any]], sink: Sink) -> None:
        body = {"model": self.chat_model, "messages": messages, "stream": True, "max_tokens": MAX_REPLY_TOKENS,
                "repeat_penalty": 1.1}
        async with self._turn() as who:
            result = await run_chat(self.services, body, who)
            assert result.chunks is not None  # asked for a stream: chunk dicts
            async for chunk in result.chunks:
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        await sink(piece)

    async def speak(self, text: str, voice: str, sink: Sink) -> None:
        rate = await trio.to_thread.run_sync(_voice_rate, self.services, voice)
        async with self._turn() as who:
            result = await forward(self.services, voice, UpstreamCall(
                method="POST", path="/synthesize", body=msgspec.json.encode({"text": text, "raw": True}), stream=True,
                content_type="application/json"), who,
                lane_kind="piper")
            if isinstance(result, UpstreamReply):
                raise Refusal(502, f"piper refused: {result.engine_message}")
            with result.chunks:
                async for item in result.chunks:
                    if isinstance(item, StreamFailure):
                        raise Refusal(502, item.message)
                    await sink(resample(item.data, rate))


@blueprint.websocket("/v1/realtime")
@role(Role.KEY)
async def realtime():
    services = current_services()
    voices = await trio.to_thread.run_sync(audio_models.installed_voices, services.paths)
    voice = websocket.args.get("voice") or (audio_models.DEFAULT_VOICE if audio_models.DEFAULT_VOICE in voices
                                            else (voices[0] if voices else ""))
    settings = Settings(model=websocket.args.get("model") or DEFAULT_CHAT, voice=voice,
                        stt_model=websocket.args.get("stt_model") or "whisper-1")
    key = owner(websocket.scope)
    try:
        # Admitted like a request of its key (rpm, and a max_concurrent place held while the connection is open);
        # each turn's stages are then admitted and charged on their own.
        who = caller_of(websocket.scope, websocket.headers)
        await admit_request(services, "", "requests", who)
    except Refusal as refusal:
        return respond(refusal, websocket.path)
    # The work runs in the session supervisor's task, outside this one's context: it holds the Websocket itself.
    # (Quart types its context-local `websocket` as the Websocket; at runtime it is the proxy in front of it.)
    connection = cast("LocalProxy[Websocket]", websocket)._get_current_object()
    session = RealtimeSession(settings, GatewayPipeline(services, key, settings.model, who.trace_id),
                              idle_ttl=services.config.realtime_idle_secs, hard_ttl=services.config.realtime_max_secs)

    async def serve(stop: trio.Event) -> str:
        await connection.accept()
        return await session.run(connection.receive, connection.send, stop)

    try:
        ticket = await required(services.sessions).start("realtime", key, serve, lambda: {
            "session": session.id, "model": session.settings.model, "voice": session.settings.voice}, capped=True)
    except ActorError as error:
        return respond(Refusal.from_err(error.err), websocket.path)
    try:
        await ticket.done.wait()
    finally:
        if not ticket.done.is_set():
            ticket.scope.cancel()  # the client vanished: its session ends with its connection
    with trio.move_on_after(2):
        await websocket.close(1001 if ticket.stop.is_set() else 1000, ticket.reason[:120])
