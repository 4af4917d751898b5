"""`blazar`: the command line, grouped as the spec's CLI section.

Every `--json` output is JSONL on stdout and nothing else; logs and progress go to stderr.
"""

from __future__ import annotations

import sys

import asyncclick as click

from blazar import __version__
from blazar.cli.output import EXIT_UNAVAILABLE, fail

SECTIONS: list[tuple[str, list[str]]] = [
    ("Serve & chat", ["serve", "run", "ps", "stop", "launch", "session", "jobs"]),
    ("Model management", ["pull", "import", "cp", "create", "rm", "list", "show", "quantize", "mmproj",
                          "search", "fit", "lora"]),
    ("Tuning & benchmarks", ["bench", "tune", "drafts", "coreside"]),
    ("Engine & config", ["engine", "rpc", "config", "keys", "whisper", "doctor", "migrate", "snapshot", "upgrade",
                         "completions"]),
    ("Observability", ["why", "watch"]),
    ("Refused by design (no cloud services)", ["push", "signin", "signout", "login", "logout"]),
]
ALIASES = {"start": "serve", "ls": "list"}


class SectionedGroup(click.Group):
    """A group that resolves aliases and lists its commands in the spec's sections."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, ALIASES.get(cmd_name, cmd_name))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        listed = set()
        for title, names in SECTIONS:
            rows = []
            for name in names:
                command = self.commands.get(name)
                if command is None or command.hidden:
                    continue
                listed.add(name)
                alias = [a for a, target in ALIASES.items() if target == name]
                label = f"{name} (alias {alias[0]})" if alias else name
                rows.append((label, command.get_short_help_str(limit=80)))
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        rest = [(n, c.get_short_help_str(80)) for n, c in sorted(self.commands.items())
                if n not in listed and not c.hidden]
        if rest:
            with formatter.section("Other"):
                formatter.write_dl(rest)


@click.group(cls=SectionedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="blazar")
def cli() -> None:
    """Blazar: one local port for OpenAI, Ollama and Anthropic clients, real engines behind it."""
    from blazar.logs import setup_logging

    setup_logging()


# ---------------------------------------------------------------- refused and not-yet commands

NO_CLOUD = ("blazar {name}: refused by design: Blazar has no cloud registry and no accounts, so there "
            "is nothing to {verb}. Models live in $BLAZAR_HOME/models; share one with `blazar cp` "
            "or copy the GGUF file.")
REFUSED = {"push": "push to", "signin": "sign in to", "signout": "sign out of", "login": "log in to",
           "logout": "log out of"}


def _refused(name: str, verb: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"Refused: no cloud services ({verb} nothing).")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        fail(NO_CLOUD.format(name=name, verb=verb), code=2)

    return command


# What each not-yet command will do, and the capability it waits for. They exit non-zero and
# print nothing on stdout, so no script mistakes them for a result.
PENDING: dict[str, tuple[str, str]] = {
    "launch": ("exec an agent CLI against the daemon", "the text lane"),
    "session": ("slot KV checkpoints per model", "session banks"),
    "quantize": ("derive a quantization with llama-quantize", "the model store and engine roster"),
    "lora": ("LoRA adapter management", "LoRA variants"),
    "tune": ("grid search of serving knobs", "the benchmark harness"),
    "drafts": ("speculative draft candidates", "speculative decoding"),
    "coreside": ("VRAM co-residency plan", "the GPU census"),
    "snapshot": ("config + store + sessions backup", "the model store"),
    "upgrade": ("self-update", "release channels"),
    "why": ("sentinel detections for a trace", "the sentinel"),
    "watch": ("live tail of sentinel detections", "the sentinel"),
}


def _pending(name: str, purpose: str, waits_for: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"{purpose[0].upper()}{purpose[1:]} (not in this build yet).")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        fail(f"blazar {name}: not in this build yet ({purpose}); it arrives with {waits_for}. "
             "Nothing was done.", code=EXIT_UNAVAILABLE)

    return command


def _register() -> None:
    from blazar.cli import (
        bench_cmd,
        chat_cmd,
        completions,
        config_cmd,
        doctor_cmd,
        engine_cmd,
        jobs_cmd,
        keys_cmd,
        models_cmd,
        rpc_cmd,
        serve_cmd,
        whisper_cmd,
    )

    for command in (serve_cmd.serve, serve_cmd.stop, config_cmd.config, doctor_cmd.doctor,
                    completions.completions, engine_cmd.engine, models_cmd.pull, models_cmd.import_,
                    models_cmd.cp, models_cmd.create, models_cmd.rm, models_cmd.list_, models_cmd.show,
                    models_cmd.mmproj, models_cmd.search, models_cmd.fit, chat_cmd.run, chat_cmd.ps,
                    bench_cmd.bench, keys_cmd.keys, keys_cmd.migrate, jobs_cmd.jobs, whisper_cmd.whisper, rpc_cmd.rpc):
        cli.add_command(command)
    for name, (purpose, waits_for) in PENDING.items():
        if name not in cli.commands:
            cli.add_command(_pending(name, purpose, waits_for))
    for name, verb in REFUSED.items():
        cli.add_command(_refused(name, verb))


_register()


def entrypoint() -> None:
    from blazar.paths import RelativeHome

    try:
        cli(_anyio_backend="trio")
    except KeyboardInterrupt:
        sys.exit(130)
    except RelativeHome as error:
        print(f"blazar: {error}", file=sys.stderr)
        sys.exit(78)
