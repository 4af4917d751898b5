"""The engine roster: a real (cached, incremental) source build, `engine local`, a failed build that
leaves the roster alone, and the roster rules (use, rollback, rm refusals, prune)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import trio

from blazar.engines import EngineEntry, EngineError, Roster
from blazar.paths import Paths
from tests.conftest import arun_cli, run_cli


async def test_build_cpu_produces_a_llama_server_that_answers_version(home: Paths, shared_home: Paths,
                                                                     shared_engine):
    version = shared_engine.source["version"]
    env = {**os.environ, "BLAZAR_BUILD_CACHE": str(shared_home.engines)}
    result = await arun_cli("engine", "build", "cpu", "--version", version, "--json", env=env, seconds=1500)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert {line["step"] for line in lines if line["event"] == "progress"} >= {"configure", "build", "install", "probe"}
    done = lines[-1]
    assert done["event"] == "done" and done["active"] is True and done["tag"] == f"b{version}-cpu"
    server = Path(done["binary"])
    assert server.is_relative_to(home.engines)
    answer = await trio.run_process([str(server), "--version"], capture_stdout=True, capture_stderr=True)
    assert answer.returncode == 0 and b"version: " in answer.stderr + answer.stdout
    assert set(done["tools"]) == {"llama-quantize", "rpc-server"}
    assert (home.engines / done["tag"] / "build.log").exists()
    assert "-DBUILD_SHARED_LIBS=OFF" in done["flags"]
    listed = [json.loads(line) for line in run_cli("engine", "list", "--json").stdout.splitlines()]
    assert [(row["tag"], row["active"]) for row in listed] == [(done["tag"], True)]


def test_a_failed_build_says_which_step_and_keeps_the_roster(home: Paths, tmp_path: Path, shared_engine):
    Roster(home).register_local(Path(shared_engine.binary), tag="keep-me")
    broken = tmp_path / "llama.cpp"
    (broken / "tools" / "server").mkdir(parents=True)
    (broken / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(broken)\nthis is not cmake(\n")
    result = run_cli("engine", "build", "cpu", "--source", str(broken), timeout=300)
    assert result.returncode == 1
    assert "failed at step 'configure'" in result.stderr and "full log:" in result.stderr
    assert "roster is unchanged" in result.stderr
    assert [e.tag for e in Roster(home).entries()] == ["keep-me"]
    assert Roster(home).read().active == "keep-me"


def test_engine_local_probes_the_binary(home: Paths, shared_engine):
    result = run_cli("engine", "local", shared_engine.binary, "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)
    assert row["tag"].startswith("local-") and row["pseudo"] is True and row["active"] is True
    assert row["sha256"] == shared_engine.sha256
    refused = run_cli("engine", "local", "/bin/true")
    assert refused.returncode == 1 and "is not a llama.cpp server" in refused.stderr


def _entry(tag: str, created: float) -> EngineEntry:
    return EngineEntry(tag=tag, binary=f"/opt/{tag}/llama-server", sha256=tag * 4, created_at=created, pseudo=True)


@pytest.fixture
def roster(home: Paths) -> Roster:
    roster = Roster(home)
    now = time.time()
    for index, tag in enumerate(["b100-cpu", "b200-cpu", "b300-cpu", "b400-cpu"]):
        roster.add(_entry(tag, now + index))
    return roster


def test_newest_build_is_active_and_rollback_returns_to_the_previous(roster: Roster):
    assert roster.read().active == "b400-cpu"
    roster.use("b200")  # unique prefix
    assert roster.read().active == "b200-cpu"
    assert roster.rollback().tag == "b400-cpu"
    assert roster.rollback().tag == "b200-cpu"


def test_rm_refuses_the_active_engine(roster: Roster):
    with pytest.raises(EngineError, match="b400-cpu is the active engine") as caught:
        roster.remove("b400-cpu")
    assert "engine use" in caught.value.fix


def test_rm_refuses_an_engine_with_a_live_child(roster: Roster, home: Paths):
    children = home.run / "children"
    children.mkdir(parents=True)
    (children / "a.json").write_text(
        json.dumps({"pid": os.getpid(), "model": "smollm2:135m", "engine_tag": "b300-cpu"}))
    with pytest.raises(EngineError, match="live children serving smollm2:135m") as caught:
        roster.remove("b300-cpu")
    assert caught.value.fix == "blazar stop smollm2:135m"
    # A stale pidfile (its process is gone) does not block.
    (children / "a.json").write_text(json.dumps({"pid": 2**22 + 12345, "model": "x", "engine_tag": "b300-cpu"}))
    assert roster.remove("b300-cpu").tag == "b300-cpu"


def test_prune_keeps_the_newest_and_the_active(roster: Roster):
    roster.use("b100-cpu")
    removed = roster.prune(keep=1)
    assert sorted(removed) == ["b200-cpu", "b300-cpu"]
    assert sorted(e.tag for e in roster.entries()) == ["b100-cpu", "b400-cpu"]


def test_cli_rm_and_rollback_teach(roster: Roster):
    result = run_cli("engine", "rm", "b400-cpu")
    assert result.returncode == 1 and "is the active engine" in result.stderr and "fix:" in result.stderr
    unknown = run_cli("engine", "use", "b999")
    assert unknown.returncode == 1 and "installed: b100-cpu, b200-cpu, b300-cpu, b400-cpu" in unknown.stderr
