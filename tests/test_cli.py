"""The CLI as a user runs it: config commands, refusals, not-yet commands, completions, and the
purity of every `--json` output (JSONL on stdout, nothing else)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import asyncclick as click
import pytest

from blazar.cli.main import PENDING, REFUSED, cli
from blazar.paths import Paths
from tests.conftest import BLAZAR as BLAZAR_EXE
from tests.conftest import run_cli


def json_commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in group.commands.items():
        path = (*prefix, name)
        if isinstance(command, click.Group):
            found.extend(json_commands(command, path))
        elif any("--json" in getattr(p, "opts", []) for p in command.params):
            found.append(path)
    return found


# Arguments that make each --json command do real work. A new --json command without an entry
# here fails test_every_json_command_is_covered.
JSON_ARGS: dict[tuple[str, ...], list[str]] = {
    ("config", "list"): [],
    ("config", "get"): ["engine.retention"],
    ("config", "set"): ['models."smollm2:135m".num_ctx', "2048"],
    ("config", "unset"): ["keep_alive"],
    ("config", "defaults"): [],
    ("doctor",): [],
    ("stop",): [],  # no daemon running: the refusal must keep stdout empty
    ("whisper",): ["--list"],
}


# --json commands whose purity is asserted where their scenario lives.
COVERED_ELSEWHERE = {
    ("rpc", "serve"): "tests/test_rpc.py::test_a_model_spread_over_two_workers_answers_like_the_local_one",
    ("engine", "build"): "tests/test_engines.py::test_build_cpu_produces_a_llama_server_that_answers_version",
    ("pull",): "tests/test_models.py::test_pull_picks_the_preferred_quant_and_records_the_hash",
    ("search",): "tests/test_models.py::test_search_filters_by_quant",
    ("engine", "update"): "tests/test_cli.py::test_store_and_roster_commands_print_pure_jsonl",
    ("ps",): "tests/test_cli.py::test_run_ps_and_stop_against_a_live_daemon",
    ("bench",): "tests/test_cli.py::test_bench_stores_figures_that_show_reports",
    ("keys", "add"): "tests/test_keys.py::test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log",
    ("keys", "list"): "tests/test_keys.py::test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log",
    ("keys", "rotate"): "tests/test_keys.py::test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log",
    ("keys", "rm"): "tests/test_keys.py::test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log",
    ("migrate",): "tests/test_keys.py::test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log",
    ("jobs", "list"): "tests/test_jobs.py::test_the_jobs_cli_lists_shows_cancels_and_tails_events",
    ("jobs", "show"): "tests/test_jobs.py::test_the_jobs_cli_lists_shows_cancels_and_tails_events",
    ("jobs", "cancel"): "tests/test_jobs.py::test_the_jobs_cli_lists_shows_cancels_and_tails_events",
    ("jobs", "events"): "tests/test_jobs.py::test_the_jobs_cli_lists_shows_cancels_and_tails_events",
}
SCENARIO = {("import",), ("cp",), ("list",), ("show",), ("create",), ("mmproj",), ("fit",), ("rm",),
            ("engine", "local"), ("engine", "list"), ("engine", "use"), ("engine", "rollback"),
            ("engine", "prune"), ("engine", "rm")}


def test_every_json_command_is_covered():
    assert set(json_commands()) == set(JSON_ARGS) | set(COVERED_ELSEWHERE) | SCENARIO


def test_store_and_roster_commands_print_pure_jsonl(home: Paths, tmp_path, shared_engine):
    from tests.fakehub import make_gguf

    model = make_gguf(tmp_path / "tiny.Q8_0.gguf", payload_mib=0.1)
    projector = make_gguf(tmp_path / "mmproj.gguf", name="proj", payload_mib=0.05)
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM tiny:q8_0\nPARAMETER num_ctx 1024\n")
    steps = [
        ("import", str(model)), ("cp", "tiny:q8_0", "alias:1"), ("list",), ("ls",), ("show", "alias"),
        ("create", "made", "-f", str(modelfile)), ("mmproj", "alias", str(projector)), ("pull", "alias", "--verify"),
        ("fit", "alias"), ("rm", "alias", "made"),
        ("engine", "local", shared_engine.binary), ("engine", "local", shared_engine.binary, "--tag", "second"),
        ("engine", "list"), ("engine", "use", "second"), ("engine", "rollback"), ("engine", "prune", "--keep", "1"),
        ("engine", "rm", "second"), ("engine", "update", "--check"),
    ]
    printed: dict[tuple[str, ...], list[dict]] = {}
    for step in steps:
        result = run_cli(*step, "--json")
        assert result.returncode == 0, (step, result.stderr)
        lines = result.stdout.splitlines()
        assert lines, step
        printed[step] = [json.loads(line) for line in lines]
    # What the store commands did, not only that they printed JSON: `list` (and `ls`) lists the import and the copy, and
    # `mmproj` attached the projector (its digest), which makes the model a vision model.
    assert sorted(row["name"] for row in printed[("list",)]) == ["alias:1", "tiny:q8_0"]
    assert printed[("ls",)] == printed[("list",)]
    [attached] = printed[("mmproj", "alias", str(projector))]
    assert attached["name"] == "alias:1" and attached["mmproj"] == hashlib.sha256(projector.read_bytes()).hexdigest()
    shown = json.loads(run_cli("show", "tiny:q8_0", "--json").stdout)
    assert "mmproj" not in shown or shown["mmproj"] is None  # the projector went to alias:1 only


@pytest.mark.parametrize("path", sorted(JSON_ARGS))
def test_json_output_is_pure_jsonl(home: Paths, path):
    result = run_cli(*path, *JSON_ARGS[path], "--json")
    for line in result.stdout.splitlines():
        json.loads(line)
    if path == ("stop",):
        assert result.returncode == 1 and result.stdout == ""
        assert "no blazar daemon is running" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip(), "a --json command that succeeded printed nothing"


def test_config_set_get_unset_through_the_cli(home: Paths):
    home.config.write_text("# mine\nlog_level = \"info\"\n")
    assert run_cli("config", "set", 'models."smollm2:135m".num_ctx', "4096").returncode == 0
    assert run_cli("config", "set", "keep_alive", "300").returncode == 0  # stays a string when it must
    got = run_cli("config", "get", 'models."smollm2:135m".num_ctx', "--json")
    assert json.loads(got.stdout) == {"key": 'models."smollm2:135m".num_ctx', "value": 4096, "source": "file"}
    assert run_cli("config", "get", "keep_alive").stdout.strip() == "300"
    text = home.config.read_text()
    assert text.startswith("# mine\n") and '[models."smollm2:135m"]' in text
    assert list(home.home.glob("config.toml.*.bak"))
    unset = run_cli("config", "unset", 'models."smollm2:135m".num_ctx', "--json")
    assert json.loads(unset.stdout)["removed"] is True
    assert "smollm2" not in home.config.read_text()


def test_config_set_unknown_key_lists_the_valid_keys(home: Paths):
    result = run_cli("config", "set", "keepalive", "5m")
    assert result.returncode == 1
    assert "unknown config key 'keepalive'" in result.stderr
    assert "Did you mean keep_alive" in result.stderr and "engine.retention" in result.stderr
    assert result.stdout == ""
    assert not home.config.exists()


def test_config_set_invalid_value_teaches_and_keeps_the_file(home: Paths):
    home.config.write_text('log_level = "info"\n')
    result = run_cli("config", "set", "log_level", "chatty")
    assert result.returncode == 1
    assert "log_level" in result.stderr and "debug | info | warning | error" in result.stderr
    assert home.config.read_text() == 'log_level = "info"\n'


def test_config_get_respects_environment(home: Paths):
    result = run_cli("config", "get", "bind", "--json", env={**os.environ, "BLAZAR_HOST": "0.0.0.0:1234"})
    assert json.loads(result.stdout) == {"key": "bind", "value": "0.0.0.0:1234", "source": "env"}


def test_config_edit_refuses_an_invalid_draft_and_keeps_it(home: Paths, tmp_path):
    home.config.write_text('log_level = "info"\n')
    editor = tmp_path / "editor.sh"
    editor.write_text('#!/bin/sh\necho "[engine\\n" >> "$1"\n')
    editor.chmod(0o755)
    result = run_cli("config", "edit", env={**os.environ, "EDITOR": str(editor)})
    assert result.returncode == 78
    assert "not saved" in result.stderr and "your draft is kept at" in result.stderr
    assert home.config.read_text() == 'log_level = "info"\n'


def test_config_edit_saves_a_valid_draft(home: Paths, tmp_path):
    editor = tmp_path / "editor.sh"
    # The draft starts as the commented defaults, which end inside [engine]: insert at the top.
    editor.write_text('#!/bin/sh\nsed -i \'1i keep_alive = "1h"\' "$1"\n')
    editor.chmod(0o755)
    result = run_cli("config", "edit", env={**os.environ, "EDITOR": str(editor)})
    assert result.returncode == 0, result.stderr
    assert run_cli("config", "get", "keep_alive").stdout.strip() == "1h"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_cloud_commands_are_refused(home: Paths, name):
    result = run_cli(name, "smollm2:135m")
    assert result.returncode == 2
    assert "refused by design" in result.stderr and "no cloud" in result.stderr
    assert result.stdout == ""


def test_not_yet_commands_say_so_and_exit_nonzero(home: Paths):
    pending = [n for n in PENDING if n in cli.commands and cli.commands[n].help.endswith("(not in this build yet).")]
    assert pending
    for name in pending[:3]:
        result = run_cli(name, "anything")
        assert result.returncode == 69
        assert "not in this build yet" in result.stderr and "Nothing was done" in result.stderr
        assert result.stdout == ""


def test_aliases_reach_their_commands(home: Paths):
    assert "Run the daemon" in run_cli("start", "--help").stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish", "powershell"])
def test_completion_scripts(shell):
    result = run_cli("completions", shell)
    assert result.returncode == 0
    assert "_BLAZAR_COMPLETE" in result.stdout


def test_bash_completion_completes_commands():
    env = {**os.environ, "_BLAZAR_COMPLETE": "bash_complete", "COMP_WORDS": "blazar con", "COMP_CWORD": "1"}
    assert "config" in run_cli(env=env).stdout


def test_powershell_completion_completes_subcommands():
    env = {**os.environ, "_BLAZAR_COMPLETE": "powershell_complete", "COMP_WORDS": "blazar config u"}
    values = [line.split("\t")[0] for line in run_cli(env=env).stdout.splitlines()]
    assert values == ["unset"]


def test_doctor_groups_and_cpu_only_note(home: Paths):
    rows = [json.loads(line) for line in run_cli("doctor", "--json").stdout.splitlines()]
    assert {row["group"] for row in rows} >= {"SYSTEM", "GPU", "ENGINES", "MODELS", "CHANNELS", "RUNTIME"}
    gpu = [row for row in rows if row["group"] == "GPU"]
    assert gpu and all(row["status"] in ("ok", "info") for row in gpu)
    flat = run_cli("doctor", "--flat").stdout.splitlines()
    assert all(line.split()[0] in {"SYSTEM", "GPU", "ENGINES", "MODELS", "CHANNELS", "RUNTIME"} for line in flat)


def test_doctor_fails_on_a_broken_config(home: Paths):
    home.config.write_text("bind = = 1\n")
    result = run_cli("doctor", "--json")
    assert result.returncode == 1
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert any(r["group"] == "CHANNELS" and r["status"] == "fail" and "config.toml:1:" in r["detail"]
               for r in rows)


async def test_run_ps_and_stop_against_a_live_daemon(home: Paths, tmp_path, shared_home, shared_engine):
    import trio

    from tests.conftest import ServeProcess, arun_cli
    from tests.lane_fixtures import add_shared_model, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(120):
            await server.start()
            answer = await arun_cli("run", "-v", "--max-tokens", "8", "Say hi to the reader.")
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout.strip() and "eval count:" in answer.stderr
            rows = [json.loads(line) for line in (await arun_cli("ps", "--json")).stdout.splitlines()]
            assert [(r["model"], r["state"]) for r in rows] == [("smollm2:135m", "ready")]
            doctor = [json.loads(line) for line in (await arun_cli("doctor", "--json")).stdout.splitlines()]
            runtime = {row["check"]: row for row in doctor if row["group"] == "RUNTIME"}
            assert "smollm2:135m (ready" in runtime["residents"]["detail"]
            assert runtime["latency"]["status"] == "ok" and runtime["daemon"]["status"] == "ok"
            stopped = await arun_cli("stop", "smollm2", "--json")
            assert json.loads(stopped.stdout) == {"status": "evicted", "model": "smollm2:135m"}
            assert (await arun_cli("ps", "--json")).stdout == ""
            refused = await arun_cli("run", "--max-tokens", "5", "smollm2")
            assert refused.returncode == 1 and "one-shot prompts only" in refused.stderr
            assert json.loads((await arun_cli("stop", "--json")).stdout)["stopped"] is True
            assert await server.wait() == 0
    finally:
        server.kill()


async def test_bench_stores_figures_that_show_reports(home: Paths, shared_home, shared_engine):
    from tests.conftest import arun_cli
    from tests.lane_fixtures import add_shared_model, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    result = await arun_cli("bench", "smollm2", "--runs", "1", "--tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["model"] == "smollm2:135m" and figures["pp_tps"] > 0 and figures["tg_tps"] > 0
    shown = json.loads((await arun_cli("show", "smollm2", "--json")).stdout)
    assert shown["last_benchmark"]["tg_tps"] == figures["tg_tps"]
    assert "generation" in (await arun_cli("show", "smollm2")).stdout


def test_a_relative_blazar_home_is_refused_before_anything_is_written(tmp_path):
    env = {**os.environ, "BLAZAR_HOME": "relative-home"}
    result = subprocess.run([BLAZAR_EXE, "config", "list"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=60)
    assert result.returncode == 78 and "absolute path" in result.stderr
    assert list(tmp_path.iterdir()) == []
