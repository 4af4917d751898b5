"""`blazar bench <model>`: prompt and generation tokens/s of the active engine on a model, stored."""

from __future__ import annotations

import json
import time
from pathlib import Path

import asyncclick as click
import trio

from blazar.cli.output import emit_json, fail, note, say
from blazar.engines import EngineError, Roster
from blazar.paths import Paths
from blazar.store import Store, StoreError


@click.command()
@click.argument("model")
@click.option("--runs", default=3, show_default=True, help="Measurements; the median is reported.")
@click.option("--tokens", "n_predict", default=64, show_default=True, help="Tokens generated per run.")
@click.option("--json", "as_json", is_flag=True, help="One JSON line.")
async def bench(model: str, runs: int, n_predict: int, as_json: bool) -> None:
    """pp/tg benchmark of MODEL on the active engine (history feeds `show`, /api/benchmarks and tune gates)."""
    from blazar.ledger import execute, open_ledger
    from lanes import quickbench

    paths = Paths.from_env().ensure()

    def measure() -> dict:
        store = Store(paths)
        manifest = store.resolved(model)
        engine = Roster(paths).require_active()
        figures = quickbench.measure(Path(engine.binary), store.blob_of(manifest), runs=runs, n_predict=n_predict)
        ledger = open_ledger(paths.ledger)
        try:
            execute(ledger, "INSERT INTO benchmarks (ts, model, engine_tag, pp_tps, tg_tps, detail) VALUES "
                    "(?, ?, ?, ?, ?, ?)", (time.time(), manifest.name, engine.tag, figures["pp_tps"], figures["tg_tps"],
                                           json.dumps({"source": "blazar bench", **figures})))
        finally:
            ledger.close()
        return {"model": manifest.name, "engine": engine.tag, **figures}

    note(f"benchmarking {model} ({runs} runs of {n_predict} tokens) on a private engine child")
    try:
        result = await trio.to_thread.run_sync(measure)
    except (StoreError, EngineError) as error:
        fail(error.message, fix=error.fix)
    except RuntimeError as error:
        fail(f"the engine failed during the benchmark: {error}")
    if as_json:
        emit_json(result)
    else:
        say(f"{result['model']} on {result['engine']}: prompt {result['pp_tps']:.1f} tok/s, "
            f"generation {result['tg_tps']:.1f} tok/s (median of {runs})")


def last_benchmark(paths: Paths, model: str) -> dict | None:
    """The newest stored benchmark of a model, for `blazar show` (blocking)."""
    if not paths.ledger.exists():
        return None
    import apsw

    connection = apsw.Connection(str(paths.ledger), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        row = connection.execute("SELECT ts, engine_tag, pp_tps, tg_tps FROM benchmarks WHERE model = ? "
                                 "ORDER BY ts DESC LIMIT 1", (model,)).fetchone()
    except apsw.SQLError:
        return None
    finally:
        connection.close()
    if row is None:
        return None
    return {"measured_at": row[0], "engine": row[1], "pp_tps": row[2], "tg_tps": row[3]}
