"""`blazar config list|get|set|unset|defaults|edit`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import asyncclick as click
import msgspec
import trio

from blazar.cli.output import EXIT_CONFIG, emit_json, fail, say
from blazar.config import (
    Config,
    ConfigError,
    ConfigFile,
    defaults_toml,
    effective_with_sources,
    join_key,
    lookup,
    parse_cli_value,
    set_in_document,
    split_key,
    starter_toml,
    unset_in_document,
)
from blazar.paths import Paths

json_option = click.option("--json", "as_json", is_flag=True, help="JSONL on stdout.")


def _file() -> ConfigFile:
    return ConfigFile(Paths.from_env().config)


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _guard(error: ConfigError) -> None:
    fail(error.message, fix=error.fix, code=EXIT_CONFIG if "not valid TOML" in error.message else 1)


@click.group()
def config() -> None:
    """config.toml management (dotted keys; quoted segments stay one segment)."""


@config.command("list")
@json_option
async def list_(as_json: bool) -> None:
    """Every effective key with its value and where it came from (default, file, env)."""
    try:
        rows = await trio.to_thread.run_sync(effective_with_sources, _file())
    except ConfigError as error:
        _guard(error)
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        if as_json:
            emit_json({"key": key, "value": value, "source": source})
        else:
            say(f"{key.ljust(width)} = {_show(value)}  ({source})")


@config.command()
@click.argument("key")
@json_option
async def get(key: str, as_json: bool) -> None:
    """Print one effective value (a table prints as a whole)."""
    try:
        parts = split_key(key)
        rows = await trio.to_thread.run_sync(effective_with_sources, _file())
        effective = msgspec.to_builtins(await trio.to_thread.run_sync(_file().load))
    except ConfigError as error:
        _guard(error)
    found, value = lookup(effective, parts)
    if not found:
        from blazar.config import _schema_kind

        try:
            _schema_kind(parts)
        except ConfigError as error:
            _guard(error)
        fail(f"{join_key(parts)} is not set", fix=f"blazar config set {join_key(parts)} VALUE")
    source = next((s for k, _, s in rows if k == join_key(parts)), "default")
    if parts[0] == "keys":
        from blazar.keys import redact_entries

        value = redact_entries(value)
    elif parts[0] == "remotes":  # a peer url may hold user:pass@
        from blazar.fabric_config import redacted_remotes

        value = redacted_remotes(value)
    if as_json:
        emit_json({"key": join_key(parts), "value": value, "source": source})
    else:
        say(value if isinstance(value, str) else _show(value))


@config.command("set")
@click.argument("key")
@click.argument("value")
@json_option
async def set_(key: str, value: str, as_json: bool) -> None:
    """Set KEY to VALUE in config.toml (validated first; the old file is kept as a .bak)."""
    config_file = _file()

    def change(document):
        parts = split_key(key)
        parsed = parse_cli_value(value)
        try:
            set_in_document(document, parts, parsed)
            from blazar.config import validate

            validate(document.unwrap())
        except ConfigError:
            # `keep_alive 300` or `bind 8080`: a bare literal where the schema wants text.
            if isinstance(parsed, str):
                raise
            set_in_document(document, parts, value)

    try:
        await trio.to_thread.run_sync(config_file.mutate, change)
    except ConfigError as error:
        _guard(error)
    parts = split_key(key)
    _, stored = lookup(config_file.file_data(), parts)
    _report(as_json, {"key": join_key(parts), "value": stored, "file": str(config_file.path)},
            f"{join_key(parts)} = {_show(stored)}  (written to {config_file.path})")


@config.command()
@click.argument("key")
@json_option
async def unset(key: str, as_json: bool) -> None:
    """Remove KEY from config.toml so the default (or environment) applies again."""
    config_file = _file()
    removed = False

    def change(document):
        nonlocal removed
        removed = unset_in_document(document, split_key(key))

    try:
        parts = split_key(key)
        await trio.to_thread.run_sync(config_file.mutate, change)
    except ConfigError as error:
        _guard(error)
    message = (f"{join_key(parts)} removed from {config_file.path}" if removed
               else f"{join_key(parts)} was not set in {config_file.path}; nothing changed")
    _report(as_json, {"key": join_key(parts), "removed": removed, "file": str(config_file.path)}, message)


@config.command()
@json_option
async def defaults(as_json: bool) -> None:
    """Print the built-in defaults (TOML with comments, or JSON)."""
    if as_json:
        emit_json(msgspec.to_builtins(Config()))
    else:
        say(defaults_toml().rstrip())


@config.command()
async def edit() -> None:
    """Open config.toml in $VISUAL/$EDITOR; the result is validated before it replaces the file."""
    outcome = await trio.to_thread.run_sync(_edit_in_editor, _file())
    say(outcome)


def _edit_in_editor(config_file: ConfigFile) -> str:
    """Edit a draft copy; only a draft that validates replaces the file. A bad draft is kept."""
    original = config_file.read_text() or starter_toml()
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    handle, name = tempfile.mkstemp(prefix="blazar-config-", suffix=".toml")
    draft = Path(name)
    with os.fdopen(handle, "w") as out:
        out.write(original)
    result = subprocess.call([*shlex.split(editor), str(draft)])
    if result != 0:
        fail(f"the editor exited with {result}; config.toml is unchanged", fix=f"your draft is kept at {draft}")
    text = draft.read_text()
    if text == original:
        draft.unlink()
        return "no changes"
    try:
        config_file.replace_text(text)
    except ConfigError as error:
        fail(f"not saved: {error.message}", fix=f"{error.fix}; your draft is kept at {draft}: fix it and "
             f"copy it over {config_file.path}", code=EXIT_CONFIG)
    draft.unlink()
    return f"saved {config_file.path}"


def _report(as_json: bool, payload: dict[str, Any], text: str) -> None:
    if as_json:
        emit_json(payload)
    else:
        say(text)
