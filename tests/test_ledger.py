"""The ledger: migrations at boot, the upgrade path from an old file, and the actor's calls."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import apsw
import pytest
import trio

from blazar import ledger as db
from supervisors.actor import supervise
from supervisors.ledger import LedgerActor, LedgerClient


def test_fresh_ledger_is_at_the_current_schema_in_wal_mode(tmp_path: Path):
    connection = db.open_ledger(tmp_path / "ledger.sqlite")
    assert db.schema_version(connection) == db.SCHEMA_VERSION
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_v1_ledger_is_upgraded_and_keeps_its_rows(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    old = apsw.Connection(str(path))
    db.migrate(old, target=1)
    old.execute("INSERT INTO events (ts, kind, model, detail) VALUES (1.5, 'spawn', 'smollm2:135m', '{}')")
    old.close()

    upgraded = db.open_ledger(path)
    assert db.schema_version(upgraded) == db.SCHEMA_VERSION
    assert db.query(upgraded, "SELECT kind, model FROM events") == [{"kind": "spawn", "model": "smollm2:135m"}]
    # Tables from later migrations exist and work.
    db.execute(upgraded, "INSERT INTO key_usage (key_name, day, requests) VALUES ('ci', '2026-12-02', 1)")
    db.execute(upgraded, "INSERT INTO benchmarks (ts, model, engine_tag, tg_tps) VALUES (1, 'm', 'b1-cpu', 9.5)")
    assert {r["name"] for r in db.query(upgraded, "SELECT name FROM sqlite_master WHERE type='index'")} >= {
        "events_kind_ts", "benchmarks_model"}


def test_a_ledger_from_a_newer_blazar_is_refused(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    newer = apsw.Connection(str(path))
    newer.execute(f"PRAGMA user_version = {db.SCHEMA_VERSION + 1}")
    newer.close()
    with pytest.raises(db.LedgerTooNew, match="upgrade Blazar"):
        db.open_ledger(path)


async def test_ledger_actor_writes_and_reads_off_the_trio_thread(nursery, tmp_path: Path):
    with trio.fail_after(10):
        client = LedgerClient(await nursery.start(partial(supervise, lambda: LedgerActor(tmp_path / "l.sqlite"))))
        assert client.record_event("spawn", model="smollm2:135m", port=1234)
        await client.execute("INSERT INTO events (ts, kind, detail) VALUES (2, 'evict', '{}')")
        events = await client.recent_events()
        assert [e["kind"] for e in events] == ["evict", "spawn"]
        assert '"port": 1234' in events[1]["detail"]
        assert [e["kind"] for e in await client.recent_events(kind="spawn")] == ["spawn"]
